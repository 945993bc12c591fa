"""The behaviour step and the importance-weight maths, written once for every rollout.

A rollout policy mu is a policy's mean action plus noise (:mod:`offaug.pipeline.rollouts.noise`);
the behaviour model beta_hat is the BC policy's own density (a Gaussian truncated to the normalised
action box, or the categorical of its logits). One step of any rollout, in the simulator or in a
learned model, goes

    policy(s) -> (mean, log std) -> noise -> action, log mu -> log beta_hat -> env action,

and both log-densities are converted from the normalised box to the environment's with the
normaliser's ``log |det|`` (:func:`policy_step`). The noise is centred on the behaviour model's own
action unless the policy is a :class:`CentredPolicy` (e.g. a trained offline learner's
deterministic action): mu is then that noise around the learner's action, while beta_hat stays the
BC density, so the weight columns keep their meaning.
:class:`~offaug.datasets.action_box.ActionBox` is the one numpy map between an environment's action
bounds and the normalised box (the twin of
:class:`offaug.algorithms.nn.distributions.ActionNormaliser`). Over the collected rows the weights
are

* ``importance_weight``: beta_hat/mu per step, clipped at ``max_weight``;
* ``cumulative_log_ratio``: the running sum of log beta_hat - log mu inside each episode;
* ``per_decision_weight``: its exponential, clipped at ``max_weight``;
* ``self_normalised_weight``: the importance weight over its mean, the mean taken over the
  pooled data (a shard set normalises over all its shards when they are merged).

:func:`weight_statistics` summarises them (ESS from :mod:`offaug.datasets.weights`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from offaug.datasets.weights import effective_sample_size, self_normalised_weights
from offaug.pipeline.rollouts.noise import ContinuousNoise, DiscreteNoise, truncnorm_log_prob

FloatArray = npt.NDArray[np.float64]


class RolloutPolicy(Protocol):
    """What a rollout needs from a policy
    (:class:`offaug.pipeline.rollouts.policies.BCRolloutPolicy`)."""

    @property
    def discrete(self) -> bool:
        """Whether actions are discrete indices (the outputs are then logits)."""

    def __call__(
        self, observations: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None]:
        """Mean action in ``[-1, 1]`` (or logits for discrete) and the behaviour log std."""

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Normalised actions to the environment's action space."""

    @property
    def log_abs_det(self) -> float:
        """log |d normalised / d env action|: converts normalised-box densities to env's box."""


@runtime_checkable
class CentredPolicy(RolloutPolicy, Protocol):
    """A rollout policy whose noise is centred on an action of its own, not beta_hat's mean."""

    def centre(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """(n, d) actions in the normalised box, or (n,) discrete action indices."""


def noise_centre(
    policy: RolloutPolicy, observations: npt.NDArray[np.float32], mean: FloatArray
) -> npt.NDArray[Any]:
    """Where mu's noise is centred: a :class:`CentredPolicy`'s action, else beta_hat's own
    (its mean in the normalised box, or the argmax of its logits)."""
    if isinstance(policy, CentredPolicy):
        return policy.centre(observations)
    return np.asarray(mean.argmax(-1)) if policy.discrete else mean


@dataclasses.dataclass(frozen=True)
class PolicyStep:
    """One batched step of a noisy rollout policy."""

    actions: npt.NDArray[Any]
    """(n, d) sampled actions in the normalised box, or (n,) discrete action indices."""
    env_actions: npt.NDArray[Any]
    """The same actions in the environment's space."""
    rollout_log_prob: FloatArray
    """(n,) log mu(a|s) over the environment's action box."""
    behaviour_log_prob: FloatArray
    """(n,) log beta_hat(a|s) over the environment's action box."""


def behaviour_log_prob(mean: FloatArray, log_std: FloatArray, actions: FloatArray) -> FloatArray:
    """log beta_hat(a|s) of normalised-box actions: the Gaussian truncated to ``[-1, 1]^d``."""
    return truncnorm_log_prob(actions, mean, np.exp(log_std))


def categorical_log_prob(logits: FloatArray, actions: npt.NDArray[Any]) -> FloatArray:
    """log beta_hat(a|s) of discrete actions under the categorical of ``logits``."""
    log_probs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    index = np.asarray(actions, dtype=np.int64)[:, None]
    return np.asarray(np.take_along_axis(log_probs, index, -1)[:, 0], dtype=np.float64)


def epsilon_greedy_probabilities(
    greedy: npt.NDArray[np.int64], n_actions: int, epsilon: float
) -> FloatArray:
    """(n, n_actions) mu(a|s) of epsilon-greedy around ``greedy`` (for exact sums over a)."""
    mu = np.full((len(greedy), n_actions), epsilon / n_actions)
    mu[np.arange(len(greedy)), greedy] += 1 - epsilon
    return mu


def policy_step(
    policy: RolloutPolicy,
    noise: ContinuousNoise | DiscreteNoise,
    mean: FloatArray,
    log_std: FloatArray | None,
    rows: npt.NDArray[np.int64] | None = None,
    centre: npt.NDArray[Any] | None = None,
) -> PolicyStep:
    """Noisy actions around ``centre`` and both log-densities over the env's box.

    Args:
        policy: Gives :meth:`RolloutPolicy.to_env` and the box's ``log_abs_det``.
        noise: The rollout policy's noise (discrete noise for a discrete policy).
        mean: beta_hat's mean actions (or logits), for the rows being stepped.
        log_std: beta_hat's log std (None for discrete).
        rows: Which of the noise's environments these rows are (their OU states).
        centre: Where the noise is centred (:func:`noise_centre`); None: beta_hat's own action.
    """
    if policy.discrete:
        assert isinstance(noise, DiscreteNoise)
        greedy = mean.argmax(-1) if centre is None else np.asarray(centre, dtype=np.int64)
        indices, log_mu = noise.sample(greedy)
        return PolicyStep(indices, indices, log_mu, categorical_log_prob(mean, indices))
    assert isinstance(noise, ContinuousNoise) and log_std is not None
    actions, log_mu = noise.sample(mean if centre is None else centre, rows)
    log_beta = behaviour_log_prob(mean, log_std, actions)
    return PolicyStep(
        actions,
        policy.to_env(actions),
        log_mu + policy.log_abs_det,
        log_beta + policy.log_abs_det,
    )


def at_centre(
    policy: RolloutPolicy,
    noise: ContinuousNoise,
    chosen: PolicyStep,
    rows: npt.NDArray[np.bool_],
    mean: FloatArray,
    log_std: FloatArray,
    centre: npt.NDArray[Any],
) -> PolicyStep:
    """``chosen`` with ``rows`` taken at the noise centre itself, without noise (the reference
    episodes of ``rollout.keep_reference``); their ``log mu`` is the noise's density there, so
    their weights stay defined."""
    at = np.clip(np.asarray(centre, dtype=np.float64)[rows], -1.0, 1.0)
    actions = np.array(chosen.actions, copy=True)
    actions[rows] = at
    rollout_log_prob = np.array(chosen.rollout_log_prob, copy=True)
    rollout_log_prob[rows] = noise.log_prob_of_centre(at) + policy.log_abs_det
    log_beta = np.array(chosen.behaviour_log_prob, copy=True)
    log_beta[rows] = behaviour_log_prob(mean[rows], log_std[rows], at) + policy.log_abs_det
    return PolicyStep(actions, policy.to_env(actions), rollout_log_prob, log_beta)


# -- weights --------------------------------------------------------------------------------------


def clipped_weights(log_ratio: FloatArray, max_weight: float) -> FloatArray:
    """exp(log_ratio), clipped at ``max_weight``."""
    return np.exp(np.minimum(log_ratio, math.log(max_weight)))


def cumulative_log_ratio(log_ratio: FloatArray, lengths: npt.NDArray[np.int64]) -> FloatArray:
    """The running sum of ``log_ratio`` inside each episode of ``lengths`` consecutive rows."""
    if len(log_ratio) == 0:
        return np.zeros(0)
    # cumsum over all rows minus the sum up to each episode's start.
    cumulative = np.cumsum(log_ratio)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return cumulative - np.repeat(cumulative[starts] - log_ratio[starts], lengths)


def weight_statistics(
    weights: npt.ArrayLike, raw_log_ratio: npt.ArrayLike, max_weight: float
) -> dict[str, float]:
    """n, ESS, ESS/N, clipped fraction, maximum (unclipped) weight and mean log-ratio."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    log_ratio = np.asarray(raw_log_ratio, dtype=np.float64).reshape(-1)
    n = len(w)
    if n == 0:
        return {
            "n": 0,
            "ess": 0.0,
            "ess_fraction": 0.0,
            "clipped_fraction": 0.0,
            "max_weight": 0.0,
            "mean_log_ratio": 0.0,
        }
    ess = effective_sample_size(w)
    return {
        "n": n,
        "ess": ess,
        "ess_fraction": ess / n,
        "clipped_fraction": float(np.mean(log_ratio > math.log(max_weight))),
        "max_weight": float(np.exp(min(float(log_ratio.max()), 700.0))),
        "mean_log_ratio": float(log_ratio.mean()),
    }


@dataclasses.dataclass(frozen=True)
class WeightColumns:
    """The weight columns of a batch of episodes and their statistics."""

    importance_weight: npt.NDArray[np.float32]
    extras: dict[str, npt.NDArray[np.float32]]
    """``cumulative_log_ratio``, ``per_decision_weight`` and ``self_normalised_weight``."""
    stats: dict[str, float]


def weight_columns(
    behaviour_log_prob: FloatArray,
    rollout_log_prob: FloatArray,
    lengths: npt.NDArray[np.int64],
    max_weight: float,
) -> WeightColumns:
    """Every weight column of rows that form episodes of ``lengths`` consecutive rows."""
    raw_log_ratio = np.asarray(behaviour_log_prob, np.float64) - np.asarray(
        rollout_log_prob, np.float64
    )
    weights = clipped_weights(raw_log_ratio, max_weight)
    cumulative = cumulative_log_ratio(raw_log_ratio, lengths)
    return WeightColumns(
        importance_weight=weights.astype(np.float32),
        extras={
            "cumulative_log_ratio": cumulative.astype(np.float32),
            "per_decision_weight": clipped_weights(cumulative, max_weight).astype(np.float32),
            "self_normalised_weight": self_normalised_weights(weights).astype(np.float32),
        },
        stats=weight_statistics(weights, raw_log_ratio, max_weight),
    )
