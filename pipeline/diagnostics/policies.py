"""The behaviour model beta_hat and the noisy rollout policy mu, as the diagnostics see them.

:class:`ActionSpace` maps environment actions to and from the normalised box [-1, 1]^d in which
every density here is measured; :class:`BehaviourModel` is beta_hat(a|s) as arrays (from the BC
checkpoint); :func:`_rollout_divergence` compares the noisy rollout policy mu with beta_hat.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.pipeline.diagnostics.sampling import FloatArray, chunks
from offaug.pipeline.diagnostics.schema import PolicyDivergence
from offaug.pipeline.noise import ContinuousNoise, parse_noise, truncnorm_log_prob
from offaug.pipeline.rollout import BCRolloutPolicy


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

    def normalise(self, actions: npt.NDArray[Any]) -> FloatArray:
        """Environment actions into [-1, 1]^d (clipped), as the learners see them."""
        scaled = 2.0 * (np.asarray(actions, dtype=np.float64) - self.low) / (self.high - self.low)
        return np.clip(scaled - 1.0, -1.0, 1.0)

    def denormalise(self, actions: FloatArray) -> npt.NDArray[np.float32]:
        """[-1, 1]^d actions to the environment's bounds."""
        return (self.low + (actions + 1.0) * 0.5 * (self.high - self.low)).astype(np.float32)

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
    ``(logits, empty)`` (discrete), as :class:`offaug.pipeline.rollout.BCRolloutPolicy` does.
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
            log_probs = first - np.logaddexp.reduce(first, axis=-1, keepdims=True)
            index = np.asarray(actions, dtype=np.int64)[:, None]
            return np.asarray(np.take_along_axis(log_probs, index, -1)[:, 0], dtype=np.float64)
        return np.asarray(
            truncnorm_log_prob(self.actions.normalise(actions), first, np.exp(second)),
            dtype=np.float64,
        )


def _rollout_divergence(
    behaviour: BehaviourModel,
    observations: npt.NDArray[np.float32],
    dataset_actions: npt.NDArray[Any],
    noise_text: str,
    rng: np.random.Generator,
) -> PolicyDivergence:
    """nll, Monte-Carlo KL and action distance of the noisy rollout policy at dataset states.

    The rollout policy is sampled with its OU state at zero, i.e. its first-step distribution.
    """
    spec = parse_noise(noise_text)
    space = behaviour.actions
    first, second = behaviour.parameters(observations)
    if space.discrete:
        # Epsilon-greedy around beta_hat's argmax: the KL is a finite sum, computed exactly.
        log_beta = first - np.logaddexp.reduce(first, axis=-1, keepdims=True)
        mu = np.full(first.shape, spec.epsilon / space.n)
        greedy = first.argmax(-1)
        mu[np.arange(len(mu)), greedy] += 1 - spec.epsilon
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = np.where(mu > 0, mu * (np.log(mu) - log_beta), 0.0).sum(-1)
        samples = np.where(
            rng.uniform(size=len(mu)) < spec.epsilon, rng.integers(0, space.n, len(mu)), greedy
        )
        nll = -float(np.mean((mu * log_beta).sum(-1)))
        return {
            "kind": "epsilon-greedy (rollout)",
            "nll": nll,
            "kl_monte_carlo": float(kl.mean()),
            "action_distance": float(space.distance(samples, dataset_actions).mean()),
        }
    noise = ContinuousNoise(spec, len(first), space.n, rng)
    sampled, log_mu = noise.sample(first)
    log_beta = truncnorm_log_prob(sampled, first, np.exp(second))
    env_actions = space.denormalise(sampled)
    return {
        "kind": "gaussian (rollout)",
        "nll": -float(np.mean(log_beta)),
        "kl_monte_carlo": float(np.mean(log_mu - log_beta)),
        "action_distance": float(space.distance(env_actions, dataset_actions).mean()),
    }
