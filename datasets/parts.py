"""What is being published: the parts, their info columns, their pieces and statistics.

A *part* is one :class:`Transitions` (in memory) or :class:`ShardSet` (read shard by shard,
checksums verified). :func:`describe_part` records what is known of a part before its rows
are read; :func:`info_columns` chooses the per-step columns written as step infos (the
optional contract columns any part carries, then the ``infos/KEY`` extras every part shares);
:func:`chunks` cuts a part into whole-episode pieces of bounded size; :class:`PartStats`
and :class:`WeightStats` count what was written, for the metadata and the card.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from offaug.datasets.errors import DataError
from offaug.datasets.layout import EXTRA_INFO_PREFIX, InfoColumn, Spaces
from offaug.datasets.shards import ShardSet
from offaug.datasets.transitions import OPTIONAL_FIELDS, Transitions
from offaug.datasets.weights import effective_sample_size_from_sums

logger = logging.getLogger(__name__)

Part = Transitions | ShardSet

CHUNK_ROWS = 262_144
"""Rows of a part handled at once: bounds the staging copies for huge parts."""
# What a part without one of the optional columns gets in its rows.
_MISSING_FILL: dict[str, float | int] = {
    "rollout_log_prob": math.nan,
    "behaviour_log_prob": math.nan,
    "importance_weight": 1.0,
    "source": -1,
}
# The contract's dtypes of those columns (see transitions.py).
_OPTIONAL_DTYPES: dict[str, np.dtype[Any]] = {
    "rollout_log_prob": np.dtype(np.float32),
    "behaviour_log_prob": np.dtype(np.float32),
    "importance_weight": np.dtype(np.float32),
    "source": np.dtype(np.int8),
}


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """What is known about a part before its rows are read."""

    index: int
    kind: Literal["transitions", "shard_set"]
    rows: int
    episodes: int
    columns: tuple[str, ...]
    """Present optional contract columns."""
    extras: tuple[str, ...]
    meta: Mapping[str, Any]
    description: dict[str, Any]


def describe_part(index: int, part: Part) -> PartInfo:
    if isinstance(part, Transitions):
        columns = tuple(name for name in OPTIONAL_FIELDS if getattr(part, name) is not None)
        return PartInfo(
            index=index,
            kind="transitions",
            rows=len(part),
            episodes=part.num_episodes,
            columns=columns,
            extras=tuple(part.extras),
            meta=part.meta,
            description={
                "kind": "transitions",
                "dataset_id": part.meta.get("dataset_id"),
                "format": part.meta.get("format"),
            },
        )
    if isinstance(part, ShardSet):
        present = set(itertools.chain.from_iterable(ref.columns for ref in part.shards))
        columns = tuple(name for name in OPTIONAL_FIELDS if name in present)
        extras = []
        for ref in part.shards[:1]:
            extras = [c.removeprefix("extra:") for c in ref.columns if c.startswith("extra:")]
        return PartInfo(
            index=index,
            kind="shard_set",
            rows=part.rows,
            episodes=part.episodes,
            columns=columns,
            extras=tuple(extras),
            meta=part.meta,
            description={
                "kind": "shard_set",
                "directory": part.directory,
                "source": dict(part.source),
                "params": dict(part.params),
            },
        )
    raise DataError(
        f"part {index} is a {type(part).__name__}; expected Transitions or ShardSet",
        field=f"parts[{index}]",
    )


def info_columns(infos: Sequence[PartInfo]) -> list[InfoColumn]:
    """The union of optional columns, then the extras every part shares, as info columns."""
    columns: list[InfoColumn] = []
    present = {name for info in infos for name in info.columns}
    for name in OPTIONAL_FIELDS:
        if name in present:
            columns.append(InfoColumn(name, name, _OPTIONAL_DTYPES[name], (), _MISSING_FILL[name]))
    # Extras are published when every part has them and they are named infos/KEY; others
    # (derived columns such as a rollout's per-decision weights, which can be recomputed
    # from the published log-probabilities) are left out by design, so the note is a debug
    # line, not a warning on the user's console; what was written is in the published
    # metadata (``offaug.info_columns``).
    shared = [name for name in infos[0].extras if all(name in info.extras for info in infos)]
    skipped = sorted({n for info in infos for n in info.extras} - set(shared))
    taken = {c.key for c in columns}
    extras = []
    for name in shared:
        key = name.removeprefix(EXTRA_INFO_PREFIX)
        if not name.startswith(EXTRA_INFO_PREFIX) or not key or "/" in key or key in taken:
            skipped.append(name)
            continue
        extras.append(name)
    if skipped:
        logger.debug(
            "extras not published (not in every part, or not named infos/KEY): %s", skipped
        )
    for name in extras:
        key = name.removeprefix(EXTRA_INFO_PREFIX)
        taken.add(key)
        # Shapes and dtypes come from the first chunk; later chunks are checked against them.
        columns.append(InfoColumn(key, name, np.dtype(np.float64), (), None))
    return columns


def settle_extras(columns: list[InfoColumn], chunk: Transitions) -> list[InfoColumn]:
    settled = []
    for column in columns:
        if column.missing_fill is None:
            values = chunk.extras[column.column]
            column = dataclasses.replace(
                column, dtype=values.dtype, row_shape=tuple(values.shape[1:])
            )
        settled.append(column)
    return settled


def chunks(part: Part) -> Iterator[Transitions]:
    """A part as whole-episode pieces of bounded size."""
    pieces = part.iter_shards(verify=True) if isinstance(part, ShardSet) else [part]
    for piece in pieces:
        bounds = piece.episode_bounds()
        cut = 0
        for bound in bounds[1:]:
            if bound - cut >= CHUNK_ROWS or bound == len(piece):
                yield piece.slice(cut, int(bound))
                cut = int(bound)


@dataclasses.dataclass
class WeightStats:
    """Running sums for the effective sample size of importance weights."""

    rows: int = 0
    total: float = 0.0
    total_squared: float = 0.0
    minimum: float = math.inf
    maximum: float = -math.inf

    def add(self, weights: npt.NDArray[np.float32]) -> None:
        if weights.size == 0:
            return
        as_float = weights.astype(np.float64)
        self.rows += int(as_float.size)
        self.total += float(as_float.sum())
        self.total_squared += float(np.square(as_float).sum())
        self.minimum = min(self.minimum, float(as_float.min()))
        self.maximum = max(self.maximum, float(as_float.max()))

    def summary(self) -> dict[str, Any] | None:
        """ESS = (Σw)² / Σw², and ESS / N, or None without weights."""
        if self.rows == 0:
            return None
        ess = effective_sample_size_from_sums(self.total, self.total_squared)
        return {
            "rows": self.rows,
            "sum": self.total,
            "mean": self.total / self.rows,
            "min": self.minimum,
            "max": self.maximum,
            "effective_sample_size": ess,
            "ess_fraction": ess / self.rows,
        }


@dataclasses.dataclass
class PartStats:
    rows: int = 0
    episodes: int = 0
    returns_sum: float = 0.0
    sources: dict[int, int] = dataclasses.field(default_factory=dict)
    weights: WeightStats = dataclasses.field(default_factory=WeightStats)

    def add(self, chunk: Transitions) -> None:
        self.rows += len(chunk)
        self.episodes += chunk.num_episodes
        self.returns_sum += float(chunk.rewards.astype(np.float64).sum())
        if chunk.source is not None:
            codes, counts = np.unique(chunk.source, return_counts=True)
            for code, count in zip(codes.tolist(), counts.tolist(), strict=True):
                self.sources[code] = self.sources.get(code, 0) + count
        if chunk.importance_weight is not None:
            self.weights.add(chunk.importance_weight)


def stored_bytes(infos: Sequence[PartInfo], spaces: Spaces, columns: Sequence[InfoColumn]) -> int:
    """Bytes of every stored step array (N steps, N + 1 observations per episode)."""
    rows = sum(info.rows for info in infos)
    episodes = sum(info.episodes for info in infos)
    observation = sum(leaf.width * leaf.dtype.itemsize for leaf in spaces.leaves)
    action = int(np.prod(spaces.action_shape, dtype=np.int64)) * spaces.action_dtype.itemsize
    info = sum(int(np.prod(c.row_shape, dtype=np.int64)) * c.dtype.itemsize for c in columns)
    # rewards float64, terminations and truncations one byte each
    return (rows + episodes) * (observation + info) + rows * (action + 8 + 2)
