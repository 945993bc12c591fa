"""Minibatches drawn on the device: the graph-safe counterpart of ``MixtureSampler``.

:class:`DeviceSampler` holds every column of every source as one tensor on the training device
(sources end to end) and draws each member's rows from that member's own torch generator, so a
batch is a handful of kernels with no host work: what a captured CUDA graph can replay. It draws
as :class:`~offaug.datasets.sampler.MixtureSampler` does, not the same rows: each source holds
its fixed share of every batch (the sampler's largest-remainder counts), rows are uniform with
replacement inside a source, and importance weights are normalised within each source's rows
(:func:`~offaug.datasets.sampler.normalise_source`). Batches come out ``(K, B, ...)``, member
``k``'s in row ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from offaug.datasets.sampler import MixtureSampler, _draws_alike, _Pool, _successors

_COLUMNS = ("observations", "actions", "rewards", "next_observations", "terminals", "timeouts")


class DeviceSampler:
    """Each member's minibatches, drawn on ``device`` from its own generator.

    Args:
        samplers: The members' numpy samplers (their sets, shares and columns; they must draw
            alike, from the same single-part sets); their own generators are not used.
        generators: One torch generator per member, on ``device``.
        device: Where the data lives and the draws happen.
        with_sources: Also give each row's source (``set_index``).
    """

    def __init__(
        self,
        samplers: Sequence[MixtureSampler],
        generators: Sequence[torch.Generator],
        device: torch.device,
        *,
        with_sources: bool = False,
    ) -> None:
        first = samplers[0]
        if len(samplers) != len(generators):
            raise ValueError("one generator per sampler")
        if not all(_draws_alike(first, other) for other in samplers[1:]):
            raise ValueError("the device sampler needs members that draw alike from one dataset")
        if any(pool.log_probs for pool in first.pools):
            raise ValueError("the device sampler does not gather rollout_log_prob")
        self.device = device
        self.generators = list(generators)
        self.batch_size = first.batch_size
        self.counts = list(first.counts)
        self.normalise_weights = first.normalise_weights
        self.with_sources = with_sources
        self.next_actions = bool(first.pools[0].next_actions)
        tables = [_pool_columns(pool, self.next_actions) for pool in first.pools]
        rows = [pool.rows for pool in first.pools]
        offsets = np.cumsum([0, *rows])[:-1]
        self.weighted = [
            pool.weighted and count > 0
            for pool, count in zip(first.pools, self.counts, strict=True)
        ]
        columns = {name: np.concatenate([t[name] for t in tables]) for name in tables[0]}
        if self.next_actions:
            # Successor rows are local to each source: shift them to the joined table.
            columns["successor"] = np.concatenate(
                [t["successor"] + o for t, o in zip(tables, offsets, strict=True)]
            )
        self.columns = {name: torch.as_tensor(c).to(device) for name, c in columns.items()}
        # Per batch column: its source, the source's first row and its row count.
        source = np.repeat(np.arange(len(rows)), self.counts)
        self.set_index = torch.as_tensor(source, dtype=torch.int64, device=device)
        self._first_row = torch.as_tensor(offsets[source], dtype=torch.int64, device=device)
        self._rows = torch.as_tensor(np.asarray(rows)[source], dtype=torch.float64, device=device)
        ends = np.cumsum(self.counts)
        self._blocks = [
            (slice(int(end - count), int(end)), count)
            for end, count in zip(ends, self.counts, strict=True)
        ]

    @property
    def members(self) -> int:
        return len(self.generators)

    def indices(self) -> torch.Tensor:
        """Each member's rows of one batch, ``(K, B)`` int64 into the joined table."""
        uniform = torch.stack(
            [
                torch.rand(self.batch_size, generator=g, device=self.device, dtype=torch.float64)
                for g in self.generators
            ]
        )
        local = (uniform * self._rows).long().clamp_max((self._rows - 1).long())
        return self._first_row + local

    def sample(self) -> dict[str, torch.Tensor]:
        """One batch of every member as :class:`~offaug.algorithms.batch.TorchBatch` fields."""
        index = self.indices()
        fields = {name: self.columns[name][index] for name in _COLUMNS}
        if self.next_actions:
            fields["next_actions"] = self.columns["actions"][self.columns["successor"][index]]
        weights = self.columns["weights"][index]
        if self.normalise_weights and any(self.weighted):
            parts = []
            for (block, count), weighted in zip(self._blocks, self.weighted, strict=True):
                part = weights[:, block]
                if weighted:
                    total = part.sum(-1, keepdim=True)
                    part = torch.where(total > 0, part * count / total.clamp_min(1e-30), 0.0)
                parts.append(part)
            weights = torch.cat(parts, dim=1)
        fields["weights"] = weights
        if self.with_sources:
            fields["set_index"] = self.set_index.expand(self.members, -1)
        return fields


def _pool_columns(pool: _Pool, next_actions: bool) -> dict[str, Any]:
    """A source's columns as whole arrays (its parts end to end), flags as float32."""
    columns: dict[str, Any] = {}
    for name in _COLUMNS:
        joined = np.concatenate([np.asarray(getattr(p, name)) for p in pool.parts])
        columns[name] = joined.astype(np.float32) if joined.dtype == np.bool_ else joined
    if pool.weighted:
        columns["weights"] = np.concatenate(
            [np.asarray(p.importance_weight, dtype=np.float32) for p in pool.parts]
        )
    else:
        columns["weights"] = np.ones(pool.rows, dtype=np.float32)
    if next_actions:
        if len(pool.parts) != 1:
            raise ValueError("the device sampler reads next actions of single-part sets only")
        columns["successor"] = _successors(pool.parts[0])
    return columns
