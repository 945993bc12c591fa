"""Uniform minibatches from one or many transition sets, with a mixing ratio and weights.

The sampler reads straight from memory-mapped shards: each batch is one fancy-index gather per
column, so only the sampled rows are touched and nothing is loaded up front. Batches are numpy
arrays; the learners' floor (``offaug.algorithms.batch``) converts them for training.
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
    # (B, *act) the dataset's action at next_observations (see MixtureSampler), when asked for
    next_actions: npt.NDArray[Any] | None = None

    def __len__(self) -> int:
        return int(self.rewards.shape[0])


class _Pool:
    """The rows of one transition set, possibly spread over several shards."""

    def __init__(
        self, parts: Sequence[Transitions], use_weights: bool, next_actions: bool = False
    ) -> None:
        self.next_actions = next_actions
        self.parts = [p for p in parts if len(p)]
        if not self.parts:
            raise DataError("a transition set to sample from is empty")
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        self.rows = int(self.offsets[-1])
        has_weights = [p.importance_weight is not None for p in self.parts]
        if use_weights and not all(has_weights) and any(has_weights):
            raise DataError(
                "some shards of a set have importance weights and some do not",
                field="importance_weight",
            )
        self.weighted = use_weights and all(has_weights)

    def gather(self, index: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        if len(self.parts) == 1:
            return self._gather_part(self.parts[0], index)
        which = np.searchsorted(self.offsets, index, side="right") - 1
        pieces = [
            self._gather_part(part, index[which == i] - self.offsets[i])
            for i, part in enumerate(self.parts)
            if np.any(which == i)
        ]
        return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}

    def _gather_part(self, part: Transitions, index: npt.NDArray[np.int64]) -> dict[str, Any]:
        out = {name: np.take(getattr(part, name), index, axis=0) for name in _BATCH_COLUMNS}
        if self.next_actions:
            # Row i + 1 follows row i when it is in the same episode and starts where row i
            # ends; an episode's last row has no successor and keeps its own action.
            successor = np.minimum(index + 1, len(part) - 1)
            starts = np.take(part.observations, successor, axis=0)
            same = (
                (successor != index)
                & (np.take(part.episode_ids, successor) == np.take(part.episode_ids, index))
                & np.all((starts == out["next_observations"]).reshape(len(index), -1), axis=1)
            )
            following = np.take(part.actions, successor, axis=0)
            same = same.reshape(-1, *([1] * (following.ndim - 1)))
            out["next_actions"] = np.where(same, following, out["actions"])
        if self.weighted:
            assert part.importance_weight is not None
            out["weights"] = np.take(part.importance_weight, index)
        else:
            out["weights"] = np.ones(len(index), dtype=np.float32)
        return out


def _as_parts(source: Transitions | ShardSet, verify: bool) -> list[Transitions]:
    if isinstance(source, ShardSet):
        return list(source.iter_shards(verify=verify))
    return [source]


class MixtureSampler:
    """Draw uniform minibatches from several transition sets mixed in fixed proportions.

    With sets ``[original, augmented]`` and ``mixing=[0.5, 0.5]`` every batch holds half rows
    from each set (largest-remainder rounding), uniformly with replacement inside a set.
    ``use_weights`` reads each set's ``importance_weight`` column into ``Batch.weights``
    (sets without the column get weight 1). ``next_actions`` also gathers each row's
    successor action, the dataset's action at ``next_observations`` (ReBRAC's critic penalty):
    the next row's action inside the same episode; an episode's last row has none recorded and
    repeats its own (a terminal row is never bootstrapped, so only timeouts see the stand-in).
    """

    def __init__(
        self,
        sets: Sequence[Transitions | ShardSet],
        batch_size: int,
        *,
        mixing: Sequence[float] | None = None,
        use_weights: bool = False,
        seed: int = 0,
        verify: bool = True,
        next_actions: bool = False,
    ) -> None:
        if batch_size <= 0:
            raise DataError("must be positive", field=f"batch_size={batch_size}")
        if not sets:
            raise DataError("no transition sets to sample from")
        self.pools = [_Pool(_as_parts(s, verify), use_weights, next_actions) for s in sets]
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
            data["set_index"] = np.full(count, set_id, dtype=np.int8)
            pieces.append(data)
        if len(pieces) == 1:
            return Batch(**pieces[0])
        return Batch(**{k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]})

    def rng_state(self) -> dict[str, Any]:
        """The random generator's state (JSON-ready), for exact resumption."""
        return dict(self._rng.bit_generator.state)

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`rng_state`."""
        self._rng.bit_generator.state = state


def _apportion(fractions: npt.NDArray[np.float64], total: int) -> list[int]:
    """Split ``total`` into integer counts proportional to ``fractions`` (largest remainder)."""
    exact = fractions * total
    counts = np.floor(exact).astype(np.int64)
    remainder = total - int(counts.sum())
    if remainder:
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:remainder]] += 1
    return [int(c) for c in counts]
