"""Batch-Constrained deep Q-learning (BCQ), continuous and discrete.

* Continuous: Fujimoto, Meger, Precup 2019, "Off-Policy Deep Reinforcement Learning without
  Exploration" (ICML; arXiv:1812.02900), Algorithm 1. A conditional VAE G(a|s) models the
  dataset's actions; a perturbation network xi(s, a) moves a decoded action by at most
  ``action_flexibility`` (Phi); twin critics are trained towards a soft clipped double-Q target
  taken over ``n_action_samples`` perturbed candidates of the next state, and the policy picks
  the best of as many candidates by Q_1.
* Discrete: Fujimoto, Conti, Ghavamzadeh, Pineau 2019, "Benchmarking Batch Deep Reinforcement
  Learning Algorithms" (arXiv:1910.01708), section 4. An imitation network G(a|s) allows only
  actions whose probability relative to the most likely one exceeds ``action_flexibility``;
  Double-DQN picks the next action among the allowed ones.

Hyperparameter defaults follow d3rlpy 2.8's ``BCQConfig``/``DiscreteBCQConfig``; the continuous
network sizes follow the paper (400-300 actor and critics, 750-750 VAE), because d3rlpy 2.8's
default encoder is 256-256 for every network. Actions are learned in the normalised box
``[-1, 1]^d`` (:class:`ActionNormaliser`). Every loss term is weighted per sample by
``batch.weights`` (:func:`weighted_mean`), so importance-weighted augmented data weights the
VAE, critic, actor, TD and imitation terms alike.

Training noise (VAE reparameterisation, candidate latents) comes from torch's global generator,
which the training loop seeds and checkpoints; ``act`` draws its candidates from a generator the
trainer owns, so evaluation repeats exactly from a checkpoint.

Scoring the ``n * B`` candidates is most of a step. It runs in :func:`_tiled_mlp` on the same
parameters as the modules (a test checks the two agree): each state's share of a first layer is
computed once, not ``n`` times, and activations go to buffers reused between steps.

Where this differs from d3rlpy 2.8: the decoder ends in tanh, as in the paper (d3rlpy's
``with_squash`` flag is inverted, so its decoder is unbounded); ``update_actor_interval`` is
honoured (d3rlpy's BCQ ignores it); the actor step computes no critic weight gradients.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.nn import functional as F

from offaug.algorithms.base import (
    Spaces,
    adam,
    choose_device,
    index_tensor,
    soft_update,
    to_tensor,
    weighted_mean,
)
from offaug.algorithms.distributions import ActionNormaliser
from offaug.algorithms.networks import (
    MLP,
    VAE,
    CriticEnsemble,
    DeterministicActor,
    EnsembleLinear,
    EnsembleMLP,
)
from offaug.datasets.sampler import TorchBatch

ModuleT = TypeVar("ModuleT", bound=nn.Module)

QReduction = Literal["first", "min", "mean"]
"""How ``q_values`` combines an ensemble: the first critic (the one BCQ acts on), min or mean."""

# Clip of the VAE's prior samples, N(0, 1) clipped to [-0.5, 0.5] (paper, appendix D).
LATENT_CLIP = 0.5


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BCQConfig:
    """Continuous BCQ hyperparameters (defaults: d3rlpy 2.8 ``BCQConfig``, paper sizes)."""

    actor_hidden: tuple[int, ...] = (400, 300)
    """Hidden widths of the perturbation network xi(s, a)."""
    critic_hidden: tuple[int, ...] = (400, 300)
    """Hidden widths of each critic Q_e(s, a)."""
    vae_hidden: tuple[int, ...] = (750, 750)
    """Hidden widths of the VAE's encoder and of its decoder."""
    latent_dim: int | None = None
    """VAE latent size; None means ``2 * action_dim`` (paper and d3rlpy)."""
    actor_learning_rate: float = 1e-3
    """Adam learning rate of the perturbation network."""
    critic_learning_rate: float = 1e-3
    """Adam learning rate of the critics."""
    imitator_learning_rate: float = 1e-3
    """Adam learning rate of the VAE."""
    batch_size: int = 100
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Polyak rate of the target networks."""
    n_critics: int = 2
    """Critics in the ensemble (2: clipped double Q)."""
    update_actor_interval: int = 1
    """Gradient steps per actor (and actor-target) update; the critics update every step."""
    lam: float = 0.75
    """Target weight of the ensemble minimum: ``lam * min + (1 - lam) * max`` over critics."""
    n_action_samples: int = 100
    """Candidate actions per state, both in the critic target and in ``act``."""
    action_flexibility: float = 0.05
    """Phi: largest perturbation of a decoded action, in the normalised ``[-1, 1]`` box."""
    rl_start_step: int = 0
    """Steps that train only the VAE before the critics and actor start."""
    beta: float = 0.5
    """Weight of the VAE's KL term."""
    act_seed: int | None = None
    """Seed of the generator behind ``act``'s candidates; None uses ``torch.initial_seed()``."""

    def __post_init__(self) -> None:
        if self.n_critics < 1 or self.n_action_samples < 1 or self.update_actor_interval < 1:
            raise ValueError("n_critics, n_action_samples and update_actor_interval must be >= 1")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must lie in [0, 1], not {self.lam}")


@dataclasses.dataclass(frozen=True)
class DiscreteBCQConfig:
    """Discrete BCQ hyperparameters (defaults: d3rlpy 2.8 ``DiscreteBCQConfig``)."""

    hidden: tuple[int, ...] = (256, 256)
    """Hidden widths of the Q network (and of the imitation network when not shared)."""
    share_encoder: bool = True
    """The imitation head reads the first critic's hidden features (d3rlpy's default)."""
    learning_rate: float = 6.25e-5
    """Adam learning rate of the Q and imitation networks (one optimiser)."""
    batch_size: int = 32
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    n_critics: int = 1
    """Q networks in the ensemble; the target takes their minimum."""
    action_flexibility: float = 0.3
    """tau: an action is allowed when ``G(a|s) / max_a' G(a'|s)`` exceeds it."""
    beta: float = 0.5
    """Weight of the imitation logits' L2 penalty ``mean(logits ** 2)``."""
    target_update_interval: int = 8000
    """Gradient steps between hard copies of the Q network into its target."""

    def __post_init__(self) -> None:
        if not self.hidden:
            raise ValueError("discrete BCQ needs at least one hidden layer")
        if self.n_critics < 1 or self.target_update_interval < 1:
            raise ValueError("n_critics and target_update_interval must be >= 1")


# --------------------------------------------------------------------------------------------
# Losses (pure functions of tensors)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VAELoss:
    """The VAE objective and its two terms (each a weighted batch mean)."""

    total: torch.Tensor
    reconstruction: torch.Tensor
    kl: torch.Tensor


def vae_loss(
    reconstruction: torch.Tensor,
    actions: torch.Tensor,
    latent_mean: torch.Tensor,
    latent_log_std: torch.Tensor,
    beta: float,
    weights: torch.Tensor | None,
) -> VAELoss:
    """``||a - a_hat||^2 + beta * KL(N(mu, sigma) || N(0, 1))``, both averaged over dimensions.

    Shapes: ``reconstruction, actions (B, act)``, ``latent_mean, latent_log_std (B, latent)``.
    """
    squared_error = (reconstruction - actions).pow(2).mean(-1)  # (B,)
    variance = (2 * latent_log_std).exp()
    kl = (0.5 * (latent_mean.pow(2) + variance - 1.0) - latent_log_std).mean(-1)  # (B,)
    return VAELoss(
        total=weighted_mean(squared_error + beta * kl, weights),
        reconstruction=weighted_mean(squared_error, weights),
        kl=weighted_mean(kl, weights),
    )


def perturb(
    actions: torch.Tensor, squashed_residual: torch.Tensor, flexibility: float
) -> torch.Tensor:
    """``clip(a + Phi * xi, -1, 1)`` with ``xi = tanh(.)`` in ``[-1, 1]``: the BCQ policy."""
    return (actions + flexibility * squashed_residual).clamp(-1.0, 1.0)


def soft_clipped_double_q(candidate_values: torch.Tensor, lam: float) -> torch.Tensor:
    """``max_i [lam * min_e Q_e(s, a_i) + (1 - lam) * max_e Q_e(s, a_i)]``.

    ``candidate_values (E, n, B) -> (B,)``: critics ``E``, candidates ``n``, states ``B``.
    """
    low, high = candidate_values.aminmax(dim=0)  # (n, B) each
    return torch.lerp(high, low, lam).amax(dim=0)


def td_targets(
    rewards: torch.Tensor, terminals: torch.Tensor, next_values: torch.Tensor, gamma: float
) -> torch.Tensor:
    """``r + gamma * (1 - terminal) * V(s')``; a timeout still bootstraps. All ``(B,)``."""
    return rewards + gamma * (1.0 - terminals) * next_values


def critic_loss(
    q_values: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """Squared TD error summed over critics: ``q_values (E, B)``, ``targets (B,)``."""
    return weighted_mean((q_values - targets).pow(2).sum(0), weights)


def actor_loss(q_values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``-Q_1(s, pi(s))``: ``q_values (B,)`` of the first critic."""
    return weighted_mean(-q_values, weights)


def allowed_actions(imitation_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """``G(a|s) / max_a' G(a'|s) > threshold`` as a mask: ``(B, A) -> (B, A)`` bool.

    The most likely action always passes (its ratio is 1), so no row is empty for
    ``threshold < 1``.
    """
    log_probs = F.log_softmax(imitation_logits, dim=-1)
    relative = log_probs - log_probs.amax(dim=-1, keepdim=True)
    return relative > math.log(threshold)


def constrained_greedy(q_values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``argmax_a Q(s, a)`` over the allowed actions: ``(B, A), (B, A) bool -> (B,)`` int64."""
    return q_values.masked_fill(~allowed, -math.inf).argmax(dim=-1)


@dataclasses.dataclass(frozen=True)
class DiscreteBCQLoss:
    """The discrete BCQ objective and its terms (each a weighted batch mean)."""

    total: torch.Tensor
    td: torch.Tensor
    imitation: torch.Tensor
    regularisation: torch.Tensor


def discrete_bcq_loss(
    q_taken: torch.Tensor,
    targets: torch.Tensor,
    imitation_logits: torch.Tensor,
    actions: torch.Tensor,
    beta: float,
    weights: torch.Tensor | None,
) -> DiscreteBCQLoss:
    """Huber TD error (summed over critics) + NLL of dataset actions + ``beta * mean(logits^2)``.

    Shapes: ``q_taken (E, B)`` = Q_e(s, a_data), ``targets (B,)``, ``imitation_logits (B, A)``,
    ``actions (B,)`` int64.
    """
    td = F.smooth_l1_loss(q_taken, targets.expand_as(q_taken), reduction="none").sum(0)  # (B,)
    nll = F.cross_entropy(imitation_logits, actions, reduction="none")  # (B,)
    penalty = imitation_logits.pow(2).mean(-1)  # (B,)
    return DiscreteBCQLoss(
        total=weighted_mean(td + nll + beta * penalty, weights),
        td=weighted_mean(td, weights),
        imitation=weighted_mean(nll, weights),
        regularisation=weighted_mean(penalty, weights),
    )


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _frozen_copy(module: ModuleT) -> ModuleT:
    target = copy.deepcopy(module)
    target.requires_grad_(False)
    return target


Affine = tuple[torch.Tensor, torch.Tensor]
"""One affine layer as ``(weight (in, out), bias (out,))``: ``x @ weight + bias``."""


def _mlp_affines(mlp: MLP) -> list[Affine]:
    """The layers of an :class:`MLP` (``nn.Linear`` stores its weight as ``(out, in)``)."""
    return [(layer.weight.t(), layer.bias) for layer in mlp.net if isinstance(layer, nn.Linear)]


def _ensemble_affines(net: EnsembleMLP, member: int) -> list[Affine]:
    """The layers of one member of an :class:`EnsembleMLP` (weights ``(E, in, out)``)."""
    return [
        (layer.weight[member], layer.bias[member, 0])
        for layer in net.layers
        if isinstance(layer, EnsembleLinear)
    ]


class _Workspace:
    """Output buffers of the candidate pass, kept between steps and keyed by name and shape.

    Scoring ``n * B`` candidates makes about ten activations of ``n * B`` rows per step. On CPU,
    glibc hands large allocations back to the kernel and page-faults them in again on the next
    step (measured at 64-64 sizes: 2,300 minor faults and 4 ms of system time per step, a
    quarter of the step), so the pass writes into these buffers instead.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised buffer of ``shape`` (dtype and device of ``like``)."""
        buffer = self._buffers.get((name, shape))
        if buffer is None or buffer.device != like.device or buffer.dtype != like.dtype:
            buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._buffers[(name, shape)] = buffer
        return buffer


@torch.no_grad()
def _tiled_mlp(
    affines: Sequence[Affine],
    states: torch.Tensor,
    extras: torch.Tensor,
    workspace: _Workspace,
    name: str,
) -> torch.Tensor:
    """A ReLU MLP of ``[state, extra]`` for ``n`` extras per state.

    Shapes: ``states (B, s)``, ``extras (n, B, d)`` -> ``(n, B, out)``.

    The same function as ``mlp(cat([states repeated n times, extras], -1))``, cheaper: the
    state's share of the first layer is computed once per state instead of once per candidate,
    no input is concatenated, each ReLU runs in place, and every layer writes into a buffer of
    ``workspace``. The result lives in the buffer ``name``, valid until the next call with the
    same name.
    """
    n, batch, extra_dim = extras.shape
    state_dim = states.shape[-1]
    last = len(affines) - 1

    def buffer(depth: int, width: int) -> torch.Tensor:
        # Hidden layers alternate between two buffers shared by every MLP of the pass (a
        # small working set stays in cache); the output has its own, named buffer.
        key = f"{name}.out" if depth == last else f"hidden{depth % 2}"
        return workspace.get(key, (n * batch, width), states)

    (weight, bias), *rest = affines
    # (n * B, d) @ (d, h), plus the state's share (B, h) broadcast over n.
    hidden = torch.mm(
        extras.reshape(n * batch, extra_dim), weight[state_dim:], out=buffer(0, weight.shape[1])
    )
    hidden.view(n, batch, -1).add_(torch.addmm(bias, states, weight[:state_dim]))
    for depth, (weight, bias) in enumerate(rest, start=1):
        hidden = torch.addmm(bias, hidden.relu_(), weight, out=buffer(depth, weight.shape[1]))
    return hidden.view(n, batch, -1)


def _reduce_ensemble(values: torch.Tensor, reduction: QReduction) -> torch.Tensor:
    """``(E, B) -> (B,)``."""
    if reduction == "first":
        return values[0]
    if reduction == "min":
        return values.amin(0)
    return values.mean(0)


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(
        torch.initial_seed() if seed is None else seed
    )


_NOT_YET = float("nan")  # a loss that has not been computed yet (before rl_start_step)


# --------------------------------------------------------------------------------------------
# Continuous BCQ
# --------------------------------------------------------------------------------------------


class BCQ:
    """Continuous BCQ trainer: VAE, perturbation network, twin critics and their targets."""

    name = "bcq"

    def __init__(
        self, spaces: Spaces, config: BCQConfig | None = None, *, device: str | None = None
    ) -> None:
        if spaces.discrete:
            raise ValueError("BCQ learns continuous actions; use DiscreteBCQ for discrete ones")
        self.spaces = spaces
        self.config = config or BCQConfig()
        self.device = choose_device(device)
        cfg = self.config
        obs_dim, act_dim = spaces.observation_dim, spaces.action_dim
        self.normaliser = ActionNormaliser(spaces).to(self.device)
        self.vae = VAE(obs_dim, act_dim, cfg.vae_hidden, cfg.latent_dim).to(self.device)
        # xi(s, a) = tanh(MLP([s, a])); the perturbation is Phi * xi.
        self.actor = DeterministicActor(obs_dim + act_dim, act_dim, cfg.actor_hidden).to(
            self.device
        )
        self.critic = CriticEnsemble(obs_dim, act_dim, cfg.critic_hidden, cfg.n_critics).to(
            self.device
        )
        self.actor_target: DeterministicActor = _frozen_copy(self.actor)
        self.critic_target: CriticEnsemble = _frozen_copy(self.critic)
        self.vae_optimizer = adam(self.vae.parameters(), cfg.imitator_learning_rate)
        self.actor_optimizer = adam(self.actor.parameters(), cfg.actor_learning_rate)
        self.critic_optimizer = adam(self.critic.parameters(), cfg.critic_learning_rate)
        self._actor_params = list(self.actor.parameters())
        self.generator = _generator(self.device, cfg.act_seed)
        self._workspace = _Workspace()
        self.steps = 0
        nan = torch.tensor(_NOT_YET, device=self.device)
        self._last_rl_metrics: dict[str, torch.Tensor] = {
            "critic_loss": nan,
            "actor_loss": nan,
            "q_mean": nan,
        }

    # ---- candidates ------------------------------------------------------------------------

    @torch.no_grad()
    def _score_candidates(
        self,
        states: torch.Tensor,
        latent: torch.Tensor,
        actor: DeterministicActor,
        critic: CriticEnsemble,
        members: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Perturbed VAE actions and their values: ``(B, obs), (n, B, latent)`` ->
        candidates ``(n, B, act)``, values ``(members, n, B)`` of the first ``members`` critics.

        Computes ``perturb(G(s, z), xi(s, G(s, z)))`` and ``Q_e(s, .)`` for every latent ``z``,
        exactly as the modules would on ``n * B`` repeated states, with :func:`_tiled_mlp`.
        """
        workspace = self._workspace
        decoder, perturbation = _mlp_affines(self.vae.decoder), _mlp_affines(actor.net)
        decoded = _tiled_mlp(decoder, states, latent, workspace, "decoder").tanh_()
        residual = _tiled_mlp(perturbation, states, decoded, workspace, "actor").tanh_()
        candidates = perturb(decoded, residual, self.config.action_flexibility)  # (n, B, act)
        values = torch.stack(
            [
                _tiled_mlp(
                    _ensemble_affines(critic.net, member),
                    states,
                    candidates,
                    workspace,
                    f"critic{member}",
                ).squeeze(-1)
                for member in range(members)
            ]
        )  # members x (n, B)
        return candidates, values

    def _prior_latent(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n_action_samples`` clipped prior draws per state: ``(n, B, latent)``."""
        shape = (self.config.n_action_samples, batch, self.vae.latent_dim)
        latent = torch.randn(shape, generator=generator, device=self.device)
        return latent.clamp_(-LATENT_CLIP, LATENT_CLIP)

    @torch.no_grad()
    def _next_values(self, next_observations: torch.Tensor) -> torch.Tensor:
        """Soft clipped double-Q value of each next state over its candidates: ``(B,)``."""
        latent = self._prior_latent(next_observations.shape[0])
        _, values = self._score_candidates(
            next_observations, latent, self.actor_target, self.critic_target, self.config.n_critics
        )  # (E, n, B)
        return soft_clipped_double_q(values, self.config.lam)

    # ---- training --------------------------------------------------------------------------

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One step: VAE, then critics, then (every ``update_actor_interval``) the actor.

        ``critic_loss``, ``actor_loss`` and ``q_mean`` report their latest value (NaN until
        ``rl_start_step``), so every step returns the same metric names.
        """
        cfg = self.config
        observations, weights = batch.observations, batch.weights
        actions = self.normaliser(batch.actions)

        reconstruction, latent_mean, latent_log_std = self.vae(observations, actions)
        imitation = vae_loss(
            reconstruction, actions, latent_mean, latent_log_std, cfg.beta, weights
        )
        self.vae_optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(imitation.total)
        self.vae_optimizer.step()
        metrics = {
            "vae_loss": imitation.total.detach(),
            "vae_reconstruction": imitation.reconstruction.detach(),
            "vae_kl": imitation.kl.detach(),
        }

        if self.steps >= cfg.rl_start_step:
            self._update_critic(batch, actions)
            if self.steps % cfg.update_actor_interval == 0:
                self._update_actor(observations, weights)
                soft_update(self.actor_target, self.actor, cfg.tau)
            soft_update(self.critic_target, self.critic, cfg.tau)
        self.steps += 1
        return {**metrics, **self._last_rl_metrics}

    def _update_critic(self, batch: TorchBatch, actions: torch.Tensor) -> None:
        next_values = self._next_values(batch.next_observations)
        targets = td_targets(batch.rewards, batch.terminals, next_values, self.config.gamma)
        q_values = self.critic(batch.observations, actions)  # (E, B)
        loss = critic_loss(q_values, targets, batch.weights)
        self.critic_optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        self.critic_optimizer.step()
        self._last_rl_metrics["critic_loss"] = loss.detach()
        self._last_rl_metrics["q_mean"] = q_values.detach().mean()

    def _update_actor(self, observations: torch.Tensor, weights: torch.Tensor) -> None:
        batch = observations.shape[0]
        with torch.no_grad():
            latent = torch.randn((batch, self.vae.latent_dim), device=observations.device).clamp_(
                -LATENT_CLIP, LATENT_CLIP
            )
            decoded = self.vae.decode(observations, latent)  # (B, act)
        residual = self.actor(torch.cat([observations, decoded], dim=-1))
        policy_actions = perturb(decoded, residual, self.config.action_flexibility)
        loss = actor_loss(self.critic(observations, policy_actions)[0], weights)
        # Gradients for the actor only: the critics' weight gradients are never computed.
        grads = torch.autograd.grad(loss, self._actor_params)
        for param, grad in zip(self._actor_params, grads, strict=True):
            param.grad = grad
        self.actor_optimizer.step()
        self._last_rl_metrics["actor_loss"] = loss.detach()

    # ---- inference -------------------------------------------------------------------------

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The best of ``n_action_samples`` candidates by Q_1, in the environment's bounds.

        Candidates come from :attr:`generator`, so a restored trainer repeats its actions.
        """
        obs = to_tensor(observations, self.device).reshape(-1, self.spaces.observation_dim)
        batch = obs.shape[0]
        latent = self._prior_latent(batch, self.generator)
        candidates, q1 = self._score_candidates(obs, latent, self.actor, self.critic, members=1)
        best = q1[0].argmax(dim=0)  # (n, B) -> (B,)
        chosen = candidates[best, torch.arange(batch, device=self.device)]  # (B, act)
        return self.normaliser.inverse(chosen).cpu().numpy()

    @torch.no_grad()
    def q_values(
        self,
        observations: npt.NDArray[np.float32],
        actions: npt.NDArray[np.float32],
        reduction: QReduction = "first",
    ) -> npt.NDArray[np.float32]:
        """Q(s, a) of environment-space actions: ``(B, obs), (B, act) -> (B,)``."""
        obs = to_tensor(observations, self.device)
        normalised = self.normaliser(to_tensor(actions, self.device))
        values = self.critic(obs, normalised)  # (E, B)
        return _reduce_ensemble(values, reduction).cpu().numpy()

    @torch.no_grad()
    def sample_vae_actions(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """One action per state decoded from the clipped prior (environment bounds)."""
        obs = to_tensor(observations, self.device)
        latent = torch.randn(
            (obs.shape[0], self.vae.latent_dim), generator=self.generator, device=self.device
        ).clamp_(-LATENT_CLIP, LATENT_CLIP)
        decoded = self.vae.decode(obs, latent)
        return self.normaliser.inverse(decoded).cpu().numpy()

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Networks, targets, optimisers, step count and ``act``'s generator."""
        return {
            "vae": self.vae.state_dict(),
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "actor_target": self.actor_target.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "vae_optimizer": self.vae_optimizer.state_dict(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "steps": self.steps,
            "act_generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.vae.load_state_dict(state["vae"])
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.actor_target.load_state_dict(state["actor_target"])
        self.critic_target.load_state_dict(state["critic_target"])
        # Optimizers keep the very tensors they are given: copy them, or two trainers restored
        # from one live state dict would share (and both advance) their Adam moments.
        self.vae_optimizer.load_state_dict(copy.deepcopy(state["vae_optimizer"]))
        self.actor_optimizer.load_state_dict(copy.deepcopy(state["actor_optimizer"]))
        self.critic_optimizer.load_state_dict(copy.deepcopy(state["critic_optimizer"]))
        self.steps = int(state["steps"])
        self.generator.set_state(state["act_generator"].cpu())


# --------------------------------------------------------------------------------------------
# Discrete BCQ
# --------------------------------------------------------------------------------------------


class DiscreteBCQNetwork(nn.Module):
    """Q_e(s, .) for ``E`` critics and imitation logits G(.|s), with an optional shared torso.

    ``(B, obs) -> q (E, B, A), logits (B, A)``. With ``share_encoder`` the imitation head reads
    the hidden features of the first critic (d3rlpy's ``share_encoder``).
    """

    def __init__(
        self,
        observation_dim: int,
        n_actions: int,
        hidden: Sequence[int],
        members: int,
        share_encoder: bool,
    ) -> None:
        super().__init__()
        *inner, width = hidden
        self.torso = EnsembleMLP(members, observation_dim, inner, width)
        self.q_head = EnsembleLinear(members, width, n_actions)
        self.imitator: nn.Module = (
            nn.Linear(width, n_actions)
            if share_encoder
            else MLP(observation_dim, hidden, n_actions)
        )
        self.share_encoder = share_encoder

    def forward(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = F.relu(self.torso(observations))  # (E, B, H)
        q_values = self.q_head(features)  # (E, B, A)
        source = features[0] if self.share_encoder else observations
        return q_values, self.imitator(source)

    def q_only(self, observations: torch.Tensor) -> torch.Tensor:
        """``(B, obs) -> (E, B, A)`` without the imitation head."""
        q_values: torch.Tensor = self.q_head(F.relu(self.torso(observations)))
        return q_values


class DiscreteBCQ:
    """Discrete BCQ trainer: Q ensemble + imitation network, one optimiser, hard target copies."""

    name = "discrete_bcq"

    def __init__(
        self,
        spaces: Spaces,
        config: DiscreteBCQConfig | None = None,
        *,
        device: str | None = None,
    ) -> None:
        if not spaces.discrete:
            raise ValueError("DiscreteBCQ learns discrete actions; use BCQ for continuous ones")
        self.spaces = spaces
        self.config = config or DiscreteBCQConfig()
        self.device = choose_device(device)
        cfg = self.config
        self.network = DiscreteBCQNetwork(
            spaces.observation_dim, spaces.action_dim, cfg.hidden, cfg.n_critics, cfg.share_encoder
        ).to(self.device)
        self.target = _frozen_copy(self.network)
        self.optimizer = adam(self.network.parameters(), cfg.learning_rate)
        self.steps = 0

    def _greedy(self, q_values: torch.Tensor, imitation_logits: torch.Tensor) -> torch.Tensor:
        """Constrained greedy action of the ensemble-mean Q: ``(E, B, A), (B, A) -> (B,)``."""
        allowed = allowed_actions(imitation_logits, self.config.action_flexibility)
        return constrained_greedy(q_values.mean(0), allowed)

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One gradient step on TD + imitation losses; hard target copy every interval."""
        cfg = self.config
        with torch.no_grad():
            # Double DQN: the online networks choose among allowed actions, the target scores.
            next_q, next_logits = self.network(batch.next_observations)
            next_actions = self._greedy(next_q, next_logits)  # (B,)
            target_q = self.target.q_only(batch.next_observations)  # (E, B, A)
            index = next_actions.view(1, -1, 1).expand(target_q.shape[0], -1, 1)
            next_values = target_q.gather(-1, index).squeeze(-1).amin(0)  # (E, B) -> (B,)
            targets = td_targets(batch.rewards, batch.terminals, next_values, cfg.gamma)
        q_values, logits = self.network(batch.observations)
        taken = batch.actions.view(1, -1, 1).expand(q_values.shape[0], -1, 1)
        q_taken = q_values.gather(-1, taken).squeeze(-1)  # (E, B)
        loss = discrete_bcq_loss(q_taken, targets, logits, batch.actions, cfg.beta, batch.weights)
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss.total)
        self.optimizer.step()
        self.steps += 1
        if self.steps % cfg.target_update_interval == 0:
            with torch.no_grad():
                torch._foreach_copy_(
                    list(self.target.parameters()), list(self.network.parameters())
                )
        return {
            "loss": loss.total.detach(),
            "td_loss": loss.td.detach(),
            "imitation_loss": loss.imitation.detach(),
            "logit_penalty": loss.regularisation.detach(),
            "q_mean": q_taken.detach().mean(),
        }

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
        """argmax of the ensemble-mean Q over the actions the imitation network allows."""
        obs = to_tensor(observations, self.device).reshape(-1, self.spaces.observation_dim)
        q_values, logits = self.network(obs)
        return self._greedy(q_values, logits).cpu().numpy()

    @torch.no_grad()
    def allowed(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.bool_]:
        """Which actions pass the imitation threshold: ``(B, obs) -> (B, A)`` bool."""
        obs = to_tensor(observations, self.device).reshape(-1, self.spaces.observation_dim)
        _, logits = self.network(obs)
        mask = allowed_actions(logits, self.config.action_flexibility)
        return mask.cpu().numpy()

    @torch.no_grad()
    def q_values(
        self,
        observations: npt.NDArray[np.float32],
        actions: npt.NDArray[np.int64],
        reduction: QReduction = "first",
    ) -> npt.NDArray[np.float32]:
        """Q(s, a) of action indices: ``(B, obs), (B,) -> (B,)``."""
        obs = to_tensor(observations, self.device).reshape(-1, self.spaces.observation_dim)
        index = index_tensor(actions, self.device)
        q_all = self.network.q_only(obs)  # (E, B, A)
        taken = q_all.gather(-1, index.view(1, -1, 1).expand(q_all.shape[0], -1, 1)).squeeze(-1)
        return _reduce_ensemble(taken, reduction).cpu().numpy()

    def state_dict(self) -> dict[str, Any]:
        """Network, target, optimiser and step count."""
        return {
            "network": self.network.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.network.load_state_dict(state["network"])
        self.target.load_state_dict(state["target"])
        # A copy: optimizers keep the tensors they are given (see BCQ.load_state_dict).
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.steps = int(state["steps"])
