"""The ``value`` section: a critic's Q-hat against discounted Monte-Carlo returns.

Compared on the dataset (Q(s, a) at dataset (s, a) against the return from that step), on fresh
evaluation episodes (Q(s, pi(s)) against their returns), and at uniform random actions. The
returns and their completeness are :mod:`offaug.pipeline.diagnostics.returns`'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.pipeline.diagnostics.evaluation import Episode
from offaug.pipeline.diagnostics.policy_document import (
    RandomActionGap,
    ScatterPoints,
    ValueEntry,
    ValueGap,
)
from offaug.pipeline.diagnostics.policy_models import ActionSpace
from offaug.pipeline.diagnostics.returns import complete_returns, discounted_returns
from offaug.pipeline.diagnostics.sampling import (
    FloatArray,
    PolicySample,
    QFunction,
    TrainedPolicy,
    batched_q,
    sample_indices,
)
from offaug.pipeline.diagnostics.settings import DiagnosticsSettings


def value_gap(
    q: npt.ArrayLike, mc: npt.ArrayLike, complete: npt.ArrayLike | None = None
) -> ValueGap:
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
) -> RandomActionGap:
    """Mean Q at uniform random actions against mean Q at dataset actions, same states."""
    at_data = batched_q(q_values, observations, dataset_actions)
    at_random = batched_q(q_values, observations, random_actions)
    return {
        "q_dataset_actions": float(at_data.mean()),
        "q_random_actions": float(at_random.mean()),
        "difference": float(at_random.mean() - at_data.mean()),
    }


def _scatter(q: FloatArray, mc: FloatArray, points: int, rng: np.random.Generator) -> ScatterPoints:
    index = sample_indices(len(q), points, rng)
    return {"q": q[index].tolist(), "mc": mc[index].tolist()}


def value_entry(
    policy: TrainedPolicy,
    sample: PolicySample,
    actions: ActionSpace,
    episodes: Mapping[str, Sequence[Episode]] | None,
    gamma: float,
    settings: DiagnosticsSettings,
    rng: np.random.Generator,
) -> ValueEntry:
    """Q-hat against MC returns on the data and on fresh episodes; Q at random actions."""
    assert policy.q_values is not None
    q_data = batched_q(policy.q_values, sample.states, sample.actions)
    entry: ValueEntry = {
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
