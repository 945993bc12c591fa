"""The dataset doctor flags each pitfall on a dataset built to have it and stays quiet on clean
data (built directly, and real Minari datasets from the fixtures)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import numpy as np
import pytest

from offaug.datasets import Transitions, concatenate, load_transitions
from offaug.datasets.doctor import DoctorReport, diagnose_dataset, env_facts
from offaug.datasets.doctor.findings import Finding

LIMIT = 120


def clean_dataset(env_id: str = "Hopper-v5", limit: int = LIMIT, seed: int = 0) -> Transitions:
    """Twelve episodes of a 4-d random walk: half fall early (terminal), half reach the limit."""
    rng = np.random.default_rng(seed)
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "next", "act", "rew", "ids")}
    terminals, timeouts = [], []
    for episode in range(12):
        length = limit if episode % 2 else int(rng.integers(60, limit))
        states = np.cumsum(rng.normal(0.0, 0.1, size=(length + 1, 4)), axis=0)
        states += rng.normal(0.0, 1.0, size=4)
        columns["obs"].append(states[:-1])
        columns["next"].append(states[1:])
        columns["act"].append(rng.uniform(-1.0, 1.0, size=(length, 3)))
        columns["rew"].append(rng.normal(1.0, 0.3, size=length))
        columns["ids"].append(np.full(length, episode))
        end = np.zeros(length, dtype=bool)
        end[-1] = True
        terminals.append(end & (episode % 2 == 0))
        timeouts.append(end & (episode % 2 == 1))
    meta = {
        "env_spec": json.dumps({"id": env_id, "max_episode_steps": limit, "kwargs": {}}),
        "action_space": json.dumps(
            {"type": "Box", "dtype": "float32", "shape": [3], "low": [-1.0] * 3, "high": [1.0] * 3}
        ),
    }
    return Transitions(
        observations=np.concatenate(columns["obs"]).astype(np.float32),
        actions=np.concatenate(columns["act"]).astype(np.float32),
        rewards=np.concatenate(columns["rew"]).astype(np.float32),
        next_observations=np.concatenate(columns["next"]).astype(np.float32),
        terminals=np.concatenate(terminals),
        timeouts=np.concatenate(timeouts),
        episode_ids=np.concatenate(columns["ids"]).astype(np.int64),
        meta=meta,
    )


def _edit(data: Transitions, **arrays: Callable[[np.ndarray], None]) -> Transitions:
    """A copy of ``data`` with each named column copied and edited in place by its function."""
    replaced = {}
    for name, edit in arrays.items():
        column = getattr(data, name).copy()
        edit(column)
        replaced[name] = column
    return dataclasses.replace(data, **replaced)


def _set(index: object, value: object) -> Callable[[np.ndarray], None]:
    def edit(column: np.ndarray) -> None:
        column[index] = value  # type: ignore[index]

    return edit


def _scale(factor: float) -> Callable[[np.ndarray], None]:
    def edit(column: np.ndarray) -> None:
        column *= factor

    return edit


def _end_of(data: Transitions, episode: int) -> int:
    return int(data.episode_bounds()[episode + 1] - 1)


def _finding(report: DoctorReport, code: str) -> Finding:
    matches = [f for f in report.findings if f.code == code]
    assert matches, f"{code} not in {report.codes()}"
    return matches[0]


def test_clean_dataset_is_quiet() -> None:
    report = diagnose_dataset(clean_dataset())
    assert report.exit_code == 0, [f.to_json() for f in report.findings]
    assert report.codes() == ["reward-scale", "horizon"]
    assert report.facts["t_eff"] == pytest.approx(99.5, abs=0.01)
    assert report.facts["can_terminate"] is True
    scale = _finding(report, "reward-scale").numbers
    assert scale["reward_mean"] == pytest.approx(1.0, abs=0.05)
    assert scale["suggested_scale"] == 1.0
    json.dumps(report.to_json(), allow_nan=False)


def _scaled_observations(data: Transitions) -> Transitions:
    def scale(column: np.ndarray) -> None:
        column[:, 0] *= 1e4

    return _edit(data, observations=scale, next_observations=scale)


def _copied_dimension(data: Transitions) -> Transitions:
    def copy(column: np.ndarray) -> None:
        column[:, 3] = column[:, 1]

    return _edit(data, observations=copy, next_observations=copy)


def _constant_dimension(data: Transitions) -> Transitions:
    return _edit(
        data,
        observations=_set((slice(None), 2), 0.5),
        next_observations=_set((slice(None), 2), 0.5),
    )


def _joined_episodes(data: Transitions) -> Transitions:
    # Episodes 0 and 1 share an id: the env was not reset after episode 0's terminal.
    stop = int(data.episode_bounds()[2])
    return _edit(data, episode_ids=_set(slice(0, stop), 0))


def _terminals_as_timeouts(data: Transitions) -> Transitions:
    return dataclasses.replace(
        data, terminals=np.zeros_like(data.terminals), timeouts=data.terminals | data.timeouts
    )


def _timeouts_as_terminals(data: Transitions) -> Transitions:
    return dataclasses.replace(
        data, terminals=data.terminals | data.timeouts, timeouts=np.zeros_like(data.timeouts)
    )


def _meta(data: Transitions, env_id: str, limit: int) -> Transitions:
    spec = json.dumps({"id": env_id, "max_episode_steps": limit, "kwargs": {}})
    return dataclasses.replace(data, meta={**data.meta, "env_spec": spec})


def _episode_twice(data: Transitions) -> Transitions:
    return concatenate([data, data.slice(0, int(data.episode_bounds()[1]))])


PITFALLS: dict[str, tuple[Callable[[Transitions], Transitions], str, str]] = {
    "reward scale": (lambda d: _edit(d, rewards=_scale(1000.0)), "reward-scale", "warning"),
    "reward outliers": (
        lambda d: _edit(d, rewards=_set([5, 50], 5e4)),
        "reward-outliers",
        "warning",
    ),
    "no terminals in a falling env": (_terminals_as_timeouts, "no-terminals", "warning"),
    "terminals in HalfCheetah": (
        lambda d: _meta(d, "HalfCheetah-v5", LIMIT),
        "terminals-in-nonterminating-env",
        "warning",
    ),
    "time-outs recorded as terminals": (
        _timeouts_as_terminals,
        "terminal-at-time-limit",
        "warning",
    ),
    "time-outs before the limit": (
        lambda d: _meta(d, "Hopper-v5", 1000),
        "timeout-not-at-limit",
        "warning",
    ),
    "env not reset after done": (_joined_episodes, "done-mid-episode", "error"),
    "unflagged episode end": (
        lambda d: _edit(d, timeouts=_set(_end_of(d, 1), False)),
        "episode-end-unflagged",
        "warning",
    ),
    "terminal and time-out": (
        lambda d: _edit(d, terminals=_set(_end_of(d, 1), True)),
        "terminal-and-timeout",
        "warning",
    ),
    "next observation jumps": (
        lambda d: _edit(d, next_observations=_set(7, 9.0)),
        "next-observation-jump",
        "error",
    ),
    "observation scale spread": (_scaled_observations, "observation-scale-spread", "warning"),
    "constant dimension": (_constant_dimension, "constant-dimensions", "warning"),
    "duplicated dimension": (_copied_dimension, "duplicated-dimensions", "info"),
    "NaN observation": (
        lambda d: _edit(d, observations=_set((5, 0), np.nan)),
        "nan-or-inf",
        "error",
    ),
    "inf reward": (lambda d: _edit(d, rewards=_set(9, np.inf)), "nan-or-inf", "error"),
    "action outside the box": (
        lambda d: _edit(d, actions=_set((3, 1), 1.5)),
        "actions-outside-box",
        "error",
    ),
    "duplicated episode": (_episode_twice, "duplicated-episodes", "warning"),
}


@pytest.mark.parametrize("pitfall", list(PITFALLS))
def test_doctor_flags_each_pitfall(pitfall: str) -> None:
    make, code, severity = PITFALLS[pitfall]
    report = diagnose_dataset(make(clean_dataset()))
    finding = _finding(report, code)
    assert finding.severity == severity
    assert finding.numbers
    if severity != "info":
        assert finding.advice
    assert report.exit_code == {"info": 0, "warning": 1, "error": 2}[report.worst]
    json.dumps(report.to_json(), allow_nan=False)


def test_each_pitfall_gives_the_numbers_it_saw() -> None:
    scaled = diagnose_dataset(PITFALLS["reward scale"][0](clean_dataset()))
    assert _finding(scaled, "reward-scale").numbers["suggested_scale"] == pytest.approx(0.001)
    joined = diagnose_dataset(_joined_episodes(clean_dataset()))
    assert _finding(joined, "next-observation-jump").numbers["rows"] == 1
    assert _finding(joined, "done-mid-episode").numbers["first_row"] == _end_of(clean_dataset(), 0)
    spread = diagnose_dataset(_scaled_observations(clean_dataset()))
    assert _finding(spread, "observation-scale-spread").numbers["widest_dimension"] == 0
    outside = diagnose_dataset(PITFALLS["action outside the box"][0](clean_dataset()))
    numbers = _finding(outside, "actions-outside-box").numbers
    assert (numbers["rows"], numbers["first_row"], numbers["dimensions"]) == (1, 3, [1])
    assert numbers["max_excess"] == pytest.approx(0.5)
    twice = diagnose_dataset(_episode_twice(clean_dataset()))
    assert _finding(twice, "duplicated-episodes").numbers["pairs"] == [[0, 12]]


def test_short_episodes_warn_below_half_the_effective_horizon() -> None:
    data = clean_dataset()
    # T_eff(0.995) = 199.5: time-limited episodes of 120 steps are above half of it ...
    assert "episodes-short" not in diagnose_dataset(data, gamma=0.995).codes()
    # ... and T_eff(0.999) = 999.5 puts them far below.
    short = _finding(diagnose_dataset(data, gamma=0.999), "episodes-short")
    assert short.severity == "warning"
    assert short.numbers["truncated_length_median"] == LIMIT


def test_env_facts_read_the_spec_and_the_action_space() -> None:
    facts = env_facts(clean_dataset().meta)
    assert (facts.env_id, facts.max_episode_steps, facts.can_terminate) == (
        "Hopper-v5",
        LIMIT,
        True,
    )
    assert facts.action_box is not None and facts.action_box.high.tolist() == [1.0] * 3
    healthy = json.dumps({"id": "Hopper-v5", "kwargs": {"terminate_when_unhealthy": False}})
    assert env_facts({"env_spec": healthy}).can_terminate is False
    assert env_facts({"env_spec": json.dumps({"id": "Unknown-v1"})}).can_terminate is None
    discrete = env_facts({"action_space": json.dumps({"type": "Discrete", "n": 2, "start": 0})})
    assert discrete.action_box is not None and discrete.action_box.high.tolist() == [1.0]


@pytest.mark.parametrize("kind", ["hopper", "point", "cartpole"])
def test_real_minari_datasets_are_clean_at_a_matching_gamma(make_test_dataset, kind: str) -> None:
    # The fixtures' time limits are 25-50 steps: gamma 0.9 (T_eff 9.5) matches them.
    data = load_transitions(make_test_dataset(kind).dataset_id)
    report = diagnose_dataset(data, gamma=0.9)
    assert report.exit_code == 0, [f.to_json() for f in report.findings]


def test_real_minari_hopper_pitfalls(make_test_dataset) -> None:
    data = load_transitions(make_test_dataset("hopper").dataset_id)
    # Its 30-step time limit is far below T_eff(0.99) = 99.5.
    assert _finding(diagnose_dataset(data), "episodes-short").severity == "warning"
    unterminated = diagnose_dataset(_terminals_as_timeouts(data), gamma=0.9)
    # The falls now read as time-outs, which also come before the time limit.
    assert unterminated.codes("warning") == ["no-terminals", "timeout-not-at-limit"]
    discrete = load_transitions(make_test_dataset("cartpole").dataset_id)
    bad_action = _edit(discrete, actions=_set(4, 2))
    assert (
        _finding(diagnose_dataset(bad_action, gamma=0.9), "actions-outside-box").severity == "error"
    )
