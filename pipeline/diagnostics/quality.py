"""The quality report: augmented transitions checked against their source data and its env.

For any augmented data (simulator or model rollouts, generated samples, state-noise copies),
:func:`quality_report` measures, against the source dataset:

* the dynamics and reward errors: a sample of augmented rows is put back into the true env (the
  state the row records, else one rebuilt from its observation,
  :func:`offaug.pipeline.rollouts.env_state.rebuild_states`), the row's action is applied, and
  the env's next observation, reward and termination are compared with the row's. Where no
  state can be had the report says so (``state.kind`` "not available" and ``state.reason``)
  instead of guessing;
* the state error: how far each sampled row's observation is from the observation of the state
  it was put back into (0 where the env can be in that state; a model's states that drift off
  the ones the env can reach show here, and are left out of the dynamics errors);
* novelty: each transition's distance to its nearest source transition in the (s, a, s') space
  standardised per dimension by the source, in units of the source's own median
  nearest-neighbour distance;
* the OOD share of the augmented states
  (:func:`offaug.pipeline.diagnostics.coverage.state_coverage`);
* terminal rates and episode returns of both.

The layout is :class:`offaug.pipeline.diagnostics.quality_document.QualityReport`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from gymnasium.error import Error as GymnasiumError

from offaug.algorithms.evaluate import make_env
from offaug.datasets.transitions import Transitions
from offaug.pipeline.diagnostics.coverage import standardiser, state_coverage
from offaug.pipeline.diagnostics.quality_document import (
    EpisodeReturns,
    ErrorSummary,
    Novelty,
    OODShare,
    QualityReport,
    RewardError,
    StateCheck,
    StateSource,
)
from offaug.pipeline.diagnostics.sampling import FloatArray, flat, jsonable, sample_indices
from offaug.pipeline.rollouts.env_state import (
    StartStates,
    StateError,
    dataset_start_states,
    rebuild_states,
    set_state,
)


@dataclasses.dataclass(frozen=True)
class QualitySettings:
    """Sample sizes and the OOD score's parameters of :func:`quality_report`."""

    max_rows: int = 1000
    """Augmented rows stepped in the env for the dynamics, reward and terminal checks."""
    max_states: int = 5000
    """Rows of each dataset sampled for novelty and the OOD share."""
    k: int = 5
    """Neighbours of the OOD score (the diagnostics' ``k``)."""
    quantile: float = 0.95
    """Quantile of the source's own k-NN distances that is the OOD threshold."""
    observation_tolerance: float = 1e-4
    """A set state must give back the row's observation to this (relative and absolute)."""
    seed: int = 0
    """Seed of every sample."""


@dataclasses.dataclass(frozen=True)
class _Stepped:
    """The checked rows' errors."""

    state: StateCheck
    state_errors: FloatArray
    next_state_errors: FloatArray
    reward_errors: FloatArray
    terminal_mismatch: npt.NDArray[np.bool_]


def quality_report(
    augmented: Transitions,
    source: Transitions,
    env_meta: Mapping[str, Any] | None = None,
    *,
    env_id: str | None = None,
    settings: QualitySettings | None = None,
) -> QualityReport:
    """Check ``augmented`` against ``source`` and the environment (module docstring).

    Args:
        augmented: The augmented transitions; a model rollout's ``raw_reward`` extra is the
            reward compared (its ``rewards`` are penalised).
        source: The data it was made from: the scale of every distance and the reference.
        env_meta: The dataset's metadata naming its env (``env_spec``; default
            ``source.meta``).
        env_id: Step this env instead of the one ``env_meta`` names.
        settings: Sample sizes (defaults: :class:`QualitySettings`).

    Returns:
        The report (JSON-ready): a :class:`QualityReport`.
    """
    settings = settings or QualitySettings()
    rng = np.random.default_rng(settings.seed)
    reward_column: Literal["raw_reward", "rewards"] = (
        "raw_reward" if "raw_reward" in augmented.extras else "rewards"
    )
    augmented_rewards = np.asarray(
        augmented.extras["raw_reward"] if reward_column == "raw_reward" else augmented.rewards,
        dtype=np.float64,
    )
    source_rewards = np.asarray(source.rewards, dtype=np.float64)
    stepped = _step_rows(
        augmented,
        augmented_rewards,
        source,
        source.meta if env_meta is None else env_meta,
        env_id,
        settings,
        rng,
    )
    report: QualityReport = {
        "rows": len(augmented),
        "source_rows": len(source),
        "state": stepped.state,
        "state_error": _summary(stepped.state_errors) if stepped.state_errors.size else None,
        "dynamics_error": _summary(stepped.next_state_errors)
        if stepped.next_state_errors.size
        else None,
        "reward_error": _reward_error(stepped.reward_errors, source_rewards),
        "terminal_mismatch": float(stepped.terminal_mismatch.mean())
        if stepped.terminal_mismatch.size
        else None,
        "novelty": novelty(augmented, source, settings.max_states, rng),
        "ood": ood_share(augmented, source, settings, rng),
        "terminal_rate": {
            "augmented": _share(augmented.terminals),
            "source": _share(source.terminals),
        },
        "returns": {
            "reward": reward_column,
            "augmented": episode_returns(augmented, augmented_rewards),
            "source": episode_returns(source, source_rewards),
        },
    }
    converted: QualityReport = jsonable(report)
    return converted


def _step_rows(
    augmented: Transitions,
    rewards: FloatArray,
    source: Transitions,
    env_meta: Mapping[str, Any],
    env_id: str | None,
    settings: QualitySettings,
    rng: np.random.Generator,
) -> _Stepped:
    """Set the env to a sample of augmented rows, step each row's action, compare."""
    rows = sample_indices(len(augmented), settings.max_rows, rng)
    empty = np.zeros(0)

    def unavailable(reason: str, env: str | None = None) -> _Stepped:
        state: StateCheck = {
            "kind": "not available",
            "reason": reason,
            "env": env,
            "rows_checked": 0,
            "rows_unset": 0,
        }
        return _Stepped(state, empty, empty, empty, np.zeros(0, dtype=bool))

    if not len(rows):
        return unavailable("no augmented rows")
    try:
        env = make_env(env_meta, env_id)
    except (ValueError, GymnasiumError) as exc:
        # No recorded env, or one that is not installed: nothing to step.
        return unavailable(f"no environment: {exc}")
    name = env.spec.id if env.spec else None
    try:
        env.reset(seed=settings.seed)
        recorded = dataset_start_states(augmented)
        kind: StateSource
        if recorded is not None:
            states = StartStates(recorded.kind, {k: v[rows] for k, v in recorded.values.items()})
            kind = "recorded"
        else:
            try:
                states = rebuild_states(env, flat(augmented.observations[rows]))
            except StateError as exc:
                return unavailable(str(exc), name)
            kind = "rebuilt"
        _, std = standardiser(flat(source.observations))
        state_errors, next_errors, reward_errors, mismatches = [], [], [], []
        unset = 0
        for i, row in enumerate(rows):
            env.reset()
            try:
                there = set_state(env, states.kind, states.row(i))
            except StateError as exc:
                return unavailable(str(exc), name)
            observation = np.asarray(augmented.observations[row], dtype=np.float64).reshape(-1)
            there = np.asarray(there, dtype=np.float64).reshape(-1)
            state_errors.append(float(np.sqrt(np.mean(((there - observation) / std) ** 2))))
            tolerance = settings.observation_tolerance
            if not np.allclose(there, observation, rtol=tolerance, atol=tolerance):
                unset += 1
                continue
            action = augmented.actions[row]
            next_obs, reward, terminated, _, _ = env.step(
                int(action) if augmented.is_discrete_action else np.asarray(action)
            )
            expected = np.asarray(augmented.next_observations[row], dtype=np.float64).reshape(-1)
            difference = (np.asarray(next_obs, dtype=np.float64).reshape(-1) - expected) / std
            next_errors.append(float(np.sqrt(np.mean(difference**2))))
            reward_errors.append(abs(float(reward) - float(rewards[row])))
            mismatches.append(bool(terminated) != bool(augmented.terminals[row]))
    finally:
        env.close()
    state: StateCheck = {
        "kind": kind,
        "reason": None,
        "env": name,
        "rows_checked": len(rows),
        "rows_unset": unset,
    }
    if unset == len(rows):
        state["reason"] = "no set state gave back its row's observation"
    return _Stepped(
        state,
        np.asarray(state_errors),
        np.asarray(next_errors),
        np.asarray(reward_errors),
        np.asarray(mismatches, bool),
    )


def ood_share(
    augmented: Transitions,
    source: Transitions,
    settings: QualitySettings,
    rng: np.random.Generator,
) -> OODShare | None:
    """The coverage check's OOD share of the augmented states (None with too few rows)."""
    if len(augmented) == 0 or len(source) <= settings.k:
        return None
    coverage = state_coverage(
        source.observations,
        augmented.observations,
        k=settings.k,
        quantile=settings.quantile,
        max_states=settings.max_states,
        rng=rng,
    )
    return {
        "share": coverage["ood_fraction"],
        "k": settings.k,
        "quantile": settings.quantile,
        "threshold": coverage["threshold"],
    }


def _reward_error(errors: FloatArray, source_rewards: FloatArray) -> RewardError | None:
    if not errors.size:
        return None
    reward_std = float(source_rewards.std()) if len(source_rewards) else 0.0
    relative = float(errors.mean()) / reward_std if reward_std > 0 else None
    return {**_summary(errors), "relative": relative}


def transition_features(
    data: Transitions, rows: npt.NDArray[np.int64], actions: int | None
) -> FloatArray:
    """(s, a, s') of ``rows`` as one float vector each; Discrete actions one-hot over
    ``actions`` choices."""
    action = np.asarray(data.actions[rows])
    if actions is not None:
        action = np.eye(actions)[np.clip(action.astype(np.int64), 0, actions - 1)]
    return np.concatenate(
        [
            flat(data.observations[rows]),
            action.reshape(len(rows), -1),
            flat(data.next_observations[rows]),
        ],
        1,
    ).astype(np.float64)


def novelty(
    augmented: Transitions, source: Transitions, max_states: int, rng: np.random.Generator
) -> Novelty | None:
    """Nearest-source-transition distances of augmented transitions, in units of the source's
    median leave-one-out nearest-neighbour distance (None with too few rows)."""
    # Imported here: scipy's spatial package is heavy and only this check needs it.
    from scipy.spatial import cKDTree

    if len(augmented) == 0 or len(source) < 2:
        return None
    actions = None
    if source.is_discrete_action:
        actions = int(max(np.max(source.actions), np.max(augmented.actions))) + 1
    reference = transition_features(source, sample_indices(len(source), max_states, rng), actions)
    queries = transition_features(
        augmented, sample_indices(len(augmented), max_states, rng), actions
    )
    mean, std = standardiser(reference)
    tree = cKDTree((reference - mean) / std)
    # The source's own: its second neighbour (the first is itself).
    own, _ = tree.query((reference - mean) / std, k=2)
    unit = float(np.median(own[:, 1]))
    distances, _ = tree.query((queries - mean) / std, k=1)
    scaled = np.asarray(distances, dtype=np.float64) / (unit if unit > 0 else 1.0)
    summary = _summary(scaled)
    return {
        "unit": unit,
        "mean": summary["mean"],
        "median": summary["median"],
        "p95": summary["p95"],
        "max": summary["max"],
        "share_above_one": float(np.mean(scaled > 1.0)),
    }


def episode_returns(data: Transitions, rewards: FloatArray) -> EpisodeReturns:
    """Undiscounted returns of ``data``'s episodes summed from ``rewards`` (one per row)."""
    if len(data) == 0:
        return {"episodes": 0, "mean_return": None, "mean_length": None, "reward_per_step": None}
    bounds = data.episode_bounds()
    returns = data.episode_sums(rewards)
    return {
        "episodes": len(bounds) - 1,
        "mean_return": float(returns.mean()),
        "mean_length": float(np.diff(bounds).mean()),
        "reward_per_step": float(rewards.mean()),
    }


def _summary(values: FloatArray) -> ErrorSummary:
    return {
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "p95": float(np.quantile(values, 0.95)),
        "max": float(values.max()),
    }


def _share(flags: npt.NDArray[Any]) -> float | None:
    return float(np.mean(flags)) if len(flags) else None
