"""BCQ, continuous and discrete: losses, the candidate pass, checkpoints and behaviour."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from offaug.algorithms import registry
from offaug.algorithms.base import Spaces, soft_update, spaces_from_transitions
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.learners.bcq import (
    BCQ,
    BCQConfig,
    actor_loss,
    perturb,
    soft_clipped_double_q,
    vae_loss,
)
from offaug.algorithms.learners.discrete_bcq import (
    DiscreteBCQ,
    DiscreteBCQConfig,
    allowed_actions,
    constrained_greedy,
    discrete_bcq_loss,
)
from offaug.algorithms.learners.losses import ensemble_td_loss, td_target
from offaug.algorithms.nn.kernels import Workspace, tiled_mlp
from offaug.algorithms.nn.networks import ensemble_affines, mlp_affines
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import MixtureSampler, Transitions, load_transitions

SMALL = BCQConfig(
    actor_hidden=(32, 32), critic_hidden=(32, 32), vae_hidden=(32, 32), n_action_samples=10
)
SMALL_DISCRETE = DiscreteBCQConfig(hidden=(32, 32), learning_rate=1e-3, target_update_interval=5)
BOX = Spaces(11, 3, action_low=(-1.0,) * 3, action_high=(1.0,) * 3)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core machine OpenMP's spinning threads make these
    small updates 30x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hopper(make_test_dataset) -> Transitions:
    return load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)


@pytest.fixture(scope="module")
def cartpole(make_test_dataset) -> Transitions:
    return load_transitions(make_test_dataset("cartpole", "hdf5").dataset_id)


def _spaces(data: Transitions) -> Spaces:
    return spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)


def _batches(data: Transitions, n: int, seed: int = 0, size: int = 64) -> list[TorchBatch]:
    sampler = MixtureSampler([data], size, seed=seed)
    return [TorchBatch.from_batch(sampler.sample()) for _ in range(n)]


def _build(kind: type[BCQ] | type[DiscreteBCQ], spaces: Spaces, config: object, seed: int):
    torch.manual_seed(seed)
    return kind(spaces, config, device="cpu")  # type: ignore[arg-type]


def _tensors(state: object) -> list[torch.Tensor]:
    """Every tensor in a (nested) state dict, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _tensors(item)]
    return []


def _synthetic(rng: np.random.Generator, rows: int) -> TorchBatch:
    """A deterministic, state-dependent behaviour ``a = 0.8 tanh(2 s[:3])``; reward ``sum(a)``
    prefers ``a = +1`` everywhere, far from most behaviour actions."""
    observations = rng.normal(0.0, 0.5, (rows, 11)).astype(np.float32)
    actions = (0.8 * np.tanh(2.0 * observations[:, :3])).astype(np.float32)
    return TorchBatch(
        observations=torch.from_numpy(observations),
        actions=torch.from_numpy(actions),
        rewards=torch.from_numpy(actions.sum(-1)),
        next_observations=torch.from_numpy(rng.normal(0.0, 0.5, (rows, 11)).astype(np.float32)),
        terminals=torch.zeros(rows),
        timeouts=torch.zeros(rows),
        weights=torch.ones(rows),
    )


# ---- pure losses ------------------------------------------------------------------------------


def _loss_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = 6
    return {
        "recon": torch.randn(batch, 3, generator=g),
        "actions": torch.randn(batch, 3, generator=g),
        "mean": torch.randn(batch, 6, generator=g),
        "log_std": torch.randn(batch, 6, generator=g) * 0.3,
        "q": torch.randn(2, batch, generator=g),
        "targets": torch.randn(batch, generator=g),
        "logits": torch.randn(batch, 4, generator=g),
        "discrete_actions": torch.randint(0, 4, (batch,), generator=g),
    }


def _all_losses(x: dict[str, torch.Tensor], weights: torch.Tensor | None) -> list[torch.Tensor]:
    vae = vae_loss(x["recon"], x["actions"], x["mean"], x["log_std"], 0.5, weights)
    discrete = discrete_bcq_loss(
        x["q"], x["targets"], x["logits"], x["discrete_actions"], 0.5, weights
    )
    return [
        vae.total,
        vae.reconstruction,
        vae.kl,
        ensemble_td_loss(x["q"], x["targets"], weights),
        actor_loss(x["q"][0], weights),
        discrete.total,
        discrete.td,
        discrete.imitation,
        discrete.regularisation,
    ]


def test_all_ones_weights_equal_the_unweighted_losses_exactly() -> None:
    x = _loss_inputs()
    for unweighted, ones in zip(_all_losses(x, None), _all_losses(x, torch.ones(6)), strict=True):
        assert torch.equal(unweighted, ones)


def test_integer_weights_act_as_repeated_samples() -> None:
    x = _loss_inputs(1)
    weights = torch.tensor([0.0, 1.0, 2.0, 1.0, 3.0, 1.0])
    repeats = weights.long()
    # Repeat every per-sample input along its batch axis (the critic ensemble's is axis 1).
    repeated = {k: v.repeat_interleave(repeats, dim=1 if k == "q" else 0) for k, v in x.items()}
    scale = len(weights) / weights.sum()  # weighted_mean divides by B, not by sum(weights)
    for weighted, plain in zip(_all_losses(x, weights), _all_losses(repeated, None), strict=True):
        torch.testing.assert_close(weighted * scale, plain)


def test_vae_kl_is_the_gaussian_kl_to_the_standard_normal() -> None:
    x = _loss_inputs(2)
    posterior = torch.distributions.Normal(x["mean"], x["log_std"].exp())
    prior = torch.distributions.Normal(0.0, 1.0)
    expected = torch.distributions.kl_divergence(posterior, prior).mean()
    loss = vae_loss(x["recon"], x["actions"], x["mean"], x["log_std"], 0.5, None)
    torch.testing.assert_close(loss.kl, expected)
    torch.testing.assert_close(loss.total, loss.reconstruction + 0.5 * loss.kl)


def test_soft_clipped_double_q_mixes_min_and_max_then_takes_the_best_candidate() -> None:
    # (E=2, n=3, B=1): per candidate min/max are (0, 4), (2, 3), (1, 1).
    values = torch.tensor([[[0.0], [3.0], [1.0]], [[4.0], [2.0], [1.0]]])
    # 0.75 * min + 0.25 * max = 1.0, 2.25, 1.0 -> the best is 2.25.
    assert soft_clipped_double_q(values, 0.75).tolist() == [2.25]
    assert soft_clipped_double_q(values, 1.0).tolist() == [2.0]  # plain clipped double Q


def test_td_targets_bootstrap_through_timeouts_but_not_terminals() -> None:
    rewards = torch.tensor([1.0, 1.0])
    terminals = torch.tensor([1.0, 0.0])  # the second row may be a timeout: it still bootstraps
    assert td_target(rewards, terminals, torch.tensor([10.0, 10.0]), 0.5).tolist() == [1.0, 6.0]


def test_perturbation_is_bounded_by_phi_and_the_box() -> None:
    actions = torch.tensor([[0.0, 0.99, -0.5]])
    moved = perturb(actions, torch.tensor([[1.0, 1.0, -1.0]]), 0.05)
    torch.testing.assert_close(moved, torch.tensor([[0.05, 1.0, -0.55]]))


def test_allowed_actions_uses_the_probability_relative_to_the_most_likely() -> None:
    probs = torch.tensor([[0.5, 0.2, 0.3], [0.9, 0.05, 0.05]])
    allowed = allowed_actions(probs.log(), 0.5)  # ratios: (1, .4, .6) and (1, .06, .06)
    assert allowed.tolist() == [[True, False, True], [True, False, False]]
    q = torch.tensor([[0.0, 9.0, 1.0], [0.0, 9.0, 9.0]])
    assert constrained_greedy(q, allowed).tolist() == [2, 0]


# ---- continuous BCQ -----------------------------------------------------------------------------


def test_config_defaults_match_d3rlpy_and_the_paper() -> None:
    config = BCQConfig()
    assert (config.batch_size, config.gamma, config.tau, config.lam, config.beta) == (
        100,
        0.99,
        0.005,
        0.75,
        0.5,
    )
    assert (config.n_critics, config.n_action_samples, config.action_flexibility) == (2, 100, 0.05)
    assert (config.actor_hidden, config.vae_hidden) == ((400, 300), (750, 750))
    discrete = DiscreteBCQConfig()
    assert (discrete.learning_rate, discrete.batch_size, discrete.action_flexibility) == (
        6.25e-5,
        32,
        0.3,
    )
    assert discrete.target_update_interval == 8000


def test_updates_on_real_data_give_finite_metrics(hopper: Transitions) -> None:
    trainer = _build(BCQ, _spaces(hopper), SMALL, seed=0)
    for batch in _batches(hopper, 5):
        metrics = trainer.update(batch)
    assert {"vae_loss", "critic_loss", "actor_loss"} <= set(metrics)
    for name, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad, name
        assert torch.isfinite(value), name
    actions = trainer.act(hopper.observations[:7])
    assert actions.shape == (7, 3) and actions.dtype == np.float32
    assert np.all(np.abs(actions) <= 1.0)
    assert trainer.q_values(hopper.observations[:7], hopper.actions[:7]).shape == (7,)


def test_candidate_pass_equals_the_modules(hopper: Transitions) -> None:
    trainer = _build(BCQ, _spaces(hopper), SMALL, seed=3)
    for batch in _batches(hopper, 3):
        trainer.update(batch)
    states = torch.tensor(hopper.observations[:5])
    n, batch_size = SMALL.n_action_samples, 5
    latent = trainer._prior_latent(batch_size)
    candidates, values = trainer._score_candidates(
        states, latent, trainer.actor, trainer.critic, members=2
    )
    # The same thing the slow way: repeat each state n times and run the modules.
    with torch.no_grad():
        flat_states = states.unsqueeze(0).expand(n, batch_size, -1).reshape(n * batch_size, -1)
        decoded = trainer.vae.decode(flat_states, latent.reshape(n * batch_size, -1))
        residual = trainer.actor(torch.cat([flat_states, decoded], -1))
        expected = perturb(decoded, residual, SMALL.action_flexibility)
        expected_values = trainer.critic(flat_states, expected)
    torch.testing.assert_close(candidates.reshape(n * batch_size, -1), expected)
    torch.testing.assert_close(values.reshape(2, n * batch_size), expected_values)


def test_state_dict_round_trip_gives_identical_outputs(hopper: Transitions) -> None:
    trainer = _build(BCQ, _spaces(hopper), SMALL, seed=1)
    for batch in _batches(hopper, 3):
        trainer.update(batch)
    fresh = _build(BCQ, _spaces(hopper), SMALL, seed=2)
    fresh.load_state_dict(trainer.state_dict())
    observations = hopper.observations[:16]
    # act draws from the trainer's own generator, which the state dict carries.
    np.testing.assert_array_equal(fresh.act(observations), trainer.act(observations))
    np.testing.assert_array_equal(fresh.act(observations), trainer.act(observations))
    np.testing.assert_array_equal(
        fresh.q_values(observations, hopper.actions[:16]),
        trainer.q_values(observations, hopper.actions[:16]),
    )
    batch = _batches(hopper, 1, seed=9)[0]
    torch.manual_seed(3)
    a = trainer.update(batch)
    torch.manual_seed(3)
    b = fresh.update(batch)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for x, y in zip(_tensors(trainer.state_dict()), _tensors(fresh.state_dict()), strict=True):
        assert torch.equal(x, y)


def test_all_ones_weights_give_exactly_the_unweighted_update(hopper: Transitions) -> None:
    batch = _batches(hopper, 1)[0]
    ones = dataclasses.replace(batch, weights=torch.ones_like(batch.weights))
    uneven = dataclasses.replace(batch, weights=torch.linspace(0.0, 2.0, len(batch.weights)))
    results = []
    for variant in (batch, ones, uneven):
        trainer = _build(BCQ, _spaces(hopper), SMALL, seed=4)
        torch.manual_seed(6)
        results.append(trainer.update(variant))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
    for name in ("vae_loss", "critic_loss", "actor_loss"):
        assert not torch.equal(results[0][name], results[2][name]), name


def test_same_seed_gives_identical_parameters(hopper: Transitions) -> None:
    runs = []
    for _ in range(2):
        trainer = _build(BCQ, _spaces(hopper), SMALL, seed=7)
        torch.manual_seed(8)
        for batch in _batches(hopper, 4, seed=3):
            trainer.update(batch)
        runs.append(_tensors(trainer.state_dict()))
    assert len(runs[0]) > 20
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def _update_as_drawn_inline(trainer: BCQ, batch: TorchBatch) -> None:
    """BCQ's update as it was written before its noise came from ``draw_noise`` (each draw
    made where it is used, the candidates scored inline), kept to pin the update down."""
    cfg, workspace = trainer.config, Workspace()
    observations, weights = batch.observations, batch.weights
    actions = trainer.normaliser(batch.actions)
    reconstruction, mean, log_std = trainer.vae(observations, actions)
    imitation = vae_loss(reconstruction, actions, mean, log_std, cfg.beta, weights)
    trainer.vae_optimizer.zero_grad(set_to_none=True)
    torch.autograd.backward(imitation.total)
    trainer.vae_optimizer.step()
    if trainer.steps >= cfg.rl_start_step:
        shape = (cfg.n_action_samples, len(observations), trainer.vae.latent_dim)
        latent = torch.randn(shape).clamp_(-0.5, 0.5)
        states = batch.next_observations
        with torch.no_grad():
            decoder = mlp_affines(trainer.vae.decoder)
            decoded = tiled_mlp(decoder, states, latent, workspace, "decoder").tanh_()
            perturbation = mlp_affines(trainer.actor_target.net)
            residual = tiled_mlp(perturbation, states, decoded, workspace, "actor").tanh_()
            candidates = perturb(decoded, residual, cfg.action_flexibility)
            values = torch.stack(
                [
                    tiled_mlp(
                        ensemble_affines(trainer.critic_target.net, e),
                        states,
                        candidates,
                        workspace,
                        f"critic{e}",
                    ).squeeze(-1)
                    for e in range(cfg.n_critics)
                ]
            )
        next_values = soft_clipped_double_q(values, cfg.lam)
        targets = td_target(batch.rewards, batch.terminals, next_values, cfg.gamma)
        loss = ensemble_td_loss(trainer.critic(observations, actions), targets, weights)
        trainer.critic_optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        trainer.critic_optimizer.step()
        if trainer.steps % cfg.update_actor_interval == 0:
            with torch.no_grad():
                latent = torch.randn((len(observations), trainer.vae.latent_dim)).clamp_(-0.5, 0.5)
                decoded = trainer.vae.decode(observations, latent)
            residual = trainer.actor(torch.cat([observations, decoded], dim=-1))
            policy_actions = perturb(decoded, residual, cfg.action_flexibility)
            loss = actor_loss(trainer.critic(observations, policy_actions)[0], weights)
            parameters = list(trainer.actor.parameters())
            for param, grad in zip(parameters, torch.autograd.grad(loss, parameters), strict=True):
                param.grad = grad
            trainer.actor_optimizer.step()
            soft_update(trainer.actor_target, trainer.actor, cfg.tau)
        soft_update(trainer.critic_target, trainer.critic, cfg.tau)
    trainer.steps += 1


@pytest.mark.parametrize(
    "overrides", [{}, {"rl_start_step": 3, "update_actor_interval": 2, "n_critics": 3}]
)
def test_update_draws_and_steps_exactly_as_the_inline_update(
    hopper: Transitions, overrides: dict[str, int]
) -> None:
    """20 seeded updates give bit for bit the parameters, optimiser states and generator
    state of the update written out inline (what a fused run's members are compared with)."""
    config = dataclasses.replace(SMALL, **overrides)
    batches = _batches(hopper, 20, size=32)
    runs = []
    for step in (BCQ.update, _update_as_drawn_inline):
        trainer = _build(BCQ, _spaces(hopper), config, seed=5)
        for batch in batches:
            step(trainer, batch)
        runs.append((_tensors(trainer.state_dict()), torch.get_rng_state()))
    (mine, my_rng), (theirs, their_rng) = runs
    assert len(mine) == len(theirs) > 20 and torch.equal(my_rng, their_rng)
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))


def test_vae_learns_the_behaviour_and_the_policy_stays_near_it() -> None:
    """Batch-constrained: the reward prefers ``a = +1``, yet the learned policy keeps within
    Phi of the dataset's (state-dependent) actions. An untrained VAE fails both checks."""
    rng = np.random.default_rng(0)
    config = dataclasses.replace(SMALL, actor_hidden=(64, 64), vae_hidden=(64, 64))
    trainer = _build(BCQ, BOX, config, seed=0)
    held_out = _synthetic(rng, 200)
    behaviour = held_out.actions.numpy()
    observations = held_out.observations.numpy()

    def decoded_error() -> float:
        return float(np.mean((trainer.sample_vae_actions(observations) - behaviour) ** 2))

    def policy_gap() -> float:
        return float(np.abs(trainer.act(observations) - behaviour).max(-1).mean())

    mean_action_error = float(np.mean((behaviour - behaviour.mean(0)) ** 2))
    uniform_error = float(np.mean((rng.uniform(-1, 1, behaviour.shape) - behaviour) ** 2))
    untrained = decoded_error(), policy_gap()
    assert untrained[0] > 0.5 * mean_action_error
    for _ in range(400):
        trainer.update(_synthetic(rng, 100))
    error = decoded_error()
    assert error < 0.1 * mean_action_error and error < 0.05 * uniform_error
    gap = policy_gap()
    assert gap < config.action_flexibility + 0.1 < untrained[1]


def test_rl_start_step_and_actor_interval(hopper: Transitions) -> None:
    config = dataclasses.replace(SMALL, rl_start_step=2, update_actor_interval=2)
    trainer = _build(BCQ, _spaces(hopper), config, seed=0)
    critic = [p.clone() for p in trainer.critic.parameters()]
    history = []
    for batch in _batches(hopper, 6):
        metrics = trainer.update(batch)
        history.append((metrics, [p.clone() for p in trainer.actor.parameters()]))
    # Steps 0 and 1 train only the VAE; the critics' metrics are NaN until they start.
    assert all(torch.isnan(history[i][0]["critic_loss"]) for i in (0, 1))
    assert all(torch.isfinite(history[i][0]["critic_loss"]) for i in range(2, 6))
    assert not torch.equal(critic[0], next(trainer.critic.parameters()))
    # The actor moves at steps 2 and 4 only.
    moved = [
        not torch.equal(history[i][1][0], history[i - 1][1][0]) for i in range(1, 6)
    ]  # steps 1..5
    assert moved == [False, True, False, True, False]
    assert set(history[0][0]) == set(history[-1][0])


@pytest.mark.parametrize("n_critics", [1, 3])
def test_other_ensemble_sizes(hopper: Transitions, cartpole: Transitions, n_critics: int) -> None:
    trainer = _build(BCQ, _spaces(hopper), dataclasses.replace(SMALL, n_critics=n_critics), 0)
    discrete = _build(
        DiscreteBCQ, _spaces(cartpole), dataclasses.replace(SMALL_DISCRETE, n_critics=n_critics), 0
    )
    for batch in _batches(hopper, 2):
        metrics = trainer.update(batch)
    for batch in _batches(cartpole, 2, size=32):
        metrics.update(discrete.update(batch))
    assert all(torch.isfinite(v) for v in metrics.values())
    for reduction in ("first", "min", "mean"):
        values = trainer.q_values(hopper.observations[:4], hopper.actions[:4], reduction)
        assert values.shape == (4,) and np.isfinite(values).all()
    assert discrete.act(cartpole.observations[:4]).shape == (4,)


def test_act_is_repeatable_from_the_seed_and_varies_with_it() -> None:
    observations = np.random.default_rng(0).normal(size=(4, 11)).astype(np.float32)
    first = _build(BCQ, BOX, dataclasses.replace(SMALL, act_seed=5), seed=0)
    second = _build(BCQ, BOX, dataclasses.replace(SMALL, act_seed=5), seed=0)
    other = _build(BCQ, BOX, dataclasses.replace(SMALL, act_seed=6), seed=0)
    np.testing.assert_array_equal(first.act(observations), second.act(observations))
    assert not np.array_equal(first.act(observations), other.act(observations))


def test_actions_are_returned_in_the_environment_bounds() -> None:
    spaces = Spaces(11, 3, action_low=(0.0, -2.0, 10.0), action_high=(1.0, 2.0, 20.0))
    trainer = _build(BCQ, spaces, SMALL, seed=0)
    actions = trainer.act(np.zeros((50, 11), dtype=np.float32))
    assert np.all(actions >= np.array(spaces.action_low) - 1e-5)
    assert np.all(actions <= np.array(spaces.action_high) + 1e-5)
    assert np.all(actions[:, 2] > 12.0) and np.all(actions[:, 2] < 18.0)  # near the middle


# ---- discrete BCQ ------------------------------------------------------------------------------


def test_discrete_updates_on_real_data_and_acts_only_on_allowed_actions(
    cartpole: Transitions,
) -> None:
    spaces = _spaces(cartpole)
    assert spaces.discrete
    trainer = _build(DiscreteBCQ, spaces, SMALL_DISCRETE, seed=0)
    for batch in _batches(cartpole, 12, size=32):
        metrics = trainer.update(batch)
    for name, value in metrics.items():
        assert torch.isfinite(value), name
    # Make the imitation network rule out action 0 where s[0] > 0, and the Q network prefer
    # action 0 everywhere: the constrained policy must still avoid it there.
    observations = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    with torch.no_grad():
        trainer.network.q_head.bias[..., 0] += 1e3
    allowed = trainer.allowed(observations)
    actions = trainer.act(observations)
    assert allowed[np.arange(64), actions].all()
    unconstrained = trainer.network.q_only(torch.as_tensor(observations)).mean(0).argmax(-1)
    assert (unconstrained == 0).all()
    with torch.no_grad():
        head = trainer.network.imitator
        assert isinstance(head, torch.nn.Linear)
        head.weight.zero_()
        head.bias.copy_(torch.tensor([-10.0, 10.0]))
    assert not trainer.allowed(observations)[:, 0].any()
    assert (trainer.act(observations) == 1).all()


@pytest.mark.parametrize("share_encoder", [True, False])
def test_discrete_imitation_learns_a_state_dependent_behaviour(share_encoder: bool) -> None:
    rng = np.random.default_rng(1)
    spaces = Spaces(4, 3, discrete=True)
    config = dataclasses.replace(SMALL_DISCRETE, share_encoder=share_encoder, learning_rate=3e-3)
    trainer = _build(DiscreteBCQ, spaces, config, seed=0)

    def batch(rows: int) -> TorchBatch:
        observations = rng.normal(size=(rows, 4)).astype(np.float32)
        actions = np.where(observations[:, 0] > 0, 2, 0)  # action 1 never appears
        return TorchBatch(
            observations=torch.from_numpy(observations),
            actions=torch.from_numpy(actions.astype(np.int64)),
            rewards=torch.zeros(rows),
            next_observations=torch.from_numpy(rng.normal(size=(rows, 4)).astype(np.float32)),
            terminals=torch.zeros(rows),
            timeouts=torch.zeros(rows),
            weights=torch.ones(rows),
        )

    for _ in range(300):
        trainer.update(batch(64))
    test = batch(400)
    observations, behaviour = test.observations.numpy(), test.actions.numpy()
    allowed = trainer.allowed(observations)
    assert allowed[np.arange(400), behaviour].mean() > 0.95
    # Away from the behaviour's boundary (s[0] = 0) only the behaviour's action passes.
    far = np.abs(observations[:, 0]) > 0.3
    assert not allowed[far, 1].any()
    assert allowed[far][np.arange(far.sum()), 2 - behaviour[far]].mean() < 0.05
    assert (trainer.act(observations)[far] == behaviour[far]).mean() > 0.95


def test_discrete_round_trip_weights_and_target_copy(cartpole: Transitions) -> None:
    spaces = _spaces(cartpole)
    trainer = _build(DiscreteBCQ, spaces, SMALL_DISCRETE, seed=1)
    for batch in _batches(cartpole, 4, size=32):
        trainer.update(batch)
    assert not torch.equal(trainer.target.q_head.weight, trainer.network.q_head.weight)
    trainer.update(_batches(cartpole, 1, size=32, seed=5)[0])  # step 5: hard copy
    assert torch.equal(trainer.target.q_head.weight, trainer.network.q_head.weight)
    fresh = _build(DiscreteBCQ, spaces, SMALL_DISCRETE, seed=2)
    fresh.load_state_dict(trainer.state_dict())
    observations = cartpole.observations[:32]
    np.testing.assert_array_equal(fresh.act(observations), trainer.act(observations))
    np.testing.assert_array_equal(
        fresh.q_values(observations, cartpole.actions[:32]),
        trainer.q_values(observations, cartpole.actions[:32]),
    )
    batch = _batches(cartpole, 1, size=32, seed=9)[0]
    ones = dataclasses.replace(batch, weights=torch.ones_like(batch.weights))
    a, b = trainer.update(batch), fresh.update(ones)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_registry_builds_both_and_refuses_the_wrong_action_space(
    hopper: Transitions, cartpole: Transitions
) -> None:
    assert isinstance(registry.build("bcq", _spaces(hopper), {"n_critics": 3}), BCQ)
    assert isinstance(registry.build("discrete_bcq", _spaces(cartpole)), DiscreteBCQ)
    with pytest.raises(ValueError, match="discrete"):
        registry.build("bcq", _spaces(cartpole))
    with pytest.raises(ValueError, match="unknown BCQConfig fields"):
        registry.build("bcq", _spaces(hopper), {"hidden": [8]})


# ---- the training loop ---------------------------------------------------------------------------


def test_training_loop_end_to_end_and_load_trainer(make_test_dataset, tmp_path: Path) -> None:
    dataset_id = make_test_dataset("hopper", "hdf5").dataset_id
    config = {
        "actor_hidden": [32, 32],
        "critic_hidden": [32, 32],
        "vae_hidden": [32, 32],
        "n_action_samples": 10,
    }
    options = TrainOptions(
        steps=50, log_every=25, eval_every=50, eval_episodes=1, checkpoint_every=50
    )
    result = train("bcq", [dataset_id], tmp_path / "run", config=config, options=options)
    assert result.last_evaluation is not None
    assert np.isfinite(result.last_evaluation.mean_return)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"train"' in line for line in lines) == 2
    restored = load_trainer(result.checkpoint)
    again = load_trainer(result.checkpoint)
    assert isinstance(restored, BCQ) and restored.steps == 50
    observations = load_transitions(dataset_id).observations[:3]
    actions = restored.act(observations)
    assert actions.shape == (3, 3)
    np.testing.assert_array_equal(again.act(observations), actions)
