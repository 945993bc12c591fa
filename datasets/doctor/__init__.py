"""The dataset doctor: checks a ``Transitions`` for the pitfalls that make offline RL train
nothing, and says, for each, the numbers it saw and what to do.

``offaug doctor SOURCE`` prints its findings;  the exit status is 0 (nothing worse than info),
1 (warnings) or 2 (errors). The checks and their codes:

=================================== ========== ==================================================
code                                severity   what it means
=================================== ========== ==================================================
``nan-or-inf``                      error      NaN/inf in observations, actions or rewards
``reward-scale``                    info/warn  reward mean/std, typical return, suggested scale
``constant-reward``                 info/warn  every reward is the same
``reward-outliers``                 warning    rewards far (in MADs) from the median
``horizon`` / ``episodes-short``    info/warn  episode lengths against T_eff = -1/ln(gamma)
``done-mid-episode``                error      a terminal/time-out row that is not an episode end
``episode-end-unflagged``           warning    an episode that ends neither terminal nor time-out
``terminal-and-timeout``            warning    a row flagged both ways
``no-terminals``                    warning    an env that can terminate, with no terminals
``terminals-in-nonterminating-env`` warning    terminals in an env that never terminates
``terminal-at-time-limit``          warning    terminations exactly at the time limit
``timeout-not-at-limit``            warning    time-outs before or after the time limit
``next-observation-jump``           error      next_observations[t] != observations[t + 1]
``constant-dimensions``             warning    observation dimensions that never change
``duplicated-dimensions``           info       observation dimensions equal to another
``observation-scale-spread``        warning    per-dimension stds far apart: normalise
``actions-outside-box``             error      actions outside the action space
``duplicated-episodes``             warning    episodes stored twice
=================================== ========== ==================================================

The workflow-aware check (a rollout horizon against T_eff) lives in
``offaug.pipeline.stages.doctor``, which reads        workflows.
"""

from __future__ import annotations

from offaug.datasets.doctor.checks import (
    HORIZON_FRACTION,
    Prepared,
    actions_in_box,
    effective_horizon,
    finite_values,
    horizon,
    observation_scale,
    reward_scale,
)
from offaug.datasets.doctor.env_facts import EnvFacts, env_facts
from offaug.datasets.doctor.episodes import (
    duplicated_episodes,
    episode_flags,
    next_observations,
    terminations,
)
from offaug.datasets.doctor.findings import SEVERITIES, DoctorReport, Finding, Severity
from offaug.datasets.transitions import Transitions

CHECKS = (
    reward_scale,
    horizon,
    episode_flags,
    terminations,
    next_observations,
    observation_scale,
    actions_in_box,
    duplicated_episodes,
)
"""The checks run on every dataset, in report order (after the NaN/inf check)."""


def diagnose_dataset(
    data: Transitions, *, gamma: float = 0.99, facts: EnvFacts | None = None
) -> DoctorReport:
    """Run every check on ``data``.

    Args:
        data: The dataset (any source: original, augmented, a shard set's rows).
        gamma: The discount the learner will use (T_eff = -1/ln(gamma)).
        facts: What is known about the environment; default read from ``data.meta``.
    """
    if not 0.0 < gamma < 1.0:
        raise ValueError(f"gamma must lie in (0, 1), got {gamma}")
    facts = facts if facts is not None else env_facts(data.meta)
    summary = {
        "steps": len(data),
        "episodes": data.num_episodes,
        "gamma": gamma,
        "t_eff": effective_horizon(gamma),
        "env_id": facts.env_id,
        "time_limit": facts.max_episode_steps,
        "can_terminate": facts.can_terminate,
        "terminals": int(data.terminals.sum()),
        "timeouts": int(data.timeouts.sum()),
    }
    if len(data) == 0:
        empty = Finding("empty", "error", "the dataset holds no transitions", "check the source")
        return DoctorReport((empty,), summary)
    prep = Prepared.of(data, facts, gamma)
    findings = finite_values(data)
    for check in CHECKS:
        findings.extend(check(prep))
    return DoctorReport(tuple(findings), summary)


__all__ = [
    "CHECKS",
    "HORIZON_FRACTION",
    "SEVERITIES",
    "DoctorReport",
    "EnvFacts",
    "Finding",
    "Severity",
    "diagnose_dataset",
    "effective_horizon",
    "env_facts",
]
