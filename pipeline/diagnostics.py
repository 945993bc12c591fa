"""Distribution-shift diagnostics: how far augmented data and trained policies move from the data.

:func:`run_diagnostics` (the ``diagnose`` stage) loads the original dataset and the augmented
shard set, computes the sections below on at most ``config.max_states`` sampled states each
(seconds on 2 cores), writes them atomically as JSON and returns them. Each metric is also a
pure function of arrays, tested on its own. The divergence, value and OPE checks share one sample
of whole dataset episodes (:func:`sample_episodes`, at most ``max_states`` rows, drawn from its
own seed) on which every policy acts once. Each trained policy's checks are one
:func:`diagnose_policy` call, which the pipeline runs as a stage of its own as soon as that
policy is trained, and :func:`run_diagnostics` merges (or computes them itself when not given);
:func:`diagnose_run` re-runs all of it from a run directory.

Metrics schema (the run's ``metrics["diagnostics"]``). Every number is a plain ``float`` or
``int`` (non-finite values are written as ``null``), every array a list; a section that does not
apply is ``null``. ``quantiles`` are ``{"levels": [...], "values": [...]}`` with the levels of
:data:`QUANTILE_LEVELS`; histograms are ``{"edges": [...], <series>: [counts]}``.

``schema_version``, ``seed``, ``config`` (k, quantile, gamma, max_states), ``settings``
(:class:`DiagnosticsSettings`), ``timings`` (seconds per section).

``data``
    ``gamma``, ``effective_horizon`` = 1 / (1 - gamma). ``original`` and ``augmented`` (null
    without augmented data), each: ``episodes``, ``steps``, ``reward_mean``, ``reward_std``,
    ``terminals``, ``timeouts``, ``episode_length`` {mean, min, max}, ``return`` {mean, std,
    quantiles} (undiscounted episode returns). ``return_histogram``: {edges, original,
    augmented} over shared edges.
``weights`` (null without augmented data)
    ``present`` (whether the data carries ``importance_weight``), ``n``, ``ess`` = (sum w)^2 /
    sum w^2, ``ess_fraction`` = ESS / N, ``clipped_fraction`` (raw beta_hat/mu above the
    rollout's ``max_weight``; null when the log-probabilities are missing), ``weight_clip``
    (that ``max_weight``), ``mean``, ``min``, ``max`` (of the stored, clipped weights);
    ``per_shard``: [{shard, n, ess, ess_fraction, clipped_fraction}]; ``histogram``: {edges
    (log10 w), counts, zeros}; ``episodes``: the per-episode cumulative weight prod_t
    beta_hat/mu = exp(``cumulative_log_ratio`` at the episode's end): {episodes,
    log_quantiles (natural log), quantiles (exp, capped at e^700), ess, ess_fraction}.
``coverage`` (null without augmented data)
    OOD score of augmented states: the distance to the k-th nearest original state in the
    state space standardised by the original mean/std. ``threshold`` is the ``quantile`` of the
    original states' own k-NN distances (leave-one-out), ``ood_fraction`` the share of augmented
    states beyond it; ``k``, ``quantile``, ``states`` {original, augmented};
    ``original_distances`` / ``augmented_distances`` (quantiles); ``histogram`` {edges,
    original, augmented}; ``range_violation`` {per_dimension (fraction of augmented states
    outside the original min/max), any_dimension, worst_dimension, worst_fraction}.
``divergence``
    ``states``, ``dataset_nll`` (-E log beta_hat(a_data|s), the reference level), and
    ``policies``: {name: {kind, nll, kl_monte_carlo, kl_on_rollout_states, action_distance}}
    for ``bc`` (beta_hat itself), ``rollout`` (the noisy rollout policy mu) and every trained
    model. Densities are over the normalised action box [-1, 1]^d (nats); ``action_distance``
    is the mean L2 distance to the dataset action in that box (discrete: disagreement rate).
``value``: {model: ...} for every model whose trainer has ``q_values``
    ``dataset``: Q(s, a) at dataset (s, a) against the discounted Monte-Carlo return from that
    step ({q_mean, mc_mean, gap_mean, gap_std, gap_median, overestimated_fraction, sign, n,
    complete_n, complete_gap_mean}); ``rollout``: the same for Q(s, pi(s)) at states of fresh
    evaluation episodes (null without an environment); ``random_actions``: {q_dataset_actions,
    q_random_actions, difference} (uniform random actions, same states); ``scatter``:
    {dataset: {q, mc}, rollout: {q, mc}} (at most ``scatter_points`` each).
``evaluation``: {model: {returns, lengths, discounted_returns, successes, mean_return,
    mean_discounted_return, mean_length, success_rate, normalised_score}}: fresh episodes of
    each trained policy from the same reset seeds (null without an environment).
``ope``: {model: {fqe, wpdis, wpdis_ess_fraction, true_discounted_return, fqe_error,
    wpdis_error}} plus ``settings`` {target_sigma, target_epsilon, fqe_steps, fqe_tau, episodes,
    transitions, evaluation_max_length}. The truth is the evaluation episodes' mean discounted
    return.
``ranking``: [{name, rank, mean_return, mean_length, success_rate, rank_by {return, success,
    length}}], best first (null without an environment).

Conventions and their consequences:

* **KL of a deterministic policy.** ``act`` is deterministic, so KL(pi || beta_hat) is infinite
  (a point mass against a density). Reported instead is the negative log-likelihood of its
  actions under beta_hat, ``nll = -E_s log beta_hat(pi(s)|s)``, comparable with ``dataset_nll``;
  the larger the excess, the further the policy left the behaviour's support. For the Gaussian
  policies a Monte-Carlo KL is also given: ``mean(log pi(a|s) - log beta_hat(a|s))`` with
  ``a ~ pi(.|s)`` at dataset states (for ``bc`` it is 0 by definition; the rollout policy is
  sampled with its OU state at zero, i.e. its first-step distribution), and for the rollout
  policy the exact-sample estimate on the states it visited, ``mean(rollout_log_prob -
  behaviour_log_prob)`` of the augmented data.
* **Monte-Carlo returns** are computed backwards per episode with ``gamma``. An episode cut by a
  time limit (timeout) misses its tail, so its MC returns are biased *low* and Q - MC biased
  *high* near the cut. ``complete_gap_mean`` keeps only steps whose return is complete up to
  ``gamma^m < e^-3``: the episode terminated, or at least ``3 / (1 - gamma)`` steps remain.
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
* **Success** of an evaluation episode is ``info["success"]`` at its last step when the env
  reports it, else "not terminated early" (it ran to the time limit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.weights import effective_sample_size, effective_sample_size_from_logs
from offaug.pipeline.layout import AugmentedRef, DatasetRef, ModelRef
from offaug.pipeline.workflow import DiagnosticsModel

SCHEMA_VERSION = 1
QUANTILE_LEVELS: tuple[float, ...] = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
"""Quantile levels of every ``quantiles`` entry."""
# Rows per policy/critic call: BCQ decodes 100 actions per state through a 750-wide VAE.
_CHUNK = 256
# Log-weights are capped here before exp: exp(700) ~ 1e304 still fits a float64.
_LOG_CAP = 700.0

FloatArray = npt.NDArray[np.float64]
ActFunction = Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]]
QFunction = Callable[[npt.NDArray[np.float32], npt.NDArray[Any]], npt.NDArray[Any]]


@dataclasses.dataclass(frozen=True)
class DiagnosticsSettings:
    """Fixed sizes of the diagnostics that the workflow does not set (documented defaults)."""

    evaluation_episodes: int = 3
    """Fresh episodes per trained policy (reset seeds ``seed + 20_000 + i``)."""
    histogram_bins: int = 30
    """Bins of every histogram."""
    scatter_points: int = 300
    """Points kept per Q-vs-MC scatter."""
    fqe_steps: int = 500
    """Adam steps of fitted-Q evaluation."""
    fqe_hidden: tuple[int, ...] = (64, 64)
    """Hidden widths of the FQE network."""
    fqe_learning_rate: float = 1e-3
    """Adam learning rate of FQE."""
    fqe_batch_size: int = 256
    """Transitions per FQE step."""
    fqe_tau: float = 0.1
    """Polyak rate of the FQE target network."""
    target_sigma: float = 0.2
    """Std (normalised box) of the Gaussian standing in for a deterministic policy in WPDIS."""
    target_epsilon: float = 0.1
    """Epsilon of the epsilon-greedy policy standing in for a discrete greedy one in WPDIS."""


# -- small helpers -------------------------------------------------------------------------------


def quantiles(values: npt.ArrayLike) -> dict[str, list[float]]:
    """``{"levels": QUANTILE_LEVELS, "values": [...]}`` (values empty for no data)."""
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size == 0:
        return {"levels": list(QUANTILE_LEVELS), "values": []}
    return {
        "levels": list(QUANTILE_LEVELS),
        "values": [float(v) for v in np.quantile(array, QUANTILE_LEVELS)],
    }


def shared_histogram(series: Mapping[str, npt.ArrayLike | None], bins: int) -> dict[str, Any]:
    """Counts of several series over one set of edges: ``{"edges": [...], name: [...]}``.

    A series that is None stays None; finite values only.
    """
    arrays = {
        name: None if values is None else np.asarray(values, dtype=np.float64).reshape(-1)
        for name, values in series.items()
    }
    present = [a[np.isfinite(a)] for a in arrays.values() if a is not None]
    pooled = np.concatenate(present) if present else np.zeros(0)
    if pooled.size == 0:
        edges = np.linspace(0.0, 1.0, bins + 1)
    else:
        low, high = float(pooled.min()), float(pooled.max())
        if high <= low:
            low, high = low - 0.5, high + 0.5
        edges = np.linspace(low, high, bins + 1)
    out: dict[str, Any] = {"edges": edges.tolist()}
    for name, array in arrays.items():
        if array is None:
            out[name] = None
        else:
            counts, _ = np.histogram(array[np.isfinite(array)], bins=edges)
            out[name] = counts.astype(int).tolist()
    return out


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    # Small matrices only: a multi-threaded BLAS or torch pool just spins on a busy machine
    # (see offaug.pipeline.rollout), so both run on one thread here and are restored after.
    import torch
    from threadpoolctl import threadpool_limits

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(previous)


def _sample_indices(n: int, size: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """At most ``size`` distinct sorted row indices out of ``n`` (all of them when n <= size)."""
    if n <= size:
        return np.arange(n, dtype=np.int64)
    return np.sort(rng.choice(n, size=size, replace=False)).astype(np.int64)


def _flat(observations: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Observations as ``(N, features)`` float32 (a Discrete observation becomes one column)."""
    array = np.asarray(observations)
    # A writable copy when needed: torch warns on (and must not write to) read-only memory maps.
    return np.require(array.reshape(len(array), -1), dtype=np.float32, requirements=["W"])


def jsonable(value: Any) -> Any:
    """``value`` with numpy scalars/arrays as Python numbers/lists and NaN/inf as None."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return number if math.isfinite(number) else None
    return value


# -- actions and the behaviour model -------------------------------------------------------------


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
        from offaug.pipeline.rollout import BCRolloutPolicy

        policy = BCRolloutPolicy(trainer)

        def parameters(observations: npt.NDArray[np.float32]) -> tuple[FloatArray, FloatArray]:
            outputs = [policy(chunk) for chunk in _chunks(observations)]
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
        from offaug.pipeline.noise import truncnorm_log_prob

        return np.asarray(
            truncnorm_log_prob(self.actions.normalise(actions), first, np.exp(second)),
            dtype=np.float64,
        )


def _chunks(array: npt.NDArray[Any], size: int = _CHUNK) -> Iterator[npt.NDArray[Any]]:
    for start in range(0, max(len(array), 1), size):
        yield array[start : start + size]


def batched_act(act: ActFunction, observations: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``act`` over ``observations`` in chunks of :data:`_CHUNK` rows."""
    obs = _flat(observations)
    return np.concatenate([np.asarray(act(chunk)) for chunk in _chunks(obs)])


def batched_q(
    q_values: QFunction, observations: npt.NDArray[Any], actions: npt.NDArray[Any]
) -> FloatArray:
    """``q_values`` over rows in chunks of :data:`_CHUNK`."""
    obs = _flat(observations)
    parts = [
        np.asarray(q_values(obs[i : i + _CHUNK], actions[i : i + _CHUNK]), dtype=np.float64)
        for i in range(0, max(len(obs), 1), _CHUNK)
    ]
    return np.concatenate(parts).reshape(-1)


# -- importance weights ---------------------------------------------------------------------------


def weight_summary(
    weights: npt.ArrayLike, raw_log_ratio: npt.ArrayLike | None, max_weight: float | None
) -> dict[str, Any]:
    """n, ESS, ESS/N, clipped fraction (None without log-ratios or a clip), mean/min/max."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    ess = effective_sample_size(w)
    clipped = None
    if raw_log_ratio is not None and max_weight is not None and w.size:
        log_ratio = np.asarray(raw_log_ratio, dtype=np.float64).reshape(-1)
        clipped = float(np.mean(log_ratio > math.log(max_weight)))
    return {
        "n": int(w.size),
        "ess": ess,
        "ess_fraction": ess / w.size if w.size else 0.0,
        "clipped_fraction": clipped,
        "mean": float(w.mean()) if w.size else None,
        "min": float(w.min()) if w.size else None,
        "max": float(w.max()) if w.size else None,
    }


def log_weight_histogram(weights: npt.ArrayLike, bins: int) -> dict[str, Any]:
    """Histogram of log10 w over the positive weights; ``zeros`` counts w == 0."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    positive = w[w > 0]
    histogram = shared_histogram({"counts": np.log10(positive)}, bins)
    return {**histogram, "zeros": int(np.sum(w <= 0))}


def episode_log_weights(transitions: Any) -> FloatArray | None:
    """Per episode, log prod_t beta_hat/mu: ``cumulative_log_ratio`` at the episode's last row.

    Falls back to summing ``behaviour_log_prob - rollout_log_prob``; None without either.
    """
    bounds = transitions.episode_bounds()
    if len(bounds) < 2:
        return np.zeros(0)
    cumulative = transitions.extras.get("cumulative_log_ratio")
    if cumulative is not None:
        return np.asarray(cumulative, dtype=np.float64)[bounds[1:] - 1]
    if transitions.behaviour_log_prob is None or transitions.rollout_log_prob is None:
        return None
    ratio = np.asarray(transitions.behaviour_log_prob, np.float64) - np.asarray(
        transitions.rollout_log_prob, np.float64
    )
    return np.asarray(np.add.reduceat(ratio, bounds[:-1]), dtype=np.float64)


def _raw_log_ratio(transitions: Any) -> FloatArray | None:
    if transitions.behaviour_log_prob is None or transitions.rollout_log_prob is None:
        return None
    return np.asarray(transitions.behaviour_log_prob, np.float64) - np.asarray(
        transitions.rollout_log_prob, np.float64
    )


def importance_weight_diagnostics(
    shards: Sequence[tuple[str, Any]], max_weight: float | None, bins: int
) -> dict[str, Any]:
    """The ``weights`` section over named shards of augmented :class:`Transitions`."""
    weights, log_ratios, episode_logs, per_shard = [], [], [], []
    present = all(part.importance_weight is not None for _, part in shards) and bool(shards)
    for name, part in shards:
        w = (
            np.ones(len(part))
            if part.importance_weight is None
            else np.asarray(part.importance_weight, np.float64)
        )
        log_ratio = _raw_log_ratio(part)
        weights.append(w)
        if log_ratio is not None:
            log_ratios.append(log_ratio)
        logs = episode_log_weights(part)
        if logs is not None:
            episode_logs.append(logs)
        summary = weight_summary(w, log_ratio, max_weight)
        per_shard.append(
            {
                "shard": name,
                **{k: summary[k] for k in ("n", "ess", "ess_fraction", "clipped_fraction")},
            }
        )
    all_weights = np.concatenate(weights) if weights else np.zeros(0)
    all_log_ratio = (
        np.concatenate(log_ratios) if len(log_ratios) == len(shards) and log_ratios else None
    )
    episodes = None
    if episode_logs and len(episode_logs) == len(shards):
        logs = np.concatenate(episode_logs)
        ess = effective_sample_size_from_logs(logs)
        episodes = {
            "episodes": len(logs),
            "log_quantiles": quantiles(logs),
            "quantiles": quantiles(np.exp(np.minimum(logs, _LOG_CAP))),
            "ess": ess,
            "ess_fraction": ess / len(logs) if len(logs) else 0.0,
        }
    return {
        "present": present,
        **weight_summary(all_weights, all_log_ratio, max_weight),
        "weight_clip": max_weight,
        "per_shard": per_shard,
        "histogram": log_weight_histogram(all_weights, bins),
        "episodes": episodes,
    }


# -- state coverage -------------------------------------------------------------------------------


def standardiser(reference: npt.NDArray[Any]) -> tuple[FloatArray, FloatArray]:
    """Mean and std of ``reference`` per dimension (a constant dimension gets std 1)."""
    array = np.asarray(reference, dtype=np.float64)
    std = array.std(axis=0)
    return array.mean(axis=0), np.where(std > 1e-8, std, 1.0)


def knn_distances(tree: Any, reference_size: int, queries: FloatArray, k: int) -> FloatArray:
    """Distance of each query to its k-th nearest reference point, leaving the query out.

    ``k + 1`` neighbours are asked for; a query found in the reference at distance 0 (itself, or
    an identical state) is dropped from its own neighbours, which makes the reference's own
    distances leave-one-out and gives data identical to the reference the same distances.
    """
    if len(queries) == 0:
        return np.zeros(0)
    asked = min(k + 1, reference_size)
    distances, _ = tree.query(queries, k=asked)
    distances = np.asarray(distances, dtype=np.float64).reshape(len(queries), asked)
    self_match = distances[:, 0] == 0.0
    column = np.where(self_match, min(k, asked - 1), min(k - 1, asked - 1))
    return np.asarray(distances[np.arange(len(queries)), column], dtype=np.float64)


def range_violations(original: npt.NDArray[Any], augmented: npt.NDArray[Any]) -> dict[str, Any]:
    """Fraction of augmented states outside the original's per-dimension [min, max]."""
    # Views, not copies: these are all rows, possibly memory-mapped.
    reference = np.asarray(original).reshape(len(original), -1)
    states = np.asarray(augmented).reshape(len(augmented), -1)
    if len(states) == 0 or len(reference) == 0:
        return {
            "per_dimension": [],
            "any_dimension": 0.0,
            "worst_dimension": None,
            "worst_fraction": 0.0,
        }
    outside = (states < reference.min(axis=0)) | (states > reference.max(axis=0))
    per_dimension = outside.mean(axis=0)
    worst = int(np.argmax(per_dimension))
    return {
        "per_dimension": [float(v) for v in per_dimension],
        "any_dimension": float(outside.any(axis=1).mean()),
        "worst_dimension": worst,
        "worst_fraction": float(per_dimension[worst]),
    }


def state_coverage(
    original: npt.NDArray[Any],
    augmented: npt.NDArray[Any],
    *,
    k: int,
    quantile: float,
    max_states: int,
    rng: np.random.Generator,
    bins: int = 30,
) -> dict[str, Any]:
    """The ``coverage`` section: k-NN OOD score of augmented states against the original.

    Up to ``max_states`` states of each are sampled; both are standardised with the original
    sample's mean and std; the threshold is the ``quantile`` of the original sample's own
    leave-one-out k-NN distances.
    """
    from scipy.spatial import cKDTree

    reference = _flat(np.asarray(original)[_sample_indices(len(original), max_states, rng)])
    queries = _flat(np.asarray(augmented)[_sample_indices(len(augmented), max_states, rng)])
    mean, std = standardiser(reference)
    reference_std = (reference - mean) / std
    queries_std = (queries - mean) / std
    tree = cKDTree(reference_std)
    own = knn_distances(tree, len(reference_std), reference_std, k)
    threshold = float(np.quantile(own, quantile)) if own.size else 0.0
    distances = knn_distances(tree, len(reference_std), queries_std, k)
    return {
        "k": k,
        "quantile": quantile,
        "threshold": threshold,
        "ood_fraction": float(np.mean(distances > threshold)) if distances.size else 0.0,
        "states": {"original": len(reference), "augmented": len(queries)},
        "original_distances": quantiles(own),
        "augmented_distances": quantiles(distances),
        "histogram": shared_histogram({"original": own, "augmented": distances}, bins),
        "range_violation": range_violations(original, augmented),
    }


# -- returns and data -----------------------------------------------------------------------------


def discounted_returns(
    rewards: npt.ArrayLike, episode_ids: npt.ArrayLike, gamma: float
) -> FloatArray:
    """G_t = r_t + gamma G_{t+1} inside each episode, computed backwards; (N,) float64.

    An episode's last step has G = r (its tail is unknown after a timeout: biased low there).
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    ids = np.asarray(episode_ids).reshape(-1)
    out = r.copy()
    if r.size == 0:
        return out
    # Sweep by distance from the episode's end: one vectorised step per distance over the rows
    # at that distance (grouped once by a stable sort), instead of a Python loop over rows.
    to_end = steps_to_end(ids)
    order = np.argsort(to_end, kind="stable")
    group_ends = np.cumsum(np.bincount(to_end))
    for distance in range(1, len(group_ends)):
        rows = order[group_ends[distance - 1] : group_ends[distance]]
        out[rows] = r[rows] + gamma * out[rows + 1]
    return out


def steps_to_end(episode_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Per row, the number of rows after it in the same episode (0 at the last row)."""
    ids = np.asarray(episode_ids).reshape(-1)
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(ids)) + 1))
    stops = np.concatenate((starts[1:], [ids.size]))
    lengths = stops - starts
    position = np.arange(ids.size) - np.repeat(starts, lengths)
    return np.asarray(np.repeat(lengths, lengths) - 1 - position, dtype=np.int64)


def complete_returns(
    terminals: npt.ArrayLike, episode_ids: npt.ArrayLike, gamma: float
) -> npt.NDArray[np.bool_]:
    """Rows whose discounted MC return is complete up to gamma^m < e^-3.

    True when the row's episode ended in a terminal, or at least 3 / (1 - gamma) rows follow.
    """
    ids = np.asarray(episode_ids).reshape(-1)
    to_end = steps_to_end(ids)
    if ids.size == 0:
        return np.zeros(0, dtype=bool)
    terminal = np.asarray(terminals, dtype=bool).reshape(-1)
    last_rows = np.flatnonzero(to_end == 0)
    episode_terminated = terminal[last_rows]
    starts = np.concatenate(([0], last_rows[:-1] + 1))
    per_row = np.repeat(episode_terminated, last_rows - starts + 1)
    return np.asarray(per_row | (to_end >= 3.0 / (1.0 - gamma)), dtype=bool)


def episode_returns(transitions: Any) -> FloatArray:
    """Undiscounted return of every episode."""
    if len(transitions) == 0:
        return np.zeros(0)
    bounds = transitions.episode_bounds()
    rewards = np.asarray(transitions.rewards, dtype=np.float64)
    return np.asarray(np.add.reduceat(rewards, bounds[:-1]), dtype=np.float64)


def data_summary(transitions: Any) -> dict[str, Any]:
    """Episodes, steps, reward mean/std, episode lengths and returns, terminal/timeout counts."""
    rewards = np.asarray(transitions.rewards, dtype=np.float64)
    lengths = np.diff(transitions.episode_bounds())
    returns = episode_returns(transitions)
    return {
        "episodes": int(transitions.num_episodes),
        "steps": len(transitions),
        "reward_mean": float(rewards.mean()) if rewards.size else None,
        "reward_std": float(rewards.std()) if rewards.size else None,
        "terminals": int(np.count_nonzero(transitions.terminals)),
        "timeouts": int(np.count_nonzero(transitions.timeouts)),
        "episode_length": {
            "mean": float(lengths.mean()) if lengths.size else None,
            "min": int(lengths.min()) if lengths.size else None,
            "max": int(lengths.max()) if lengths.size else None,
        },
        "return": {
            "mean": float(returns.mean()) if returns.size else None,
            "std": float(returns.std()) if returns.size else None,
            "quantiles": quantiles(returns),
        },
    }


def data_section(original: Any, augmented: Any | None, gamma: float, bins: int) -> dict[str, Any]:
    """The ``data`` section: both datasets' summaries and their return histograms."""
    return {
        "gamma": gamma,
        "effective_horizon": 1.0 / (1.0 - gamma),
        "original": data_summary(original),
        "augmented": None if augmented is None else data_summary(augmented),
        "return_histogram": shared_histogram(
            {
                "original": episode_returns(original),
                "augmented": None if augmented is None else episode_returns(augmented),
            },
            bins,
        ),
    }


# -- value over-estimation ------------------------------------------------------------------------


def value_gap(
    q: npt.ArrayLike, mc: npt.ArrayLike, complete: npt.ArrayLike | None = None
) -> dict[str, Any]:
    """Q-hat against Monte-Carlo returns: mean gap Q - MC, its spread, sign and share > 0.

    ``complete`` marks rows whose MC return is complete (see :func:`complete_returns`).
    """
    q_array = np.asarray(q, dtype=np.float64).reshape(-1)
    mc_array = np.asarray(mc, dtype=np.float64).reshape(-1)
    gap = q_array - mc_array
    if gap.size == 0:
        return {"n": 0}
    mask = (
        np.ones(gap.size, dtype=bool)
        if complete is None
        else np.asarray(complete, dtype=bool).reshape(-1)
    )
    mean_gap = float(gap.mean())
    return {
        "n": int(gap.size),
        "q_mean": float(q_array.mean()),
        "mc_mean": float(mc_array.mean()),
        "gap_mean": mean_gap,
        "gap_std": float(gap.std()),
        "gap_median": float(np.median(gap)),
        "overestimated_fraction": float(np.mean(gap > 0)),
        "sign": "over" if mean_gap > 0 else "under" if mean_gap < 0 else "exact",
        "complete_n": int(mask.sum()),
        "complete_gap_mean": float(gap[mask].mean()) if mask.any() else None,
    }


def random_action_gap(
    q_values: QFunction,
    observations: npt.NDArray[Any],
    dataset_actions: npt.NDArray[Any],
    random_actions: npt.NDArray[Any],
) -> dict[str, float]:
    """Mean Q at uniform random actions against mean Q at dataset actions, same states."""
    at_data = batched_q(q_values, observations, dataset_actions)
    at_random = batched_q(q_values, observations, random_actions)
    return {
        "q_dataset_actions": float(at_data.mean()),
        "q_random_actions": float(at_random.mean()),
        "difference": float(at_random.mean() - at_data.mean()),
    }


def _scatter(q: FloatArray, mc: FloatArray, points: int, rng: np.random.Generator) -> Any:
    index = _sample_indices(len(q), points, rng)
    return {"q": q[index].tolist(), "mc": mc[index].tolist()}


# -- evaluation episodes and ranking --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Episode:
    """One evaluation episode of a greedy policy."""

    observations: npt.NDArray[np.float32]  # (T, obs)
    actions: npt.NDArray[Any]  # (T, *act)
    rewards: FloatArray  # (T,)
    terminated: bool
    """Ended by the MDP (not by the time limit)."""
    success: bool
    """``info["success"]`` at the last step, else ``not terminated``."""

    @property
    def length(self) -> int:
        """Steps taken."""
        return len(self.rewards)


def run_episodes(act: ActFunction, env: Any, reset_seeds: Sequence[int]) -> list[Episode]:
    """One greedy episode per reset seed (fixed start states for every policy)."""
    episodes = []
    for seed in reset_seeds:
        observation, _ = env.reset(seed=int(seed))
        observations, actions, rewards = [], [], []
        terminated = truncated = False
        info: Mapping[str, Any] = {}
        while not (terminated or truncated):
            obs = np.asarray(observation, dtype=np.float32).reshape(-1)
            action = np.asarray(act(obs[None]))[0]
            observation, reward, terminated, truncated, info = env.step(action)
            observations.append(obs)
            actions.append(action)
            rewards.append(float(reward))
        success = bool(info["success"]) if "success" in info else not bool(terminated)
        episodes.append(
            Episode(
                np.asarray(observations, dtype=np.float32),
                np.asarray(actions),
                np.asarray(rewards, dtype=np.float64),
                bool(terminated),
                success,
            )
        )
    return episodes


def episode_records(episodes: Sequence[Episode], gamma: float) -> dict[str, Any]:
    """Returns, lengths, discounted returns and success of evaluation episodes."""
    returns = [float(e.rewards.sum()) for e in episodes]
    discounted = [
        float(np.sum(e.rewards * gamma ** np.arange(e.length))) if e.length else 0.0
        for e in episodes
    ]
    lengths = [e.length for e in episodes]
    return {
        "returns": returns,
        "lengths": lengths,
        "discounted_returns": discounted,
        "successes": [e.success for e in episodes],
        "mean_return": float(np.mean(returns)) if returns else None,
        "mean_discounted_return": float(np.mean(discounted)) if discounted else None,
        "mean_length": float(np.mean(lengths)) if lengths else None,
        "success_rate": float(np.mean([e.success for e in episodes])) if episodes else None,
    }


def evaluate_checkpoint(
    path: str, env_meta: Mapping[str, Any], reset_seeds: Sequence[int], gamma: float = 0.99
) -> dict[str, Any]:
    """Load a checkpoint and run one greedy episode per reset seed (a Dask-friendly task)."""
    from offaug.algorithms.evaluate import make_env
    from offaug.algorithms.train import load_trainer

    trainer = load_trainer(path, device="cpu")
    env = make_env(env_meta)
    try:
        episodes = run_episodes(trainer.act, env, reset_seeds)
    finally:
        env.close()
    return {"name": str(path), "path": str(path), **episode_records(episodes, gamma)}


def rank_results(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rank evaluated policies, best first: by mean return, then success rate, then length.

    Each entry also gets its rank on each criterion alone (1 is best; ties share the best rank;
    a longer episode ranks higher, as in locomotion where falling ends an episode).
    """
    from scipy.stats import rankdata

    if not results:
        return []

    criteria = {"return": "mean_return", "success": "success_rate", "length": "mean_length"}
    # Higher is better on every criterion; a missing value counts as 0.
    scores = {
        name: np.array([float(r.get(key) or 0.0) for r in results])
        for name, key in criteria.items()
    }
    by = {name: rankdata(-values, method="min") for name, values in scores.items()}
    order = np.lexsort((-scores["length"], -scores["success"], -scores["return"]))
    ranked = []
    for position, i in enumerate(order.tolist(), start=1):
        entry = results[i]
        ranked.append(
            {
                "name": entry.get("name"),
                "path": entry.get("path"),
                "rank": position,
                "mean_return": entry.get("mean_return"),
                "mean_length": entry.get("mean_length"),
                "success_rate": entry.get("success_rate"),
                "rank_by": {name: int(ranks[i]) for name, ranks in by.items()},
            }
        )
    return ranked


def rank_checkpoints(
    checkpoints: Sequence[str],
    env_meta: Mapping[str, Any],
    episodes: int,
    seeds: Sequence[int],
    client: Any = None,
) -> list[dict[str, Any]]:
    """Evaluate many checkpoints from the same start states and rank them, best first.

    Every checkpoint runs one greedy episode per reset seed ``seed + i`` for ``seed`` in
    ``seeds`` and ``i < episodes``, so all see the same start states. With a Dask ``client``
    the checkpoints are evaluated in parallel (``client.map``, one task each); without, one
    after another. The client is used through its methods only: this module never imports Dask.

    Returns:
        :func:`rank_results` entries; ``name`` and ``path`` are the checkpoint path.
    """
    reset_seeds = [int(seed) + i for seed in seeds for i in range(episodes)]
    paths = [str(p) for p in checkpoints]
    if client is None:
        results = [evaluate_checkpoint(p, dict(env_meta), reset_seeds) for p in paths]
    else:
        futures = client.map(
            evaluate_checkpoint,
            paths,
            env_meta=dict(env_meta),
            reset_seeds=reset_seeds,
            pure=False,
        )
        results = client.gather(futures)
    return rank_results(results)


# -- off-policy evaluation ------------------------------------------------------------------------


def weighted_per_decision_is(
    rewards: npt.ArrayLike, episode_ids: npt.ArrayLike, log_ratios: npt.ArrayLike, gamma: float
) -> dict[str, Any]:
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
    from offaug.pipeline.noise import truncnorm_log_prob

    space = behaviour.actions
    log_beta = behaviour.log_prob(_flat(observations), dataset_actions)
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
    import torch

    from offaug.algorithms.networks import MLP

    obs = np.asarray(observations, dtype=np.float32)
    mean, std = standardiser(obs)
    reward_array = np.asarray(rewards, dtype=np.float64).reshape(-1)
    scale = float(reward_array.std()) or 1.0

    def inputs(states: npt.NDArray[Any], actions: npt.NDArray[Any]) -> torch.Tensor:
        standard = ((np.asarray(states, np.float64) - mean) / std).astype(np.float32)
        return torch.as_tensor(np.concatenate([standard, actions], axis=1), dtype=torch.float32)

    with _single_threaded(), torch.random.fork_rng(devices=[]):
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


# -- the stage ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Policy:
    name: str
    act: ActFunction
    q_values: QFunction | None


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - started, 4)


def _rollout_divergence(
    behaviour: BehaviourModel,
    observations: npt.NDArray[np.float32],
    dataset_actions: npt.NDArray[Any],
    noise_text: str,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """nll, Monte-Carlo KL and action distance of the noisy rollout policy at dataset states."""
    from offaug.pipeline.noise import ContinuousNoise, parse_noise, truncnorm_log_prob

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


def policy_divergence(
    behaviour: BehaviourModel,
    observations: npt.NDArray[np.float32],
    dataset_actions: npt.NDArray[Any],
    policy_actions: npt.NDArray[Any],
) -> dict[str, Any]:
    """A deterministic policy's -E log beta_hat(pi(s)|s) and distance to dataset actions."""
    log_beta = behaviour.log_prob(observations, policy_actions)
    return {
        "kind": "deterministic (act)",
        "nll": -float(np.mean(log_beta)),
        "kl_monte_carlo": None,
        "action_distance": float(
            behaviour.actions.distance(policy_actions, dataset_actions).mean()
        ),
    }


def run_diagnostics(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    bc: ModelRef,
    models: list[ModelRef],
    config: DiagnosticsModel,
    out: str,
    seed: int,
    *,
    settings: DiagnosticsSettings | None = None,
    parts: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Compute every diagnostic (module docstring), write ``out`` (JSON) atomically, return it.

    Args:
        data: The source dataset.
        augmented: The augmented shard set, or None for a run without augmentation.
        bc: The Gaussian BC checkpoint: beta_hat and the rollout policy's mean.
        models: Trained learners; those whose trainer has ``q_values`` get the value checks.
        config: k, quantile, gamma and max_states.
        out: The JSON file to write.
        seed: Seed of every sample drawn here.
        settings: Sizes the workflow does not set (defaults: :class:`DiagnosticsSettings`).
        parts: The per-policy checks of ``models`` already made by :func:`diagnose_policy`
            (the pipeline runs them as stages of their own); computed here when None.
    """
    with _single_threaded():
        result = _diagnose(data, augmented, bc, models, config, seed, settings, parts)
    from offaug.datasets.atomic import write_json_atomic

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    return result


def sample_episodes(
    episode_ids: npt.ArrayLike, max_states: int, rng: np.random.Generator
) -> npt.NDArray[np.int64]:
    """Rows of whole episodes, taken in random order until ``max_states`` rows (sorted).

    At least one episode is taken; it is cut at ``max_states`` rows when longer.
    """
    ids = np.asarray(episode_ids).reshape(-1)
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(ids)) + 1, [ids.size]))
    order = rng.permutation(len(bounds) - 1)
    lengths = np.diff(bounds)[order]
    count = max(1, int(np.searchsorted(np.cumsum(lengths), max_states, side="right")))
    rows = np.concatenate([np.arange(bounds[e], bounds[e + 1]) for e in np.sort(order[:count])])
    return rows[:max_states].astype(np.int64)


def _next_actions(
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


def _diagnose(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    bc: ModelRef,
    models: list[ModelRef],
    config: DiagnosticsModel,
    seed: int,
    settings: DiagnosticsSettings | None,
    parts: Sequence[Mapping[str, Any]] | None,
) -> dict[str, Any]:
    from offaug.algorithms.train import load_trainer
    from offaug.datasets import ShardSet, load_transitions

    settings = settings or DiagnosticsSettings()
    rng = np.random.default_rng(seed)
    timer = _Timer()
    gamma = config.gamma
    bins = settings.histogram_bins
    with timer("load"):
        original = load_transitions(data.source)
        shard_set = ShardSet.open(augmented.directory) if augmented is not None else None
        shards = []
        augmented_data = None
        if shard_set is not None:
            shards = [(Path(ref.path).name, shard_set.read(ref)) for ref in shard_set.shards]
            # Every shard was just verified by read(): no second hashing pass.
            augmented_data = shard_set.load(verify=False)
        bc_trainer = load_trainer(bc.path, device="cpu")
        behaviour = BehaviourModel.from_trainer(bc_trainer)

    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "seed": seed,
        "config": config.model_dump(mode="json"),
        "settings": dataclasses.asdict(settings),
    }
    with timer("data"):
        result["data"] = data_section(original, augmented_data, gamma, bins)
    with timer("weights"):
        result["weights"] = None
        if shard_set is not None:
            # The rollout's clip, as its manifest records it.
            max_weight = shard_set.params.get("max_weight")
            result["weights"] = importance_weight_diagnostics(
                shards, None if max_weight is None else float(max_weight), bins
            )
    with timer("coverage"):
        result["coverage"] = None
        if augmented_data is not None and len(augmented_data):
            result["coverage"] = state_coverage(
                original.observations,
                augmented_data.observations,
                k=config.k,
                quantile=config.quantile,
                max_states=config.max_states,
                rng=rng,
                bins=bins,
            )

    # One sample of whole episodes serves every policy check: each policy acts on it once.
    sample = _draw_sample(original, config, seed)
    if parts is None:
        parts = [
            _policy_part(data, behaviour, sample, model, config, seed, index, settings)
            for index, model in enumerate(models)
        ]
    with timer("divergence"):
        noise = shard_set.params.get("noise") if shard_set is not None else None
        result["divergence"] = _divergence_section(
            behaviour, bc_trainer, parts, sample, augmented_data, noise, rng
        )
    evaluations = [part["evaluation"] for part in parts]
    if any(entry is None for entry in evaluations):  # no environment to evaluate in
        result["evaluation"] = None
        result["ranking"] = None
    else:
        result["evaluation"] = {part["name"]: part["evaluation"] for part in parts}
        result["ranking"] = rank_results(
            [{"name": name, **entry} for name, entry in result["evaluation"].items()]
        )
    result["value"] = {part["name"]: part["value"] for part in parts if part["value"] is not None}
    lengths = [part["evaluation_max_length"] for part in parts]
    result["ope"] = {
        "settings": {
            "target_sigma": settings.target_sigma,
            "target_epsilon": settings.target_epsilon,
            "fqe_steps": settings.fqe_steps,
            "fqe_tau": settings.fqe_tau,
            "episodes": len(sample.starts),
            "transitions": len(sample.rows),
            # Evaluation episodes shorter than ~3 effective horizons are cut by the time limit:
            # FQE (infinite horizon) then reads high against their returns.
            "evaluation_max_length": max((n for n in lengths if n is not None), default=None),
        },
        **{part["name"]: part["ope"] for part in parts if part["ope"] is not None},
    }
    timer.seconds.update({f"policy:{part['name']}": part["seconds"] for part in parts})
    result["timings"] = timer.seconds
    converted: dict[str, Any] = jsonable(result)
    return converted


@dataclasses.dataclass(frozen=True, eq=False)
class _Sample:
    """Whole dataset episodes sampled for the policy checks (rows of the original data)."""

    rows: npt.NDArray[np.int64]  # (M,)
    states: npt.NDArray[np.float32]  # (M, obs)
    actions: npt.NDArray[Any]  # (M, *act)
    next_states: npt.NDArray[np.float32]  # (M, obs)
    rewards: FloatArray  # (M,)
    terminals: npt.NDArray[np.bool_]  # (M,)
    episode_ids: npt.NDArray[Any]  # (M,)
    returns: FloatArray  # (M,) discounted MC return from each row, over the whole episode
    complete: npt.NDArray[np.bool_]  # (M,) whether that return is complete

    @property
    def starts(self) -> npt.NDArray[np.int64]:
        """Positions (in the sample) of each sampled episode's first row."""
        if len(self.rows) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(([0], np.flatnonzero(np.diff(self.episode_ids)) + 1)).astype(np.int64)


def _divergence_section(
    behaviour: BehaviourModel,
    bc_trainer: Any,
    parts: Sequence[Mapping[str, Any]],
    sample: _Sample,
    augmented_data: Any | None,
    noise_text: str | None,
    rng: np.random.Generator,
) -> dict[str, Any]:
    states, dataset_actions = sample.states, sample.actions
    section: dict[str, Any] = {
        "states": len(states),
        "dataset_nll": -float(np.mean(behaviour.log_prob(states, dataset_actions))),
        "policies": {},
    }
    bc_actions = batched_act(bc_trainer.act, states)
    bc_entry = policy_divergence(behaviour, states, dataset_actions, bc_actions)
    # beta_hat against itself: the Monte-Carlo KL is 0 by definition.
    kind = "categorical" if behaviour.actions.discrete else "gaussian"
    section["policies"]["bc"] = {**bc_entry, "kind": f"{kind} (beta_hat)", "kl_monte_carlo": 0.0}
    if noise_text is not None:
        rollout_entry = _rollout_divergence(behaviour, states, dataset_actions, noise_text, rng)
        log_ratio = None if augmented_data is None else _raw_log_ratio(augmented_data)
        rollout_entry["kl_on_rollout_states"] = (
            None if log_ratio is None or log_ratio.size == 0 else -float(log_ratio.mean())
        )
        section["policies"]["rollout"] = rollout_entry
    for part in parts:
        section["policies"][part["name"]] = part["divergence"]
    return section


def _evaluation_episodes(
    meta: Mapping[str, Any],
    policies: Sequence[_Policy],
    seed: int,
    settings: DiagnosticsSettings,
) -> dict[str, list[Episode]] | None:
    """Fresh episodes of every policy from the same reset seeds; None without an environment."""
    if not policies:
        return {}
    from gymnasium.error import Error as GymnasiumError

    from offaug.algorithms.evaluate import make_env

    try:
        env = make_env(meta)
    except (ValueError, GymnasiumError):
        # The dataset records no (or no installed) environment: evaluation-based checks skip.
        return None
    reset_seeds = [seed + 20_000 + i for i in range(settings.evaluation_episodes)]
    try:
        return {policy.name: run_episodes(policy.act, env, reset_seeds) for policy in policies}
    finally:
        env.close()


def _evaluation_entry(
    episodes: Sequence[Episode], gamma: float, meta: Mapping[str, Any]
) -> dict[str, Any]:
    from offaug.algorithms.evaluate import reference_scores

    record = episode_records(episodes, gamma)
    scores = reference_scores(meta, None)
    normalised = None
    if scores is not None and scores[1] != scores[0] and record["mean_return"] is not None:
        normalised = 100.0 * (record["mean_return"] - scores[0]) / (scores[1] - scores[0])
    return {**record, "normalised_score": normalised}


def _value_entry(
    policy: _Policy,
    sample: _Sample,
    actions: ActionSpace,
    episodes: Mapping[str, Sequence[Episode]] | None,
    gamma: float,
    settings: DiagnosticsSettings,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Q-hat against MC returns on the data and on fresh episodes; Q at random actions."""
    assert policy.q_values is not None
    q_data = batched_q(policy.q_values, sample.states, sample.actions)
    entry: dict[str, Any] = {
        "dataset": value_gap(q_data, sample.returns, sample.complete),
        "random_actions": random_action_gap(
            policy.q_values, sample.states, sample.actions, actions.uniform(rng, len(sample.rows))
        ),
        "rollout": None,
        "scatter": {
            "dataset": _scatter(q_data, sample.returns, settings.scatter_points, rng),
            "rollout": None,
        },
    }
    runs = None if episodes is None else episodes.get(policy.name)
    if runs:
        observations = np.concatenate([e.observations for e in runs])
        ids = np.repeat(np.arange(len(runs)), [e.length for e in runs])
        terminals = np.zeros(len(ids), dtype=bool)
        terminals[np.cumsum([e.length for e in runs]) - 1] = [e.terminated for e in runs]
        mc = discounted_returns(np.concatenate([e.rewards for e in runs]), ids, gamma)
        q = batched_q(policy.q_values, observations, np.concatenate([e.actions for e in runs]))
        entry["rollout"] = value_gap(q, mc, complete_returns(terminals, ids, gamma))
        entry["scatter"]["rollout"] = _scatter(q, mc, settings.scatter_points, rng)
    return entry


def _ope_entry(
    behaviour: BehaviourModel,
    policy: _Policy,
    actions: npt.NDArray[Any],
    sample: _Sample,
    runs: Sequence[Episode] | None,
    gamma: float,
    settings: DiagnosticsSettings,
    seed: int,
) -> dict[str, Any] | None:
    """FQE and WPDIS of one trained policy from the original data, against the truth."""
    if len(sample.rows) == 0:
        return None
    space = behaviour.actions
    starts = sample.starts
    next_actions = _next_actions(
        policy.act, sample.states, sample.next_states, sample.episode_ids, actions
    )
    fqe = fitted_q_evaluation(
        sample.states,
        space.features(sample.actions),
        sample.rewards,
        sample.next_states,
        space.features(next_actions),
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


def _draw_sample(original: Any, config: DiagnosticsModel, seed: int) -> _Sample:
    """The shared sample of whole episodes, drawn from its own seed so every per-policy stage
    draws the same one."""
    rows = sample_episodes(
        original.episode_ids, config.max_states, np.random.default_rng([seed, 1])
    )
    gamma = config.gamma
    return _Sample(
        rows=rows,
        states=_flat(original.observations[rows]),
        actions=np.asarray(original.actions[rows]),
        next_states=_flat(original.next_observations[rows]),
        rewards=np.asarray(original.rewards[rows], dtype=np.float64),
        terminals=np.asarray(original.terminals[rows], dtype=bool),
        episode_ids=np.asarray(original.episode_ids[rows]),
        returns=discounted_returns(original.rewards, original.episode_ids, gamma)[rows],
        complete=complete_returns(original.terminals, original.episode_ids, gamma)[rows],
    )


def diagnose_policy(
    data: DatasetRef,
    bc: ModelRef,
    model: ModelRef,
    config: DiagnosticsModel,
    seed: int,
    index: int,
    *,
    settings: DiagnosticsSettings | None = None,
) -> dict[str, Any]:
    """The checks of one trained policy: divergence from beta_hat, fresh evaluation episodes,
    Q against Monte-Carlo returns and OPE (FQE seeded ``seed + index``, WPDIS).

    A stage of its own in the pipeline, run as soon as that policy is trained (in parallel with
    the other trainings); :func:`run_diagnostics` merges the parts. Returns ``{name,
    divergence, evaluation, value, ope, evaluation_max_length, seconds}`` (JSON-ready).
    """
    from offaug.algorithms.train import load_trainer
    from offaug.datasets import load_transitions

    with _single_threaded():
        behaviour = BehaviourModel.from_trainer(load_trainer(bc.path, device="cpu"))
        sample = _draw_sample(load_transitions(data.source), config, seed)
        part = _policy_part(
            data, behaviour, sample, model, config, seed, index, settings or DiagnosticsSettings()
        )
    converted: dict[str, Any] = jsonable(part)
    return converted


def _policy_part(
    data: DatasetRef,
    behaviour: BehaviourModel,
    sample: _Sample,
    model: ModelRef,
    config: DiagnosticsModel,
    seed: int,
    index: int,
    settings: DiagnosticsSettings,
) -> dict[str, Any]:
    """One policy's checks on the shared sample (``run_diagnostics`` passes its own)."""
    from offaug.algorithms.train import load_trainer

    started = time.perf_counter()
    trainer = load_trainer(model.path, device="cpu")
    policy = _Policy(model.name, trainer.act, getattr(trainer, "q_values", None))
    greedy = batched_act(policy.act, sample.states)
    divergence = policy_divergence(behaviour, sample.states, sample.actions, greedy)
    episodes = _evaluation_episodes(data.meta, [policy], seed, settings)
    runs = None if episodes is None else episodes.get(policy.name)
    gamma = config.gamma
    evaluation = None if runs is None else _evaluation_entry(runs, gamma, data.meta)
    value = None
    if policy.q_values is not None:
        rng = np.random.default_rng([seed, 2, index])
        value = _value_entry(policy, sample, behaviour.actions, episodes, gamma, settings, rng)
    ope = _ope_entry(behaviour, policy, greedy, sample, runs, gamma, settings, seed + index)
    return {
        "name": model.name,
        "divergence": divergence,
        "evaluation": evaluation,
        "value": value,
        "ope": ope,
        "evaluation_max_length": max((e.length for e in runs), default=None) if runs else None,
        "seconds": time.perf_counter() - started,
    }


def diagnose_run(
    run_dir: str | Path, *, settings: DiagnosticsSettings | None = None
) -> dict[str, Any]:
    """Run the diagnostics of a finished run again, from its records (``offaug diagnose``).

    Reads ``RUN_DIR/stages.json`` (the records of stages ``source``, ``bc``, ``rollout`` and
    ``train:<algorithm>-<data>``) and the ``diagnostics`` section and seed of
    ``RUN_DIR/workflow.yaml`` (defaults without one), writes ``RUN_DIR/diagnostics.json`` and
    puts the result under ``"diagnostics"`` in ``RUN_DIR/metrics.json``. Stage records are not
    touched.

    Raises:
        FileNotFoundError: no ``stages.json``.
        DataError: the records lack the ``source`` or ``bc`` stage.
    """
    import json

    from offaug.datasets.atomic import write_json_atomic
    from offaug.datasets.errors import DataError
    from offaug.pipeline.layout import RunLayout
    from offaug.pipeline.workflow import load_workflow

    layout = RunLayout(Path(run_dir))
    if not layout.stages.is_file():
        raise FileNotFoundError(f"{layout.stages}: no stage records; run the workflow first")
    stages = json.loads(layout.stages.read_text()).get("stages", {})

    def record(name: str, kind: type[Any]) -> Any:
        if name not in stages:
            raise DataError(
                f"no finished {name!r} stage", path=layout.stages, hint="run the workflow first"
            )
        result = stages[name]["result"]
        names = {f.name for f in dataclasses.fields(kind)}
        return kind(**{k: v for k, v in result.items() if k in names})

    data = record("source", DatasetRef)
    bc = record("bc", ModelRef)
    augmented = record("rollout", AugmentedRef) if "rollout" in stages else None
    models = [record(name, ModelRef) for name in sorted(stages) if name.startswith("train:")]
    config, seed = DiagnosticsModel(), 0
    if layout.workflow.is_file():
        workflow = load_workflow(layout.workflow)
        config, seed = workflow.diagnostics, workflow.seed
    result = run_diagnostics(
        data,
        augmented,
        bc,
        models,
        config,
        str(layout.root / "diagnostics.json"),
        seed,
        settings=settings,
    )
    metrics = json.loads(layout.metrics.read_text()) if layout.metrics.is_file() else {}
    metrics["diagnostics"] = result
    write_json_atomic(layout.metrics, metrics)
    return result


__all__ = [
    "QUANTILE_LEVELS",
    "ActionSpace",
    "BehaviourModel",
    "DiagnosticsSettings",
    "Episode",
    "complete_returns",
    "data_section",
    "data_summary",
    "diagnose_policy",
    "diagnose_run",
    "discounted_returns",
    "effective_sample_size",
    "effective_sample_size_from_logs",
    "episode_log_weights",
    "episode_records",
    "episode_returns",
    "evaluate_checkpoint",
    "fitted_q_evaluation",
    "importance_weight_diagnostics",
    "jsonable",
    "knn_distances",
    "policy_divergence",
    "random_action_gap",
    "range_violations",
    "rank_checkpoints",
    "rank_results",
    "run_diagnostics",
    "run_episodes",
    "sample_episodes",
    "state_coverage",
    "steps_to_end",
    "target_log_ratio",
    "value_gap",
    "weight_summary",
    "weighted_per_decision_is",
]
