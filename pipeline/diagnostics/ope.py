"""The ``ope`` section: off-policy estimates of each trained policy's value from the data.

* **FQE** (Le et al. 2019) fits Q^pi by ``fqe_steps`` Adam steps on a small MLP with a Polyak
  target (``fqe_tau``) on the sampled episodes' transitions; timeouts bootstrap, terminals do
  not. Backups propagate roughly ``fqe_steps * fqe_tau`` steps of horizon, so with gamma = 0.99
  the default is a quick, horizon-truncated estimate, not a converged one. It estimates the
  infinite-horizon value from dataset episode starts; against evaluation episodes cut by a time
  limit it reads high.
* **WPDIS** (Precup et al. 2000; weighted per-decision importance sampling) needs pi(a|s) at
  dataset actions. A deterministic policy has none, so pi is approximated by a Gaussian of std
  ``target_sigma`` (normalised box, truncated to it) around ``pi(s)``, or epsilon-greedy with
  ``target_epsilon`` for discrete actions; the behaviour density is beta_hat. Episodes that
  ended keep their final weight with reward 0 in the normalisation.

The truth each estimate is compared with is the evaluation episodes' mean discounted return.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from offaug.algorithms.nn.networks import MLP
from offaug.datasets.weights import effective_sample_size_from_logs
from offaug.pipeline.diagnostics.coverage import standardiser
from offaug.pipeline.diagnostics.evaluation import Episode, episode_records
from offaug.pipeline.diagnostics.policy_document import OpeEntry, WpdisResult
from offaug.pipeline.diagnostics.policy_models import BehaviourModel
from offaug.pipeline.diagnostics.sampling import (
    ActFunction,
    FloatArray,
    PolicySample,
    TrainedPolicy,
    batched_act,
    flat,
    single_threaded,
)
from offaug.pipeline.diagnostics.settings import DiagnosticsSettings
from offaug.pipeline.rollouts.noise import truncnorm_log_prob


def weighted_per_decision_is(
    rewards: npt.ArrayLike, episode_ids: npt.ArrayLike, log_ratios: npt.ArrayLike, gamma: float
) -> WpdisResult:
    """WPDIS: sum_t gamma^t sum_i w_it r_it / sum_i w_it, w_it = prod_{k<=t} pi/beta.

    Episodes shorter than the longest keep their final weight with reward 0 after they end.
    Computed with log-weights, normalised per time step (no overflow).
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    ids = np.asarray(episode_ids).reshape(-1)
    log_ratio = np.asarray(log_ratios, dtype=np.float64).reshape(-1)
    if r.size == 0:
        return {"estimate": None, "episodes": 0, "ess_fraction": None}
    starts = np.concatenate(([0], np.flatnonzero(np.diff(ids)) + 1))
    lengths = np.diff(np.concatenate((starts, [r.size])))
    position = np.arange(r.size) - np.repeat(starts, lengths)
    episode = np.repeat(np.arange(len(starts)), lengths)
    padded_rewards = np.zeros((len(starts), int(lengths.max())))  # (E, T)
    padded_log_ratio = np.zeros_like(padded_rewards)
    padded_rewards[episode, position] = r
    padded_log_ratio[episode, position] = log_ratio
    # Zero log-ratio after an episode's end carries its final cumulative weight forward.
    log_weights = np.cumsum(padded_log_ratio, axis=1)
    normalised = np.exp(log_weights - log_weights.max(axis=0, keepdims=True))
    per_step = (normalised * padded_rewards).sum(0) / normalised.sum(0)
    estimate = float(np.sum(per_step * gamma ** np.arange(padded_rewards.shape[1])))
    final = log_weights[:, -1]
    return {
        "estimate": estimate,
        "episodes": len(starts),
        "ess_fraction": effective_sample_size_from_logs(final) / len(starts),
    }


def target_log_ratio(
    behaviour: BehaviourModel,
    observations: npt.NDArray[Any],
    dataset_actions: npt.NDArray[Any],
    policy_actions: npt.NDArray[Any],
    *,
    sigma: float,
    epsilon: float,
) -> FloatArray:
    """log pi(a|s) - log beta_hat(a|s) at dataset actions, pi made stochastic (module docstring)."""
    space = behaviour.actions
    log_beta = behaviour.log_prob(flat(observations), dataset_actions)
    if space.discrete:
        same = np.asarray(dataset_actions) == np.asarray(policy_actions)
        log_pi = np.log(np.where(same, 1 - epsilon + epsilon / space.n, epsilon / space.n))
    else:
        log_pi = truncnorm_log_prob(
            space.normalise(dataset_actions), space.normalise(policy_actions), sigma
        )
    return np.asarray(log_pi - log_beta, dtype=np.float64)


def fitted_q_evaluation(
    observations: npt.NDArray[np.float32],
    action_features: npt.NDArray[np.float32],
    rewards: npt.ArrayLike,
    next_observations: npt.NDArray[np.float32],
    next_action_features: npt.NDArray[np.float32],
    terminals: npt.ArrayLike,
    initial_observations: npt.NDArray[np.float32],
    initial_action_features: npt.NDArray[np.float32],
    *,
    gamma: float,
    settings: DiagnosticsSettings,
    seed: int,
) -> float:
    """FQE: fit Q^pi on transitions with pi's next actions; return mean Q(s0, pi(s0)).

    Observations are standardised and rewards scaled by their std inside; the answer is in
    reward units. See the module docstring for what the few steps mean.
    """
    obs = np.asarray(observations, dtype=np.float32)
    mean, std = standardiser(obs)
    reward_array = np.asarray(rewards, dtype=np.float64).reshape(-1)
    scale = float(reward_array.std()) or 1.0

    def inputs(states: npt.NDArray[Any], actions: npt.NDArray[Any]) -> torch.Tensor:
        standard = ((np.asarray(states, np.float64) - mean) / std).astype(np.float32)
        return torch.as_tensor(np.concatenate([standard, actions], axis=1), dtype=torch.float32)

    with single_threaded(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        x = inputs(obs, action_features)
        x_next = inputs(next_observations, next_action_features)
        r = torch.as_tensor(reward_array / scale, dtype=torch.float32)
        not_done = torch.as_tensor(1.0 - np.asarray(terminals, dtype=np.float32).reshape(-1))
        network = MLP(x.shape[1], settings.fqe_hidden, 1)
        target = MLP(x.shape[1], settings.fqe_hidden, 1)
        target.load_state_dict(network.state_dict())
        target.requires_grad_(False)
        optimiser = torch.optim.Adam(network.parameters(), lr=settings.fqe_learning_rate)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(settings.fqe_steps):
            index = torch.randint(0, len(x), (settings.fqe_batch_size,), generator=generator)
            with torch.no_grad():
                backup = r[index] + gamma * not_done[index] * target(x_next[index]).squeeze(-1)
            loss = torch.nn.functional.mse_loss(network(x[index]).squeeze(-1), backup)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            with torch.no_grad():
                for p_target, p in zip(target.parameters(), network.parameters(), strict=True):
                    p_target.lerp_(p, settings.fqe_tau)
        with torch.no_grad():
            start_values = network(inputs(initial_observations, initial_action_features))
    return float(start_values.mean()) * scale


def next_actions(
    act: ActFunction,
    states: npt.NDArray[np.float32],
    next_states: npt.NDArray[np.float32],
    episode_ids: npt.NDArray[Any],
    actions: npt.NDArray[Any],
) -> npt.NDArray[Any]:
    """pi(s') for sampled rows, reusing pi(s) of the following row where s' is that row's s."""
    reuse = np.zeros(len(states), dtype=bool)
    reuse[:-1] = (episode_ids[:-1] == episode_ids[1:]) & np.all(
        next_states[:-1] == states[1:], axis=1
    )
    out = np.empty_like(actions)
    out[:-1][reuse[:-1]] = actions[1:][reuse[:-1]]
    missing = np.flatnonzero(~reuse)
    if missing.size:
        out[missing] = batched_act(act, next_states[missing])
    return out


def ope_entry(
    behaviour: BehaviourModel,
    policy: TrainedPolicy,
    actions: npt.NDArray[Any],
    sample: PolicySample,
    runs: Sequence[Episode] | None,
    gamma: float,
    settings: DiagnosticsSettings,
    seed: int,
) -> OpeEntry | None:
    """FQE and WPDIS of one trained policy from the original data, against the truth."""
    if len(sample.rows) == 0:
        return None
    space = behaviour.actions
    starts = sample.starts
    following = next_actions(
        policy.act, sample.states, sample.next_states, sample.episode_ids, actions
    )
    fqe = fitted_q_evaluation(
        sample.states,
        space.features(sample.actions),
        sample.rewards,
        sample.next_states,
        space.features(following),
        sample.terminals,
        sample.states[starts],
        space.features(actions[starts]),
        gamma=gamma,
        settings=settings,
        seed=seed,
    )
    log_ratio = target_log_ratio(
        behaviour,
        sample.states,
        sample.actions,
        actions,
        sigma=settings.target_sigma,
        epsilon=settings.target_epsilon,
    )
    wpdis = weighted_per_decision_is(sample.rewards, sample.episode_ids, log_ratio, gamma)
    truth = episode_records(runs, gamma)["mean_discounted_return"] if runs else None
    return {
        "fqe": fqe,
        "wpdis": wpdis["estimate"],
        "wpdis_ess_fraction": wpdis["ess_fraction"],
        "true_discounted_return": truth,
        "fqe_error": None if truth is None else fqe - truth,
        "wpdis_error": (
            None if truth is None or wpdis["estimate"] is None else wpdis["estimate"] - truth
        ),
    }
