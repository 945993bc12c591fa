"""The dataset doctor's episode checks: terminations against time-outs, next observations that
jump inside an episode, and episodes stored twice."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import numpy.typing as npt

from offaug.datasets.doctor.checks import Prepared
from offaug.datasets.doctor.findings import Finding
from offaug.datasets.transitions import Source, Transitions

_ROWS_PER_BLOCK = 1 << 18  # rows compared at once by the next-observation check


def episode_flags(prep: Prepared) -> list[Finding]:
    """Done flags in mid-episode, unflagged episode ends, and rows flagged both ways."""
    data = prep.data
    done = data.terminals | data.timeouts
    done_mid = done.copy()
    done_mid[prep.last_rows] = False
    unflagged = ~done[prep.last_rows]
    both = data.terminals & data.timeouts
    findings = []
    if done_mid.any():
        row = int(np.argmax(done_mid))
        findings.append(
            Finding(
                "done-mid-episode",
                "error",
                f"{int(done_mid.sum())} rows are flagged terminal or time-out but are not the "
                f"last of their episode (first: row {row}, episode {int(data.episode_ids[row])})",
                "the environment was not reset after done, or episodes were joined: split "
                "episodes at every done flag",
                {"rows": int(done_mid.sum()), "first_row": row},
            )
        )
    if unflagged.any():
        findings.append(
            Finding(
                "episode-end-unflagged",
                "warning",
                f"{int(unflagged.sum())} of {len(unflagged)} episodes end with neither a "
                "terminal nor a time-out",
                "mark how each episode ended (a cut-off last episode is a time-out); a learner "
                "cannot tell whether to bootstrap there",
                {"episodes": int(unflagged.sum())},
            )
        )
    if both.any():
        findings.append(
            Finding(
                "terminal-and-timeout",
                "warning",
                f"{int(both.sum())} rows are flagged both terminal and time-out",
                "decide which it was: a termination is never bootstrapped, a time-out is",
                {"rows": int(both.sum())},
            )
        )
    return findings


def terminations(prep: Prepared) -> list[Finding]:
    """Terminations against what the env can do, and time-outs against its time limit."""
    data, facts = prep.data, prep.facts
    ended_terminal = data.terminals[prep.last_rows]
    ended_timeout = data.timeouts[prep.last_rows] & ~ended_terminal
    # Model rollouts end at the model horizon, not at the env's time limit.
    from_env = source_rows(data, Source.ORIGINAL, Source.SIMULATOR)[prep.last_rows]
    env_name = facts.env_id or "the environment"
    findings = []
    if facts.can_terminate is True and not data.terminals.any() and len(prep.lengths) > 1:
        findings.append(
            Finding(
                "no-terminals",
                "warning",
                f"{env_name} can terminate (fall, fail, reach a goal) but none of the "
                f"{len(prep.lengths)} episodes does",
                "check that terminations were recorded as terminals, not as time-outs: "
                "otherwise the learner bootstraps through every fall",
                {"episodes": len(prep.lengths), "timeouts": int(data.timeouts.sum())},
            )
        )
    if facts.can_terminate is False and data.terminals.any():
        findings.append(
            Finding(
                "terminals-in-nonterminating-env",
                "warning",
                f"{env_name} never terminates, yet {int(data.terminals.sum())} rows are terminal",
                "these are most likely time-outs recorded as terminals: mark them as "
                "time-outs so that the learner bootstraps through them",
                {"terminals": int(data.terminals.sum())},
            )
        )
    limit = facts.max_episode_steps
    if limit is None:
        return findings
    at_limit = ended_terminal & from_env & (prep.lengths == limit)
    if at_limit.any() and at_limit.sum() * 2 >= ended_terminal.sum():
        findings.append(
            Finding(
                "terminal-at-time-limit",
                "warning",
                f"{int(at_limit.sum())} of {int(ended_terminal.sum())} terminated episodes end "
                f"exactly at the time limit ({limit} steps)",
                "these look like time-outs recorded as terminals: mark them as time-outs",
                {"episodes": int(at_limit.sum()), "time_limit": limit},
            )
        )
    # A reader that drops a time-out's successor-less last row leaves limit - 1 steps.
    lengths = prep.lengths[ended_timeout & from_env]
    off_limit = lengths[(lengths != limit) & (lengths != limit - 1)]
    if len(off_limit):
        findings.append(
            Finding(
                "timeout-not-at-limit",
                "warning",
                f"{len(off_limit)} of {len(lengths)} time-outs come after "
                f"{_length_range(off_limit)} steps, not at the time limit ({limit})",
                "expected when the data was made with another time limit; otherwise these "
                "episodes were cut for another reason (a crash, a fault, a bad split)",
                {
                    "episodes": len(off_limit),
                    "time_limit": limit,
                    "lengths_min": int(off_limit.min()),
                    "lengths_max": int(off_limit.max()),
                    "over_limit": int(np.count_nonzero(off_limit > limit)),
                },
            )
        )
    return findings


def next_observations(prep: Prepared) -> list[Finding]:
    """Inside an episode, ``next_observations[t]`` must equal ``observations[t + 1]``."""
    count, first, largest = next_observation_jumps(prep.data)
    if not count:
        return []
    assert first is not None
    return [
        Finding(
            "next-observation-jump",
            "error",
            f"{count} rows inside an episode have a next observation that is not the "
            f"following row's observation (first: row {first}, episode "
            f"{int(prep.data.episode_ids[first])}; largest difference {largest:.3g})",
            "episodes were joined or the environment was not reset after done: split the "
            "episodes where the observations jump",
            {"rows": count, "first_row": first, "max_difference": largest},
        )
    ]


def duplicated_episodes(prep: Prepared) -> list[Finding]:
    """Episodes whose observations, actions and rewards are identical to an earlier one's."""
    first_seen: dict[bytes, int] = {}
    copies: list[list[int]] = []
    starts = prep.bounds[:-1]
    for index, digest in enumerate(episode_digests(prep.data, prep.bounds)):
        if digest in first_seen:
            original = int(prep.data.episode_ids[starts[first_seen[digest]]])
            copies.append([original, int(prep.data.episode_ids[starts[index]])])
        else:
            first_seen[digest] = index
    if not copies:
        return []
    return [
        Finding(
            "duplicated-episodes",
            "warning",
            f"{len(copies)} episodes repeat an earlier one exactly "
            f"(episode ids {copies[:5]}{' ...' if len(copies) > 5 else ''})",
            "drop the copies (a file written twice, the same seed reused): they weigh those "
            "episodes twice in every batch",
            {"duplicates": len(copies), "pairs": copies[:20]},
        )
    ]


def source_rows(data: Transitions, *sources: Source) -> npt.NDArray[np.bool_]:
    """Rows whose ``source`` is one of ``sources`` (every row when the column is absent)."""
    if data.source is None:
        return np.ones(len(data), dtype=bool)
    return np.isin(data.source, [int(s) for s in sources])


def episode_digests(data: Transitions, bounds: npt.NDArray[np.int64]) -> list[bytes]:
    """A content hash of each episode's observations, actions and rewards."""
    digests = []
    for start, stop in itertools.pairwise(bounds.tolist()):
        digest = hashlib.blake2b(digest_size=16)
        for column in (data.observations, data.actions, data.rewards):
            digest.update(np.ascontiguousarray(column[start:stop]).tobytes())
        digests.append(digest.digest())
    return digests


def next_observation_jumps(data: Transitions) -> tuple[int, int | None, float]:
    """Rows inside an episode whose ``next_observations`` differ from the following row's
    ``observations``: (count, first such row, largest absolute difference)."""
    count, first, largest = 0, None, 0.0
    for start in range(0, max(len(data) - 1, 0), _ROWS_PER_BLOCK):
        stop = min(start + _ROWS_PER_BLOCK, len(data) - 1)
        inside = data.episode_ids[start:stop] == data.episode_ids[start + 1 : stop + 1]
        stored = data.next_observations[start:stop].reshape(stop - start, -1)[inside]
        following = data.observations[start + 1 : stop + 1].reshape(stop - start, -1)[inside]
        if stored.dtype.kind == "f":
            same = np.isclose(stored, following, rtol=1e-5, atol=1e-6, equal_nan=True)
        else:
            same = stored == following
        jumps = ~same.all(axis=1)
        if jumps.any():
            rows = np.flatnonzero(inside)[jumps] + start
            count += len(rows)
            first = int(rows[0]) if first is None else first
            difference = np.abs(stored[jumps].astype(np.float64) - following[jumps])
            largest = max(largest, float(np.nanmax(difference, initial=0.0)))
    return count, first, largest


def _length_range(lengths: npt.NDArray[np.int64]) -> str:
    low, high = int(lengths.min()), int(lengths.max())
    return str(low) if low == high else f"{low}-{high}"
