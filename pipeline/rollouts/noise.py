"""Exploration noise around a policy's mean action, with exact log-densities.

A rollout policy mu is the BC policy's mean action plus noise, kept inside the action box. Every
sampled action comes with ``log mu(a | s, noise state)`` computed for how it was kept inside:

* ``gaussian:SIGMA``: a Gaussian truncated to the box (resampled, not clipped), so its density
  is the truncated normal's, never the unclipped Gaussian's (clipping would put point masses on
  the bounds, where no density exists);
* ``ou:SIGMA[:THETA]``: Ornstein-Uhlenbeck noise x_t = (1 - theta) x_{t-1} + sigma eps, the
  action a truncated Gaussian centred at ``mean + (1 - theta) x_{t-1}``; its density is the
  conditional one given the process state (the policy is Markov in (s, x_{t-1}));
* ``uniform``: uniform on the box;
* ``epsilon:EPS`` appended to a continuous base (``gaussian:0.1+epsilon:0.05``): with
  probability EPS a uniform action, else the base; the density is the mixture's. For discrete
  actions ``epsilon:EPS`` alone is epsilon-greedy around the policy's argmax, with EPS > 0 (at
  0 the rollout policy is deterministic and has no density off its argmax);
* mixtures ``0.7*gaussian:0.1+0.3*gaussian:0.3``: weights must sum to 1.

Everything works in the normalised box ``[-1, 1]^d``; callers convert densities to the
environment's box with the scaler's log-determinant. A noise centre far outside the box (an OU
state that has drifted) is sampled and evaluated in the tail of the same truncated density, so
the samples follow ``log mu`` however far the centre lies.

A specification is parsed once, where it enters (the workflow schema, the CLI), and passed on
as a :class:`NoiseSpec`; :attr:`NoiseSpec.text` is the string it came from.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
from scipy import special  # scipy's ndtr/ndtri are vectorised C

from offaug.algorithms.nn.truncated_normal import ArrayOps, truncated_normal_log_prob

FloatArray = npt.NDArray[np.float64]
ComponentKind = Literal["gaussian", "ou", "uniform"]


class NoiseSpecError(ValueError):
    """A noise specification that cannot be parsed; the message shows the grammar."""


GRAMMAR = (
    "noise is 'gaussian:SIGMA', 'ou:SIGMA[:THETA]', 'uniform', a base plus '+epsilon:EPS', "
    "or a mixture 'W1*COMPONENT+W2*COMPONENT' with weights summing to 1; "
    "discrete actions take 'epsilon:EPS'"
)


@dataclasses.dataclass(frozen=True)
class Component:
    """One mixture component."""

    kind: ComponentKind
    weight: float
    sigma: float = 0.0
    theta: float = 0.15


@dataclasses.dataclass(frozen=True)
class NoiseSpec:
    """A parsed noise specification (see the module docstring for the grammar)."""

    components: tuple[Component, ...] = ()
    epsilon: float = 0.0
    text: str = ""
    """The specification as written (what a workflow or manifest stores)."""

    @property
    def has_ou(self) -> bool:
        """Whether any component keeps an Ornstein-Uhlenbeck state."""
        return any(c.kind == "ou" for c in self.components)


def _component(text: str, weight: float) -> Component:
    parts = text.strip().split(":")
    kind = parts[0]
    try:
        if kind == "gaussian" and len(parts) == 2:
            sigma = float(parts[1])
            if sigma <= 0:
                raise NoiseSpecError(f"gaussian sigma must be positive in {text!r}; {GRAMMAR}")
            return Component("gaussian", weight, sigma=sigma)
        if kind == "ou" and len(parts) in (2, 3):
            sigma = float(parts[1])
            theta = float(parts[2]) if len(parts) == 3 else 0.15
            if sigma <= 0 or not 0 < theta <= 1:
                raise NoiseSpecError(f"ou needs sigma > 0 and 0 < theta <= 1 in {text!r}")
            return Component("ou", weight, sigma=sigma, theta=theta)
        if kind == "uniform" and len(parts) == 1:
            return Component("uniform", weight)
    except ValueError as exc:
        if isinstance(exc, NoiseSpecError):
            raise
        raise NoiseSpecError(f"bad number in {text!r}; {GRAMMAR}") from exc
    raise NoiseSpecError(f"unknown noise component {text!r}; {GRAMMAR}")


def parse_noise(text: str) -> NoiseSpec:
    """Parse a noise specification string.

    Raises:
        NoiseSpecError: the text does not follow the grammar (the message shows it).
    """
    terms = [t.strip() for t in text.split("+") if t.strip()]
    if not terms:
        raise NoiseSpecError(f"empty noise specification; {GRAMMAR}")
    epsilon = 0.0
    components = []
    for term in terms:
        if term.startswith("epsilon:"):
            try:
                epsilon = float(term.split(":", 1)[1])
            except ValueError as exc:
                raise NoiseSpecError(f"bad epsilon in {term!r}; {GRAMMAR}") from exc
            if not 0 <= epsilon <= 1:
                raise NoiseSpecError(f"epsilon must be in [0, 1] in {term!r}")
            continue
        match = re.fullmatch(r"([0-9.eE+-]+)\s*\*\s*(.+)", term)
        if match:
            try:
                weight = float(match.group(1))
            except ValueError as exc:
                raise NoiseSpecError(f"bad weight in {term!r}; {GRAMMAR}") from exc
            components.append(_component(match.group(2), weight))
        else:
            components.append(_component(term, 1.0))
    total = sum(c.weight for c in components)
    if len(components) > 1 and not math.isclose(total, 1.0, abs_tol=1e-6):
        raise NoiseSpecError(f"mixture weights sum to {total}, not 1")
    if any(c.weight < 0 for c in components):
        raise NoiseSpecError("mixture weights must be non-negative")
    if len(components) == 1:
        components = [dataclasses.replace(components[0], weight=1.0)]
    else:
        # Exactly 1 from here on: numpy's sampler refuses weights off by more than ~1e-8.
        components = [dataclasses.replace(c, weight=c.weight / total) for c in components]
    return NoiseSpec(tuple(components), epsilon, text)


DEFAULT_NOISE = parse_noise("gaussian:0.1")
"""The default rollout noise: a truncated Gaussian of std 0.1 in normalised units."""


def _truncnorm_sample(center: FloatArray, sigma: float, rng: np.random.Generator) -> FloatArray:
    # Inverse-CDF sampling of a normal truncated to [-1, 1]: exact and vectorised.
    lower = (-1.0 - center) / sigma
    upper = (1.0 - center) / sigma
    u = rng.uniform(size=center.shape)
    low, high = special.ndtr(lower), special.ndtr(upper)
    p = np.clip(low + u * (high - low), 1e-12, 1 - 1e-12)
    z = special.ndtri(p)
    tail = (upper <= 0) | (lower >= 0)
    if tail.any():
        # The box lies wholly on one side of the centre: Phi(upper) - Phi(lower) cancels, so
        # these rows are drawn in log space on the lower tail (a box above the centre mirrored).
        mirrored = lower[tail] > 0
        a = np.where(mirrored, -upper[tail], lower[tail])
        b = np.where(mirrored, -lower[tail], upper[tail])
        v = u[tail]
        log_p = np.logaddexp(np.log1p(-v) + special.log_ndtr(a), np.log(v) + special.log_ndtr(b))
        z_tail = np.clip(special.ndtri_exp(log_p), a, b)
        z[tail] = np.where(mirrored, -z_tail, z_tail)
    return np.asarray(np.clip(center + sigma * z, -1.0, 1.0), dtype=np.float64)


def _clamp(values: FloatArray, low: float | None, high: float | None) -> FloatArray:
    # np.maximum / np.minimum: np.clip's Python wrapper costs more than the whole small call.
    if low is not None:
        values = np.maximum(values, low)
    if high is not None:
        values = np.minimum(values, high)
    return values


NUMPY_OPS = ArrayOps(
    exp=np.exp,
    log=np.log,
    log1p=np.log1p,
    where=np.where,
    ndtr=special.ndtr,
    log_ndtr=special.log_ndtr,
    clamp=_clamp,
    any=lambda x: bool(x.any()),
)


def truncnorm_log_prob(
    actions: FloatArray, center: FloatArray, sigma: float | FloatArray
) -> FloatArray:
    """Log-density of a normal truncated to ``[-1, 1]^d``, summed over the last axis.

    ``sigma`` is a scalar or an array broadcasting against ``center`` (per-state std). The
    numpy evaluation of :func:`offaug.algorithms.nn.truncated_normal.truncated_normal_log_prob`,
    the formula the learners' torch density uses.
    """
    log_prob = truncated_normal_log_prob(NUMPY_OPS, actions, center, np.log(sigma))
    return np.asarray(log_prob, dtype=np.float64)


class ContinuousNoise:
    """Samples actions around a batch of mean actions and returns their log-densities.

    Holds one OU state per environment; :meth:`reset` clears it for envs that start a new
    episode.
    """

    def __init__(
        self, spec: NoiseSpec, n_envs: int, action_dim: int, rng: np.random.Generator
    ) -> None:
        if not spec.components:
            raise NoiseSpecError(
                "epsilon-uniform needs a continuous base such as gaussian:0.1+epsilon:0.1; "
                + GRAMMAR
            )
        self.spec = spec
        self.rng = rng
        self.action_dim = action_dim
        self.ou_state = np.zeros((n_envs, action_dim))
        self._weights = np.array([c.weight for c in spec.components])
        self._log_uniform = -action_dim * math.log(2.0)

    def reset(self, env_indices: Sequence[int] | npt.NDArray[np.int64]) -> None:
        """Zero the OU state of environments that start a new episode."""
        self.ou_state[np.asarray(env_indices, dtype=np.int64)] = 0.0

    def _centers(self, mean: FloatArray, ou_state: FloatArray) -> list[FloatArray]:
        centers = []
        for component in self.spec.components:
            if component.kind == "ou":
                centers.append(mean + (1.0 - component.theta) * ou_state)
            else:
                centers.append(mean)
        return centers

    def sample(
        self, mean: FloatArray, rows: npt.NDArray[np.int64] | None = None
    ) -> tuple[FloatArray, FloatArray]:
        """Actions ``(n, d)`` in ``[-1, 1]`` around ``mean`` and ``log mu(a)`` ``(n,)``.

        ``rows`` names the environments ``mean`` belongs to (default: all, in order); only
        their OU states take part and advance.
        """
        n = mean.shape[0]
        ou_state = self.ou_state if rows is None else self.ou_state[rows]
        centers = self._centers(mean, ou_state)
        components = self.spec.components
        if len(components) == 1:
            # The common case: no component draw, no mixture log-sum-exp.
            if components[0].kind == "uniform":
                actions = self.rng.uniform(-1.0, 1.0, size=mean.shape)
            else:
                actions = _truncnorm_sample(centers[0], components[0].sigma, self.rng)
        else:
            choice = self.rng.choice(len(components), size=n, p=self._weights)
            actions = np.empty_like(mean)
            for k, component in enumerate(components):
                picked = np.equal(choice, k)
                if not picked.any():
                    continue
                if component.kind == "uniform":
                    size = (int(picked.sum()), self.action_dim)
                    actions[picked] = self.rng.uniform(-1.0, 1.0, size=size)
                else:
                    center = centers[k][picked]
                    actions[picked] = _truncnorm_sample(center, component.sigma, self.rng)
        if self.spec.epsilon > 0:
            explore = np.less(self.rng.uniform(size=n), self.spec.epsilon)
            size = (int(explore.sum()), self.action_dim)
            actions[explore] = self.rng.uniform(-1.0, 1.0, size=size)
        log_prob = self.log_prob(actions, mean, centers)
        if self.spec.has_ou:
            # The OU state follows the realised deviation from the mean action, so the next
            # conditional density is centred where the process actually is.
            if rows is None:
                self.ou_state = actions - mean
            else:
                self.ou_state[rows] = actions - mean
        return actions, log_prob

    def log_prob_of_centre(self, centre: FloatArray) -> FloatArray:
        """``log mu`` of actions ``(n, d)`` taken at the noise's own centre with no OU
        deviation: what a noiseless episode (``rollout.keep_reference``) records."""
        return self.log_prob(centre, centre, [centre for _ in self.spec.components])

    def log_prob(
        self, actions: FloatArray, mean: FloatArray, centers: list[FloatArray] | None = None
    ) -> FloatArray:
        """``log mu(a | mean, OU state)`` of the mixture, before the OU state advances."""
        centers = self._centers(mean, self.ou_state) if centers is None else centers
        n = actions.shape[0]
        per_component = []
        for component, center in zip(self.spec.components, centers, strict=True):
            if component.kind == "uniform":
                log_p = np.full(n, self._log_uniform)
            else:
                log_p = truncnorm_log_prob(actions, center, component.sigma)
            per_component.append(np.log(component.weight) + log_p)
        if len(per_component) == 1:
            log_base = per_component[0]
        else:
            log_base = np.logaddexp.reduce(np.stack(per_component), axis=0)
        epsilon = self.spec.epsilon
        if epsilon <= 0:
            return np.asarray(log_base)
        if epsilon >= 1:
            return np.full(n, self._log_uniform)
        mixed = np.logaddexp(math.log1p(-epsilon) + log_base, math.log(epsilon) + self._log_uniform)
        return np.asarray(mixed, dtype=np.float64)


class DiscreteNoise:
    """Epsilon-greedy around a discrete policy's argmax, with exact log-probabilities."""

    def __init__(self, spec: NoiseSpec, n_actions: int, rng: np.random.Generator) -> None:
        if spec.components:
            raise NoiseSpecError(f"discrete actions take 'epsilon:EPS' only, not {spec.text!r}")
        if spec.epsilon <= 0:
            raise NoiseSpecError(
                f"{spec.text!r}: with epsilon 0 the discrete rollout policy is deterministic (all"
                " its mass on the argmax), so beta_hat/mu has no density elsewhere; use"
                " epsilon:EPS with EPS > 0, e.g. epsilon:0.1"
            )
        self.epsilon = spec.epsilon
        self.n_actions = n_actions
        self.rng = rng

    def reset(self, env_indices: Sequence[int] | npt.NDArray[np.int64]) -> None:
        """No state to reset."""

    def sample(self, greedy: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], FloatArray]:
        """Actions and ``log mu(a|s)``."""
        n = greedy.shape[0]
        explore = self.rng.uniform(size=n) < self.epsilon
        actions = np.where(explore, self.rng.integers(0, self.n_actions, size=n), greedy)
        probability = np.where(
            actions == greedy,
            1 - self.epsilon + self.epsilon / self.n_actions,
            self.epsilon / self.n_actions,
        )
        return actions.astype(np.int64), np.log(probability)


def gaussian_log_prob(actions: FloatArray, mean: FloatArray, sigma: float) -> FloatArray:
    """Log-density of an untruncated diagonal Gaussian (for tests and comparisons)."""
    from scipy import stats  # scipy.stats takes a third of a second to import: only here

    return np.asarray(stats.norm.logpdf(actions, loc=mean, scale=sigma).sum(-1))
