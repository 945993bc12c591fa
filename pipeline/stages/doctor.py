"""The dataset doctor with a workflow: the dataset's checks plus the rollout horizon the
workflow asks for, against the effective horizon T_eff = -1/ln(gamma).

A simulator rollout runs until the env terminates or reaches its time limit
(``rollout.max_episode_steps``, else the env's own); a model rollout runs
``rollout.dynamics.horizon`` steps. Simulator rollouts shorter than half of T_eff are a
warning: their returns are cut long before the discount forgets them. Model rollouts are short
by design (MOPO branches a few steps from dataset states and the critic bootstraps from their
ends), so for them the same comparison is information only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import gymnasium as gym

from offaug.datasets.doctor import (
    HORIZON_FRACTION,
    DoctorReport,
    EnvFacts,
    Finding,
    diagnose_dataset,
    effective_horizon,
    env_facts,
)
from offaug.datasets.envs import register_envs
from offaug.datasets.sources import load_transitions
from offaug.pipeline.contracts import AugmentedRef, DatasetRef
from offaug.pipeline.schema.workflow import Workflow


@dataclasses.dataclass(frozen=True)
class RolloutHorizon:
    """How many steps a workflow's rollouts last at most, and which setting says so."""

    steps: int
    backend: Literal["simulator", "model"]
    setting: str
    """The workflow field (or env spec) the number comes from."""


def rollout_horizon(workflow: Workflow, facts: EnvFacts) -> RolloutHorizon | None:
    """The longest rollout ``workflow`` makes (None: the env's time limit is not known, or the
    backend generates transitions without rolling out)."""
    rollout = workflow.rollout
    if rollout.backend == "diffusion":
        return None
    if rollout.backend == "model":
        return RolloutHorizon(rollout.dynamics.horizon, "model", "rollout.dynamics.horizon")
    if rollout.max_episode_steps is not None:
        return RolloutHorizon(rollout.max_episode_steps, "simulator", "rollout.max_episode_steps")
    if rollout.env is not None:
        limit = _registered_time_limit(rollout.env)
        setting = f"the time limit of rollout.env {rollout.env}"
    else:
        limit = facts.max_episode_steps
        setting = f"the time limit of {facts.env_id or 'the dataset env'}"
    return None if limit is None else RolloutHorizon(limit, "simulator", setting)


def horizon_findings(horizon: RolloutHorizon, gamma: float) -> list[Finding]:
    """The rollout horizon against T_eff: a warning below half of it (simulator rollouts)."""
    t_eff = effective_horizon(gamma)
    numbers = {
        "rollout_horizon": horizon.steps,
        "backend": horizon.backend,
        "setting": horizon.setting,
        "gamma": gamma,
        "t_eff": t_eff,
    }
    seen = (
        f"{horizon.backend} rollouts last at most {horizon.steps} steps ({horizon.setting}); "
        f"T_eff = {t_eff:.1f}"
    )
    if horizon.steps >= HORIZON_FRACTION * t_eff:
        return [Finding("rollout-horizon", "info", seen, "", numbers)]
    if horizon.backend == "model":
        return [
            Finding(
                "rollout-horizon",
                "info",
                f"{seen}: short model rollouts, as MOPO intends",
                "the critic bootstraps from their ends (they are time-outs); lengthen them "
                "only as far as the model stays accurate",
                numbers,
            )
        ]
    return [
        Finding(
            "rollout-horizon-short",
            "warning",
            f"{seen}, under {HORIZON_FRACTION:g} x T_eff",
            f"set rollout.max_episode_steps to at least {int(HORIZON_FRACTION * t_eff) + 1}, "
            "or train with a smaller gamma; rollouts this short teach little about long-run "
            "value",
            numbers,
        )
    ]


def doctor_source(
    source: str,
    *,
    workflow: Workflow | None = None,
    gamma: float | None = None,
    download: bool = False,
) -> DoctorReport:
    """Load ``source`` and run the dataset doctor on it, with the workflow's rollout horizon.

    Args:
        source: Anything :func:`load_transitions` takes (NaN/inf rows are loaded and reported).
        workflow: Adds the rollout-horizon check; its ``diagnostics.gamma`` is the default gamma.
        gamma: The learner's discount (default the workflow's, else 0.99).
        download: Fetch a missing Minari dataset.
    """
    if gamma is None:
        gamma = workflow.diagnostics.gamma if workflow is not None else 0.99
    data = load_transitions(source, download=download, check_finite=False)
    facts = env_facts(data.meta)
    report = diagnose_dataset(data, gamma=gamma, facts=facts)
    if workflow is None:
        return report
    horizon = rollout_horizon(workflow, facts)
    return report if horizon is None else report.with_findings(horizon_findings(horizon, gamma))


def _registered_time_limit(env_id: str) -> int | None:
    register_envs()
    try:
        limit = gym.spec(env_id).max_episode_steps
    except gym.error.Error:
        return None
    return int(limit) if limit else None


def doctor_stage(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    gamma: float,
    workflow: Workflow | None = None,
) -> dict[str, Any]:
    """The dataset doctor on the source (with the workflow's rollout horizon) and on the
    augmented shard set: ``{"gamma", "source", "augmented"}``, each a ``DoctorReport.to_json()``
    (``augmented`` None without augmented data)."""
    source = doctor_source(data.source, workflow=workflow, gamma=gamma)
    result: dict[str, Any] = {"gamma": gamma, "source": source.to_json(), "augmented": None}
    if augmented is not None:
        rows = load_transitions(augmented.directory, check_finite=False)
        facts = env_facts(rows.meta if rows.meta.get("env_spec") else data.meta)
        result["augmented"] = diagnose_dataset(rows, gamma=gamma, facts=facts).to_json()
    return result
