"""Uniform minibatches from one or many transition sets, with a mixing ratio and weights.

The sampler reads straight from memory-mapped shards: each batch is one fancy-index gather per
column, so only the sampled rows are touched and nothing is loaded up front. Batches are numpy
arrays; the learners' floor (``offaug.algorithms.batch``) converts them for training.

Weights are normalised within each source: the ``n_s`` rows a batch holds from set ``s`` get
``w_i * n_s / sum_{j in s} w_j`` (:func:`normalise_source`), so a loss averaged as
``mean(w * l)`` over the batch is ``sum_s (n_s / B) * sum_{i in s} w_i l_i / sum_{i in s} w_i``:
every source enters with exactly its mixing share, and clipping or a heavy tail changes how a
source's rows share its weight, never how much weight the source holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.errors import DataError
from offaug.datasets.shards import ShardSet
from offaug.datasets.transitions import Transitions

_BATCH_COLUMNS = (
    "observations",
    "actions",
    "rewards",
    "next_observations",
    "terminals",
    "timeouts",
)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A minibatch of ``B`` transitions as numpy arrays (dtypes as in :class:`Transitions`)."""

    observations: npt.NDArray[Any]  # (B, *obs)
    actions: npt.NDArray[Any]  # (B, *act)
    rewards: npt.NDArray[np.float32]  # (B,)
    next_observations: npt.NDArray[Any]  # (B, *obs)
    terminals: npt.NDArray[np.bool_]  # (B,)
    timeouts: npt.NDArray[np.bool_]  # (B,)
    weights: npt.NDArray[np.float32]  # (B,) per-sample loss weights (1 when unweighted)
    set_index: npt.NDArray[np.int8]  # (B,) which of the sampler's sets each row came from
    rollout_log_prob: npt.NDArray[np.float32] | None = None
    """(B,) log mu(a|s) of the rollout policy, NaN on rows of sets without the column; only
    when the sampler was asked for it (``rollout_log_prob=True``)."""
    # (B, *act) the dataset's action at next_observations (see MixtureSampler), when asked for
    next_actions: npt.NDArray[Any] | None = None

    def __len__(self) -> int:
        return int(self.rewards.shape[0])


class _Pool:
    """The rows of one transition set, possibly spread over several shards."""

    def __init__(
        self,
        parts: Sequence[Transitions],
        use_weights: bool,
        log_probs: bool = False,
        next_actions: bool = False,
    ) -> None:
        self.next_actions = next_actions
        self.parts = [p for p in parts if len(p)]
        if not self.parts:
            raise DataError("a transition set to sample from is empty")
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        self.rows = int(self.offsets[-1])
        self.weighted = use_weights and self._all_or_none("importance_weight")
        self.log_probs = log_probs
        self.has_log_probs = log_probs and self._all_or_none("rollout_log_prob")
        # Each row's successor (its own index where it has none), found once rather than per
        # batch: comparing the gathered rows' states every step cost ReBRAC a sizeable share
        # of the sampler's time.
        self.successors = [_successors(p) for p in self.parts] if next_actions else []

    def _all_or_none(self, column: str) -> bool:
        """Whether every part has ``column``; refuses a set where only some parts have it."""
        present = [getattr(p, column) is not None for p in self.parts]
        if any(present) and not all(present):
            raise DataError(f"some shards of a set have {column} and some do not", field=column)
        return all(present)

    def gather(self, index: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        if len(self.parts) == 1:
            return self._gather_part(0, index)
        which = np.searchsorted(self.offsets, index, side="right") - 1
        pieces = [
            self._gather_part(i, index[which == i] - self.offsets[i])
            for i in range(len(self.parts))
            if np.any(which == i)
        ]
        return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}

    def _gather_part(self, number: int, index: npt.NDArray[np.int64]) -> dict[str, Any]:
        part = self.parts[number]
        out = {name: np.take(getattr(part, name), index, axis=0) for name in _BATCH_COLUMNS}
        if self.next_actions:
            successor = np.take(self.successors[number], index)
            out["next_actions"] = np.take(part.actions, successor, axis=0)
        if self.weighted:
            assert part.importance_weight is not None
            out["weights"] = np.take(part.importance_weight, index)
        else:
            out["weights"] = np.ones(len(index), dtype=np.float32)
        if self.has_log_probs:
            assert part.rollout_log_prob is not None
            out["rollout_log_prob"] = np.take(part.rollout_log_prob, index)
        elif self.log_probs:
            out["rollout_log_prob"] = np.full(len(index), np.nan, dtype=np.float32)
        return out


def _successors(part: Transitions) -> npt.NDArray[np.int64]:
    """Row ``i + 1`` where it follows row ``i``, else ``i``: ``(N,)``.

    Row i + 1 follows row i when it is in the same episode and starts where row i ends; an
    episode's last row has no successor (its next dataset action is its own).
    """
    rows = np.arange(len(part))
    following = np.zeros(len(part), dtype=bool)
    if len(part) > 1:
        observations = np.asarray(part.observations)
        following[:-1] = (np.asarray(part.episode_ids)[1:] == np.asarray(part.episode_ids)[:-1]) & (
            (observations[1:] == np.asarray(part.next_observations)[:-1])
            .reshape(len(part) - 1, -1)
            .all(axis=1)
        )
    return np.where(following, rows + 1, rows)


def _as_parts(source: Transitions | ShardSet, verify: bool) -> list[Transitions]:
    if isinstance(source, ShardSet):
        return list(source.iter_shards(verify=verify))
    return [source]


class MixtureSampler:
    """Draw uniform minibatches from several transition sets mixed in fixed proportions.

    With sets ``[original, augmented]`` and ``mixing=[0.5, 0.5]`` every batch holds half rows
    from each set (largest-remainder rounding), uniformly with replacement inside a set.
    ``use_weights`` reads each set's ``importance_weight`` column into ``Batch.weights``
    (sets without the column get weight 1), normalised within each source unless
    ``normalise_weights`` is False (then the stored values, as they are). ``rollout_log_prob``
    also gathers that column (``Batch.rollout_log_prob``), for weights computed in training.
    ``next_actions`` also gathers each row's successor action, the dataset's action at
    ``next_observations`` (ReBRAC's critic penalty): the next row's action inside the same
    episode; an episode's last row has none recorded and repeats its own (a terminal row is
    never bootstrapped, so only timeouts see the stand-in).
    """

    def __init__(
        self,
        sets: Sequence[Transitions | ShardSet],
        batch_size: int,
        *,
        mixing: Sequence[float] | None = None,
        use_weights: bool = False,
        normalise_weights: bool = True,
        rollout_log_prob: bool = False,
        seed: int = 0,
        verify: bool = True,
        next_actions: bool = False,
    ) -> None:
        if batch_size <= 0:
            raise DataError("must be positive", field=f"batch_size={batch_size}")
        if not sets:
            raise DataError("no transition sets to sample from")
        self.pools = [
            _Pool(_as_parts(s, verify), use_weights, rollout_log_prob, next_actions) for s in sets
        ]
        shapes = {tuple(p.parts[0].observations.shape[1:]) for p in self.pools}
        if len(shapes) != 1:
            raise DataError(f"sets have different observation shapes {sorted(shapes)}")
        if mixing is None:
            mixing = [p.rows for p in self.pools]  # proportional to size: plain uniform
        ratios = np.asarray(mixing, dtype=np.float64)
        if ratios.shape != (len(self.pools),) or np.any(ratios < 0) or ratios.sum() <= 0:
            raise DataError(
                f"needs one non-negative number per set ({len(self.pools)}), not all zero",
                field=f"mixing={list(mixing)}",
            )
        self.batch_size = batch_size
        self.counts = _apportion(ratios / ratios.sum(), batch_size)
        self.normalise_weights = normalise_weights
        self._rng = np.random.default_rng(seed)

    def sample(self) -> Batch:
        """One minibatch of ``batch_size`` rows."""
        pieces = []
        for set_id, (pool, count) in enumerate(zip(self.pools, self.counts, strict=True)):
            if count == 0:
                continue
            # Sorted indices walk each memory map forward, which pages in far less often.
            index = np.sort(self._rng.integers(0, pool.rows, size=count))
            data = pool.gather(index)
            if pool.weighted and self.normalise_weights:
                data["weights"] = normalise_source(data["weights"])
            data["set_index"] = np.full(count, set_id, dtype=np.int8)
            pieces.append(data)
        if len(pieces) == 1:
            return Batch(**pieces[0])
        return Batch(**{k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]})

    @property
    def weighted_sets(self) -> list[bool]:
        """Per set: whether its rows carry importance weights in ``Batch.weights``."""
        return [pool.weighted for pool in self.pools]

    @property
    def sets_with_log_probs(self) -> list[bool]:
        """Per set: whether it has a ``rollout_log_prob`` column (when asked to gather it)."""
        return [pool.has_log_probs for pool in self.pools]

    def rng_state(self) -> dict[str, Any]:
        """The random generator's state (JSON-ready), for exact resumption."""
        return dict(self._rng.bit_generator.state)

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`rng_state`."""
        self._rng.bit_generator.state = state


def sample_stacked(samplers: Sequence[MixtureSampler]) -> Batch:
    """Each sampler's next batch, stacked along a leading member axis: fields ``(K, B, ...)``.

    Member ``k``'s rows are exactly those ``samplers[k].sample()`` would draw (its own
    generator, advanced as that call advances it). When the samplers draw alike from the same
    single-part sets (the members of a fused run on one dataset), every column is gathered once
    for all members instead of once per member, then split: the per-column gathers and the
    stacking copies were most of a fused step's sampling cost. Otherwise each samples alone.
    """
    first = samplers[0]
    if not all(_draws_alike(first, other) for other in samplers[1:]):
        return stack_numpy([s.sample() for s in samplers])
    members = len(samplers)
    pieces = []
    for set_id, (pool, count) in enumerate(zip(first.pools, first.counts, strict=True)):
        if count == 0:
            continue
        index = np.concatenate(
            [np.sort(s._rng.integers(0, pool.rows, size=count)) for s in samplers]
        )
        data = {
            name: column.reshape(members, count, *column.shape[1:])
            for name, column in pool.gather(index).items()
        }
        if pool.weighted and first.normalise_weights:
            data["weights"] = np.stack([normalise_source(w) for w in data["weights"]])
        data["set_index"] = np.full((members, count), set_id, dtype=np.int8)
        pieces.append(data)
    if len(pieces) == 1:
        return Batch(**pieces[0])
    return Batch(**{k: np.concatenate([p[k] for p in pieces], axis=1) for k in pieces[0]})


def _draws_alike(a: MixtureSampler, b: MixtureSampler) -> bool:
    """Whether ``a`` and ``b`` gather the same columns from the same single-part sets."""
    return (
        a.counts == b.counts
        and a.normalise_weights == b.normalise_weights
        and len(a.pools) == len(b.pools)
        and all(
            len(p.parts) == 1
            and len(q.parts) == 1
            and p.parts[0] is q.parts[0]
            and (p.weighted, p.log_probs, p.has_log_probs, p.next_actions)
            == (q.weighted, q.log_probs, q.has_log_probs, q.next_actions)
            for p, q in zip(a.pools, b.pools, strict=True)
        )
    )


def stack_numpy(batches: Sequence[Batch]) -> Batch:
    """Batches stacked along a leading member axis, before they become tensors."""
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(Batch):
        values = [getattr(b, field.name) for b in batches]
        fields[field.name] = None if values[0] is None else np.stack(values)
    return Batch(**fields)


def normalise_source(weights: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """One source's rows of a batch rescaled to mean 1: ``w * n / sum(w)``.

    A source whose rows all weigh 0 keeps them at 0 (it contributes nothing to this batch)
    rather than dividing by zero.
    """
    total = float(weights.sum(dtype=np.float64))
    if total <= 0.0:
        return np.zeros_like(weights)
    return weights * np.float32(len(weights) / total)


def _apportion(fractions: npt.NDArray[np.float64], total: int) -> list[int]:
    """Split ``total`` into integer counts proportional to ``fractions`` (largest remainder)."""
    exact = fractions * total
    counts = np.floor(exact).astype(np.int64)
    remainder = total - int(counts.sum())
    if remainder:
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:remainder]] += 1
    return [int(c) for c in counts]


def batch_shares(mixing: Sequence[float], rows: Sequence[int] | None = None) -> tuple[float, ...]:
    """The share of a batch each set gets: ``mixing`` normalised to sum to 1, and with ``rows``
    (each set's row count) every set after the first capped at its share of all the rows, the
    excess going to the first (the original data).

    The cap is for sets of uncertain size, such as filtered rollouts: 300 kept rows under a
    stated share of 0.5 would be repeated in half of every batch; capped, they fill what they
    hold of the pooled rows, as uniform sampling over the union would give them.
    """
    shares = np.asarray(mixing, dtype=np.float64)
    if shares.ndim != 1 or len(shares) == 0 or np.any(shares < 0) or shares.sum() <= 0:
        raise DataError("needs non-negative shares, not all zero", field=f"mixing={list(mixing)}")
    shares = shares / shares.sum()
    if rows is not None:
        counts = np.asarray(rows, dtype=np.float64)
        if counts.shape != shares.shape or np.any(counts < 0) or counts.sum() <= 0:
            raise DataError(
                f"needs one non-negative row count per share ({len(shares)}), not all zero",
                field=f"rows={list(rows)}",
            )
        capped = np.minimum(shares[1:], counts[1:] / counts.sum())
        shares = np.concatenate([[1.0 - capped.sum()], capped])
    return tuple(float(s) for s in shares)
