"""The behaviour model beta_hat and the noisy rollout policy mu, as the diagnostics see them.

:class:`ActionSpace` maps environment actions to and from the normalised box [-1, 1]^d in which
every density here is measured (with :class:`offaug.datasets.action_box.ActionBox`, the map
the rollouts use); :class:`BehaviourModel` is beta_hat(a|s) as arrays (from the BC checkpoint);
:func:`_rollout_divergence` compares the noisy rollout policy mu with beta_hat, stepping it as
a rollout does (:func:`offaug.pipeline.rollouts.behaviour.policy_step`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.action_box import ActionBox
from offaug.pipeline.diagnostics.policy_document import PolicyDivergence
from offaug.pipeline.diagnostics.sampling import FloatArray, chunks
from offaug.pipeline.rollouts.behaviour import (
    behaviour_log_prob,
    categorical_log_prob,
    epsilon_greedy_probabilities,
    policy_step,
)
from offaug.pipeline.rollouts.noise import ContinuousNoise, DiscreteNoise, NoiseSpec
from offaug.pipeline.rollouts.policies import BCRolloutPolicy


@dataclasses.dataclass(frozen=True, eq=False)
class ActionSpace:
    """A Box (bounds) or Discrete (count) action space, with the normalised box [-1, 1]^d."""

    discrete: bool
    low: FloatArray
    """(d,) lower bounds (empty for discrete)."""
    high: FloatArray
    """(d,) upper bounds (empty for discrete)."""
    n: int
    """Number of discrete actions, or d for a Box."""

    @classmethod
    def from_spaces(cls, spaces: Any) -> ActionSpace:
        """From an :class:`offaug.algorithms.base.Spaces` (no bounds: the box [-1, 1]^d)."""
        if spaces.discrete:
            empty = np.zeros(0)
            return cls(True, empty, empty, int(spaces.action_dim))
        d = int(spaces.action_dim)
        low = np.asarray(spaces.action_low or (-1.0,) * d, dtype=np.float64)
        high = np.asarray(spaces.action_high or (1.0,) * d, dtype=np.float64)
        return cls(False, low, high, d)

    @classmethod
    def box(cls, low: npt.ArrayLike, high: npt.ArrayLike) -> ActionSpace:
        """A Box space with these bounds."""
        low_array = np.asarray(low, dtype=np.float64).reshape(-1)
        high_array = np.asarray(high, dtype=np.float64).reshape(-1)
        return cls(False, low_array, high_array, len(low_array))

    @functools.cached_property
    def action_box(self) -> ActionBox:
        """The map between the bounds and [-1, 1]^d (continuous only)."""
        return ActionBox.from_bounds(self.low, self.high)

    def normalise(self, actions: npt.NDArray[Any]) -> FloatArray:
        """Environment actions into [-1, 1]^d (clipped), as the learners see them."""
        return self.action_box.normalise(actions)

    def denormalise(self, actions: FloatArray) -> npt.NDArray[np.float32]:
        """[-1, 1]^d actions to the environment's bounds."""
        return self.action_box.to_env(actions)

    def features(self, actions: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """Network inputs: the normalised action, or a one-hot row for a discrete one."""
        if self.discrete:
            return np.eye(self.n, dtype=np.float32)[np.asarray(actions, dtype=np.int64)]
        return self.normalise(actions).astype(np.float32)

    def uniform(self, rng: np.random.Generator, size: int) -> npt.NDArray[Any]:
        """``size`` uniformly random environment actions."""
        if self.discrete:
            return rng.integers(0, self.n, size=size).astype(np.int64)
        return rng.uniform(self.low, self.high, size=(size, self.n)).astype(np.float32)

    def distance(self, first: npt.NDArray[Any], second: npt.NDArray[Any]) -> FloatArray:
        """Per-row L2 distance in the normalised box (discrete: 1 where the actions differ)."""
        if self.discrete:
            return (np.asarray(first) != np.asarray(second)).astype(np.float64)
        return np.asarray(
            np.linalg.norm(self.normalise(first) - self.normalise(second), axis=-1),
            dtype=np.float64,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class BehaviourModel:
    """beta_hat(a|s) as arrays: a truncated Gaussian on [-1, 1]^d, or categorical logits.

    ``parameters(obs)`` gives ``(mean, log_std)`` in the normalised box (continuous), or
    ``(logits, empty)`` (discrete), as :class:`offaug.pipeline.rollouts.policies.BCRolloutPolicy`
    does. It is a :class:`offaug.pipeline.rollouts.behaviour.RolloutPolicy` whose densities are over
    the normalised box (``log_abs_det`` 0), as every density here is.
    """

    parameters: Callable[[npt.NDArray[np.float32]], tuple[FloatArray, FloatArray]]
    actions: ActionSpace

    @classmethod
    def from_trainer(cls, trainer: Any) -> BehaviourModel:
        """From a Gaussian (or categorical) BC trainer."""
        policy = BCRolloutPolicy(trainer)

        def parameters(observations: npt.NDArray[np.float32]) -> tuple[FloatArray, FloatArray]:
            outputs = [policy(chunk) for chunk in chunks(observations)]
            first = np.concatenate([o[0] for o in outputs]).astype(np.float64)
            if policy.discrete:
                return first, np.zeros((len(first), 0))
            second = np.concatenate([np.asarray(o[1]) for o in outputs]).astype(np.float64)
            return first, second

        return cls(parameters, ActionSpace.from_spaces(trainer.spaces))

    @property
    def discrete(self) -> bool:
        """Whether actions are discrete indices."""
        return self.actions.discrete

    def __call__(self, observations: npt.NDArray[np.float32]) -> tuple[FloatArray, FloatArray]:
        return self.parameters(observations)

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Normalised actions to the environment's bounds (discrete indices unchanged)."""
        return actions if self.discrete else self.actions.denormalise(actions)

    @property
    def log_abs_det(self) -> float:
        """0: the diagnostics measure densities over the normalised box."""
        return 0.0

    def log_prob(
        self, observations: npt.NDArray[np.float32], actions: npt.NDArray[Any]
    ) -> FloatArray:
        """log beta_hat(a|s) of environment actions, as a density over the normalised box."""
        first, second = self.parameters(observations)
        return self.log_prob_given(first, second, actions)

    def log_prob_given(
        self, first: FloatArray, second: FloatArray, actions: npt.NDArray[Any]
    ) -> FloatArray:
        """:meth:`log_prob` from precomputed :attr:`parameters`."""
        if self.actions.discrete:
            return categorical_log_prob(first, actions)
        return behaviour_log_prob(first, second, self.actions.normalise(actions))


def _rollout_divergence(
    behaviour: BehaviourModel,
    observations: npt.NDArray[np.float32],
    dataset_actions: npt.NDArray[Any],
    spec: NoiseSpec,
    rng: np.random.Generator,
) -> PolicyDivergence:
    """nll, Monte-Carlo KL and action distance of the noisy rollout policy at dataset states.

    The rollout policy is sampled with its OU state at zero, i.e. its first-step distribution.
    """
    space = behaviour.actions
    first, second = behaviour.parameters(observations)
    if space.discrete:
        # Epsilon-greedy around beta_hat's argmax: the KL is a finite sum, computed exactly.
        log_beta = first - np.logaddexp.reduce(first, axis=-1, keepdims=True)
        mu = epsilon_greedy_probabilities(first.argmax(-1), space.n, spec.epsilon)
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = np.where(mu > 0, mu * (np.log(mu) - log_beta), 0.0).sum(-1)
        step = policy_step(behaviour, DiscreteNoise(spec, space.n, rng), first, None)
        nll = -float(np.mean((mu * log_beta).sum(-1)))
        return {
            "kind": "epsilon-greedy (rollout)",
            "nll": nll,
            "kl_monte_carlo": float(kl.mean()),
            "action_distance": float(space.distance(step.env_actions, dataset_actions).mean()),
        }
    noise = ContinuousNoise(spec, len(first), space.n, rng)
    step = policy_step(behaviour, noise, first, second)
    return {
        "kind": "gaussian (rollout)",
        "nll": -float(np.mean(step.behaviour_log_prob)),
        "kl_monte_carlo": float(np.mean(step.rollout_log_prob - step.behaviour_log_prob)),
        "action_distance": float(space.distance(step.env_actions, dataset_actions).mean()),
    }
