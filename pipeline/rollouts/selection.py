"""Which finished episodes of a simulator rollout stay: the filter's verdict, then best of K.

A rollout's episodes are judged once all are done (:func:`select_episodes`):

* ``filter: data`` keeps what earns at least the data from the same start
  (:class:`~offaug.pipeline.rollouts.data.EpisodeFilter`);
* ``filter: value`` a branch whose value-bootstrapped return beats the data's return-to-go
  from its start row (:class:`~offaug.pipeline.rollouts.references.ValueFilter`);
* ``filter: policy`` an episode whose return beats the noiseless policy's from the same start.
  The references are rolled out after the noisy episodes (one per start), or, with
  ``keep_reference``, they are the first try of each start, rolled out without noise among the
  others and kept themselves where no noisy try beats them;
* with ``tries`` K, of the kept episodes of one start (reset seed and dataset row) only the one
  of highest return stays (:func:`best_of_starts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.pipeline.contracts import FilterRecord
from offaug.pipeline.rollouts.config import RolloutConfig
from offaug.pipeline.rollouts.data import EpisodeFilter
from offaug.pipeline.rollouts.references import ValueFilter, beats, reference_returns

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
RollReferences = Callable[[IntArray, IntArray], tuple[FloatArray, int]]
"""``(reset_seeds, start_rows) -> (returns, env steps)``: the noiseless policy rolled out from
each episode's start (:func:`offaug.pipeline.rollouts.references.noiseless_returns`)."""


@dataclasses.dataclass(frozen=True)
class FinishedEpisodes:
    """A rollout's finished episodes, as the filters read them (rows: steps, in episode order)."""

    returns: FloatArray
    """(episodes,) undiscounted returns."""
    lengths: IntArray
    """(episodes,) steps per episode."""
    start_rows: IntArray
    """(episodes,) the dataset row each branched from (negative: a reset)."""
    reset_seeds: IntArray
    """(episodes,) the ``env.reset`` seed of each."""
    rewards: npt.NDArray[Any]
    """(rows,) every step's reward."""
    next_observations: npt.NDArray[np.float32]
    """(rows, obs) every step's next observation."""
    terminals: npt.NDArray[np.bool_]
    """(rows,) every step's termination flag."""
    noiseless: npt.NDArray[np.bool_]
    """(episodes,) which episodes are ``keep_reference``'s noiseless references."""


@dataclasses.dataclass(frozen=True)
class Selection:
    """What :func:`select_episodes` decided."""

    keep: npt.NDArray[np.bool_]
    """(episodes,) which episodes stay."""
    record: FilterRecord | None
    """Every episode's score and reference under ``filter: policy`` or ``value`` (else None)."""
    reference_steps: int
    """Environment steps spent rolling references out after the noisy episodes."""


def select_episodes(
    episodes: FinishedEpisodes,
    config: RolloutConfig,
    episode_filter: EpisodeFilter | ValueFilter | None,
    roll_references: RollReferences,
) -> Selection:
    """The filter's verdict on ``episodes``, then the best of each start's tries."""
    keep = np.ones(len(episodes.lengths), dtype=bool)
    record, reference_steps = None, 0
    if config.filter != "none":
        keep, record, reference_steps = _judge(episodes, config, episode_filter, roll_references)
    if config.tries > 1:
        keep &= best_of_starts(episodes.returns, keep, episodes.reset_seeds, episodes.start_rows)
        if record is not None:
            record = dataclasses.replace(record, kept=tuple(keep.tolist()))
    return Selection(keep, record, reference_steps)


def _judge(
    episodes: FinishedEpisodes,
    config: RolloutConfig,
    episode_filter: EpisodeFilter | ValueFilter | None,
    roll_references: RollReferences,
) -> tuple[npt.NDArray[np.bool_], FilterRecord | None, int]:
    """Which episodes the filter keeps, what it compared (None for ``data``) and the steps its
    references took."""
    ends = np.cumsum(episodes.lengths) - 1
    terminated = np.asarray(episodes.terminals, dtype=bool)[ends]
    start_rows, reset_seeds = episodes.start_rows, episodes.reset_seeds
    if isinstance(episode_filter, EpisodeFilter):
        kept = episode_filter.keep(episodes.returns, episodes.lengths, start_rows, terminated)
        return kept, None, 0
    reference_steps = 0
    scores = episodes.returns
    if isinstance(episode_filter, ValueFilter):
        scores = episode_filter.scores(
            episodes.rewards, episodes.lengths, episodes.next_observations[ends], terminated
        )
        references = episode_filter.references(start_rows)
    elif config.keep_reference:
        # The references are the first tries themselves, already rolled out and counted.
        references = reference_returns(
            episodes.returns, episodes.noiseless, reset_seeds, start_rows
        )
    else:
        references, reference_steps = roll_references(reset_seeds, start_rows)
    keep = beats(
        scores, references, episodes.lengths, config.filter_margin, config.filter_tolerance
    )
    if config.keep_reference:
        # A reference stays where no noisy try beats it (best_of_starts picks the best).
        keep |= episodes.noiseless & np.isfinite(references)
    record = FilterRecord(
        scores=tuple(scores.tolist()),
        references=tuple(references.tolist()),
        kept=tuple(keep.tolist()),
        reset_seeds=tuple(reset_seeds.tolist()),
        start_rows=tuple(start_rows.tolist()),
    )
    return keep, record, reference_steps


def best_of_starts(
    returns: FloatArray, keep: npt.NDArray[np.bool_], reset_seeds: IntArray, start_rows: IntArray
) -> npt.NDArray[np.bool_]:
    """(episodes,) bool: per start (reset seed and start row), the first kept episode of
    highest return; a start with none kept has none."""
    best: dict[tuple[int, int], int] = {}
    for index in np.flatnonzero(keep):
        key = (int(reset_seeds[index]), int(start_rows[index]))
        if key not in best or returns[index] > returns[best[key]]:
            best[key] = int(index)
    chosen = np.zeros(len(returns), dtype=bool)
    chosen[list(best.values())] = True
    return chosen
