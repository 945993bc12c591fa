"""The dataset doctor's checks: each takes the prepared dataset and returns its findings.

Every check is numpy only, reads the whole dataset once or twice and holds no more than a few
columns' worth of temporaries, so it runs where the data loads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from offaug.datasets.doctor.env_facts import EnvFacts
from offaug.datasets.doctor.findings import Finding
from offaug.datasets.transitions import Transitions

REWARD_RMS_RANGE = (0.01, 20.0)
"""Per-step reward root-mean-square outside this range gets a suggested scale."""
REWARD_OUTLIER_MADS = 100.0
"""A reward this many median absolute deviations from the median is an outlier."""
HORIZON_FRACTION = 0.5
"""Episodes or rollouts shorter than this share of T_eff are warned about."""
SCALE_SPREAD_LIMIT = 100.0
"""Largest/smallest per-dimension observation std above this: advise normalisation."""
_ROWS_PER_BLOCK = 1 << 16  # rows converted to float64 at once by the column statistics


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A dataset with the per-episode figures every check needs, computed once."""

    data: Transitions
    facts: EnvFacts
    gamma: float
    bounds: npt.NDArray[np.int64]  # (E + 1,) episode start offsets plus N
    lengths: npt.NDArray[np.int64]  # (E,)
    last_rows: npt.NDArray[np.int64]  # (E,) each episode's last row

    @classmethod
    def of(cls, data: Transitions, facts: EnvFacts, gamma: float) -> Prepared:
        bounds = data.episode_bounds()
        return cls(data, facts, gamma, bounds, np.diff(bounds), bounds[1:] - 1)

    @property
    def t_eff(self) -> float:
        """The effective horizon ``-1 / ln(gamma)``."""
        return effective_horizon(self.gamma)


Check = Callable[[Prepared], list[Finding]]


def effective_horizon(gamma: float) -> float:
    """``T_eff = -1 / ln(gamma)``: the steps over which rewards still count (0.99 -> 99.5)."""
    return -1.0 / math.log(gamma)


def finite_values(data: Transitions) -> list[Finding]:
    """NaN or inf in observations, next observations, actions or rewards: an error."""
    counts: dict[str, int] = {}
    first_row: int | None = None
    for name in ("observations", "next_observations", "actions", "rewards"):
        values = getattr(data, name)
        if values.dtype.kind != "f":
            continue
        bad_rows = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
        if bad_rows.any():
            counts[name] = int(bad_rows.sum())
            row = int(np.argmax(bad_rows))
            first_row = row if first_row is None else min(first_row, row)
    if first_row is None:
        return []
    return [
        Finding(
            "nan-or-inf",
            "error",
            f"rows holding NaN/inf: {counts}; the first is row {first_row} "
            f"(episode {int(data.episode_ids[first_row])})",
            "drop or repair those episodes before training; every loss and statistic "
            "turns NaN from one such value",
            {**{f"rows_{k}": v for k, v in counts.items()}, "first_row": first_row},
        )
    ]


def reward_scale(prep: Prepared) -> list[Finding]:
    """Reward mean/std, typical return and a suggested scale; outliers and constant rewards."""
    data = prep.data
    rewards = data.rewards.astype(np.float64)
    rewards = np.where(np.isfinite(rewards), rewards, 0.0)
    returns = data.episode_returns(finite=True)
    mean, std = float(rewards.mean()), float(rewards.std())
    rms = math.hypot(mean, std)
    low, high = REWARD_RMS_RANGE
    scaled = rms > high or 0.0 < rms < low
    suggested = _one_significant_digit(1.0 / rms) if scaled else 1.0
    numbers = {
        "reward_mean": mean,
        "reward_std": std,
        "reward_rms": rms,
        "return_mean": float(returns.mean()),
        "return_std": float(returns.std()),
        "typical_return": float(np.median(np.abs(returns))),
        "suggested_scale": suggested,
    }
    seen = (
        f"reward {mean:.3g} ± {std:.3g} per step (rms {rms:.3g}), return "
        f"{returns.mean():.4g} ± {returns.std():.4g} (typical |return| "
        f"{numbers['typical_return']:.4g})"
    )
    findings = [
        Finding(
            "reward-scale",
            "warning" if scaled else "info",
            seen,
            f"multiply rewards by {suggested:g} (per-step rms near 1) so that Q-values and "
            "their gradients keep a workable size"
            if scaled
            else "",
            numbers,
        )
    ]
    if std == 0.0:
        has_terminals = bool(data.terminals.any())
        findings.append(
            Finding(
                "constant-reward",
                "info" if has_terminals else "warning",
                f"every reward is {mean:g}",
                "the only learning signal is when episodes terminate"
                if has_terminals
                else "with no terminations either, every action looks equally good",
                {"reward": mean, "terminals": int(data.terminals.sum())},
            )
        )
    median = float(np.median(rewards))
    mad = float(np.median(np.abs(rewards - median)))
    deviation = float(np.abs(rewards - median).max()) if len(rewards) else 0.0
    if mad > 0 and deviation > REWARD_OUTLIER_MADS * mad:
        outliers = int(np.count_nonzero(np.abs(rewards - median) > REWARD_OUTLIER_MADS * mad))
        findings.append(
            Finding(
                "reward-outliers",
                "warning",
                f"{outliers} rewards lie over {REWARD_OUTLIER_MADS:g} median absolute "
                f"deviations ({mad:.3g}) from the median {median:.3g}; the farthest by "
                f"{deviation:.3g}",
                "find out where they come from (a bonus, a bug, a unit change); clip them or "
                "they dominate the return and the critic's targets",
                {"outliers": outliers, "median": median, "mad": mad, "max_deviation": deviation},
            )
        )
    return findings


def horizon(prep: Prepared) -> list[Finding]:
    """Episode lengths against T_eff; time-limited episodes shorter than half of it warn."""
    data, t_eff = prep.data, prep.t_eff
    truncated = prep.lengths[data.timeouts[prep.last_rows] & ~data.terminals[prep.last_rows]]
    numbers = {
        "gamma": prep.gamma,
        "t_eff": t_eff,
        "length_mean": float(prep.lengths.mean()),
        "length_median": float(np.median(prep.lengths)),
        "length_min": int(prep.lengths.min()),
        "length_max": int(prep.lengths.max()),
        "truncated_episodes": len(truncated),
        "truncated_length_median": float(np.median(truncated)) if len(truncated) else None,
    }
    seen = (
        f"T_eff = -1/ln({prep.gamma:g}) = {t_eff:.1f} steps; episodes last "
        f"{numbers['length_median']:g} steps (median, {numbers['length_min']}-"
        f"{numbers['length_max']})"
    )
    if len(truncated) and np.median(truncated) < HORIZON_FRACTION * t_eff:
        cut = float(np.median(truncated))
        return [
            Finding(
                "episodes-short",
                "warning",
                f"{seen}; {len(truncated)} end at a time limit after a median {cut:g} steps, "
                f"under {HORIZON_FRACTION:g} x T_eff",
                f"raise the time limit, or lower gamma to about {math.exp(-1 / (2 * cut)):.3g} "
                "(T_eff twice the episode length); returns cut that short read far below "
                "their value",
                numbers,
            )
        ]
    return [Finding("horizon", "info", seen, "", numbers)]


def observation_scale(prep: Prepared) -> list[Finding]:
    """Per-dimension std: constant dimensions, duplicated dimensions and a wide scale spread."""
    observations = prep.data.observations
    if observations.dtype.kind != "f" or observations.ndim < 2:
        return []
    flat = observations.reshape(len(observations), -1)
    means, stds, ranges = _column_moments(flat)
    findings: list[Finding] = []
    constant = np.flatnonzero(ranges == 0)
    if len(constant):
        findings.append(
            Finding(
                "constant-dimensions",
                "warning",
                f"observation dimensions {constant.tolist()} never change",
                "drop them, or make sure normalisation leaves a zero std alone (dividing by "
                "it gives NaN)",
                {"dimensions": constant.tolist(), "values": means[constant].tolist()},
            )
        )
    varying = np.flatnonzero((ranges > 0) & (stds > 0))
    duplicates = _duplicated_columns(flat, varying)
    if duplicates:
        findings.append(
            Finding(
                "duplicated-dimensions",
                "info",
                f"observation dimensions repeat others exactly: {duplicates}",
                "harmless for learning, but distance-based checks (k-NN coverage) count them "
                "twice; drop the copies if they are not meant to be there",
                {"groups": duplicates},
            )
        )
    if len(varying) >= 2:
        widest, narrowest = varying[np.argmax(stds[varying])], varying[np.argmin(stds[varying])]
        spread = float(stds[widest] / stds[narrowest])
        if spread > SCALE_SPREAD_LIMIT:
            findings.append(
                Finding(
                    "observation-scale-spread",
                    "warning",
                    f"observation stds span a factor {spread:.3g}: dimension {widest} has "
                    f"std {stds[widest]:.3g}, dimension {narrowest} {stds[narrowest]:.3g}",
                    "standardise observations per dimension (this dataset's mean and std, "
                    "applied to the policy's inputs at evaluation too)",
                    {
                        "spread": spread,
                        "widest_dimension": int(widest),
                        "widest_std": float(stds[widest]),
                        "narrowest_dimension": int(narrowest),
                        "narrowest_std": float(stds[narrowest]),
                    },
                )
            )
    return findings


def actions_in_box(prep: Prepared) -> list[Finding]:
    """Actions outside the action space's bounds (a Box, or a Discrete range): an error."""
    box = prep.facts.action_box
    actions = prep.data.actions.reshape(len(prep.data), -1).astype(np.float64)
    if box is None or actions.shape[1] != len(box.low):
        return []
    tolerance = 1e-6 * (1.0 + np.abs(np.concatenate([box.low, box.high])).max(initial=0.0))
    below = np.maximum(box.low - actions, 0.0)
    above = np.maximum(actions - box.high, 0.0)
    excess = np.where(np.isfinite(actions), np.maximum(below, above), 0.0)
    outside = (excess > tolerance).any(axis=1)
    if not outside.any():
        return []
    dimensions = np.flatnonzero((excess > tolerance).any(axis=0)).tolist()
    count = int(outside.sum())
    return [
        Finding(
            "actions-outside-box",
            "error",
            f"{count} actions ({count / len(actions):.2%}) lie outside the action space, by up "
            f"to {excess.max():.3g} (dimensions {dimensions})",
            "clip them to the box, or find out why the behaviour policy left it (an unclipped "
            "Gaussian); behaviour log-likelihoods and importance weights assume the box",
            {
                "rows": count,
                "share": count / len(actions),
                "max_excess": float(excess.max()),
                "dimensions": dimensions,
                "first_row": int(np.argmax(outside)),
            },
        )
    ]


def _column_moments(
    flat: npt.NDArray[np.floating],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per-column mean, std and max - min of the finite values, in blocks of rows (two passes,
    so that a large mean does not swamp a small std)."""
    dims = flat.shape[1]
    total, count = np.zeros(dims), np.zeros(dims)
    low, high = np.full(dims, np.inf), np.full(dims, -np.inf)
    for start in range(0, len(flat), _ROWS_PER_BLOCK):
        block = flat[start : start + _ROWS_PER_BLOCK].astype(np.float64)
        finite = np.isfinite(block)
        total += np.where(finite, block, 0.0).sum(axis=0)
        count += finite.sum(axis=0)
        low = np.minimum(low, np.where(finite, block, np.inf).min(axis=0))
        high = np.maximum(high, np.where(finite, block, -np.inf).max(axis=0))
    means = total / np.maximum(count, 1)
    squares = np.zeros(dims)
    for start in range(0, len(flat), _ROWS_PER_BLOCK):
        block = flat[start : start + _ROWS_PER_BLOCK].astype(np.float64)
        squares += (np.where(np.isfinite(block), block - means, 0.0) ** 2).sum(axis=0)
    ranges = np.where(count > 0, high - low, 0.0)
    return means, np.sqrt(squares / np.maximum(count, 1)), ranges


def _duplicated_columns(
    flat: npt.NDArray[np.floating], candidates: npt.NDArray[np.intp]
) -> list[list[int]]:
    # Group on a prefix of rows first, then confirm each group on every row.
    prefix = flat[: min(len(flat), 4096)]
    groups: dict[bytes, list[int]] = {}
    for dimension in candidates.tolist():
        groups.setdefault(np.ascontiguousarray(prefix[:, dimension]).tobytes(), []).append(
            dimension
        )
    duplicated = []
    for group in groups.values():
        first, *others = group
        same = [d for d in others if np.array_equal(flat[:, first], flat[:, d])]
        if same:
            duplicated.append([first, *same])
    return duplicated


def _one_significant_digit(value: float) -> float:
    exponent = math.floor(math.log10(value))
    return float(round(value / 10**exponent) * 10**exponent)
