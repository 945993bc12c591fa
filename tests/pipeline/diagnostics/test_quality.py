"""The quality report on real datasets: real transitions replay exactly in their own env, shuffled
ones do not, and data whose state cannot be had says so."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from offaug.datasets import load_transitions
from offaug.pipeline.diagnostics.coverage import standardiser
from offaug.pipeline.diagnostics.quality import QualitySettings, quality_report
from offaug.pipeline.diagnostics.sampling import sample_indices
from offaug.pipeline.report import render_html
from offaug.pipeline.rollouts.env_state import load_with_states

SMALL = QualitySettings(max_rows=300, max_states=2000)


def _sampled_rows(n: int) -> np.ndarray:
    """The rows quality_report steps with SMALL: its first draw from its seed's generator."""
    return sample_indices(n, SMALL.max_rows, np.random.default_rng(SMALL.seed))


@pytest.fixture(scope="module")
def hopper(make_test_dataset):
    """The hopper test dataset with its recorded MuJoCo states, and without them."""
    dataset_id = make_test_dataset("hopper", "hdf5").dataset_id
    with_states, kind = load_with_states(dataset_id)
    assert kind is not None and kind.name == "mujoco"
    return with_states, load_transitions(dataset_id)


def test_real_transitions_replay_exactly_from_recorded_states(hopper) -> None:
    with_states, source = hopper
    report = quality_report(with_states, source, settings=SMALL)
    assert report["state"] == {
        "kind": "recorded",
        "reason": None,
        "env": "Hopper-v5",
        "rows_checked": 300,
        "rows_unset": 0,
    }
    # Float tolerance: the dataset stores float32 observations.
    assert report["state_error"]["max"] < 1e-5
    assert report["dynamics_error"]["max"] < 1e-5
    assert report["reward_error"]["max"] < 1e-5
    assert report["terminal_mismatch"] == 0.0
    # The data against itself: every transition is its own nearest neighbour.
    assert report["novelty"]["max"] == 0.0 and report["novelty"]["unit"] > 0
    assert report["terminal_rate"]["augmented"] == report["terminal_rate"]["source"]
    assert report["returns"]["augmented"] == report["returns"]["source"]
    assert report["returns"]["source"]["episodes"] == source.num_episodes


def test_states_rebuilt_from_hoppers_observations_replay_too(hopper) -> None:
    _, source = hopper
    report = quality_report(source, source, settings=SMALL)
    assert report["state"]["kind"] == "rebuilt" and report["state"]["rows_unset"] == 0
    assert report["dynamics_error"]["max"] < 1e-5
    assert report["reward_error"]["max"] < 1e-5


def test_shuffled_next_states_and_rewards_show_large_errors(hopper) -> None:
    with_states, source = hopper
    order = np.random.default_rng(0).permutation(len(with_states))
    shuffled = dataclasses.replace(
        with_states,
        next_observations=np.asarray(with_states.next_observations)[order],
        rewards=np.asarray(with_states.rewards)[order],
    )
    report = quality_report(shuffled, source, settings=SMALL)
    assert report["state"]["kind"] == "recorded"
    # About a std per dimension away from where the env goes, and novel against the data.
    assert report["dynamics_error"]["median"] > 0.5
    assert report["reward_error"]["relative"] > 0.3
    assert report["novelty"]["median"] > 1.0


def test_a_model_rollouts_raw_reward_is_the_one_compared(hopper) -> None:
    _, source = hopper
    # The penalised reward a learner trains on differs; the unpenalised one is the env's.
    penalised = dataclasses.replace(
        source,
        rewards=np.asarray(source.rewards) - 1.0,
        extras={"raw_reward": np.asarray(source.rewards)},
    )
    report = quality_report(penalised, source, settings=SMALL)
    assert report["returns"]["reward"] == "raw_reward"
    assert report["reward_error"]["max"] < 1e-5
    assert report["returns"]["augmented"] == report["returns"]["source"]


def test_pendulum_state_is_rebuilt_from_cos_sin_and_rate(make_test_dataset) -> None:
    source = load_transitions(make_test_dataset("pendulum", "hdf5").dataset_id)
    report = quality_report(source, source, settings=SMALL)
    assert report["state"]["kind"] == "rebuilt" and report["state"]["rows_unset"] == 0
    assert report["dynamics_error"]["max"] < 1e-5
    assert report["reward_error"]["max"] < 1e-5


def test_states_off_the_ones_the_env_can_be_in_show_as_a_state_error(make_test_dataset) -> None:
    """Pendulum's observation (cos, sin, rate) scaled off the unit circle, as a model's long
    rollouts drift: the rebuilt angle's observation is on the circle, so the state error is the
    scaling's, every such row is unset and left out of the dynamics error."""
    source = load_transitions(make_test_dataset("pendulum", "hdf5").dataset_id)
    observations = np.array(source.observations, dtype=np.float32)
    off = np.arange(len(source)) % 3 == 0  # a third of the rows, 20 % off the circle
    observations[off, :2] *= 1.2
    drifted = dataclasses.replace(source, observations=observations)
    report = quality_report(drifted, source, settings=SMALL)
    state = report["state"]
    sampled = _sampled_rows(len(source))
    moved = sampled[off[sampled]]
    assert state["rows_unset"] == len(moved) and 0 < len(moved) < state["rows_checked"]
    _, std = standardiser(np.asarray(source.observations, dtype=np.float64))
    # The rebuilt state's observation is the row's on the circle (its angle's cos and sin, the
    # rate unchanged): the gap in the first two of the three dimensions.
    row = observations[moved].astype(np.float64)
    on_circle = row[:, :2] / np.hypot(row[:, 0], row[:, 1])[:, None]
    gaps = np.sqrt(np.sum(((on_circle - row[:, :2]) / std[:2]) ** 2, axis=1) / 3)
    assert report["state_error"]["max"] == pytest.approx(gaps.max(), rel=1e-3)
    assert report["state_error"]["median"] < 1e-5  # two thirds of the rows are untouched
    assert report["dynamics_error"]["max"] < 1e-5  # only the rows on the circle are stepped


def test_without_a_state_the_report_says_why(make_test_dataset) -> None:
    # PointGoal's env has no settable state: the dynamics checks are left out, not guessed.
    source = load_transitions(make_test_dataset("point", "hdf5").dataset_id)
    report = quality_report(source, source, settings=SMALL)
    assert report["state"]["kind"] == "not available"
    assert "rebuild its state" in report["state"]["reason"]
    assert report["dynamics_error"] is None and report["reward_error"] is None
    assert report["terminal_mismatch"] is None
    assert report["novelty"] is not None and report["ood"] is not None
    # Data that names no environment at all.
    report = quality_report(source, source, {}, settings=SMALL)
    assert report["state"]["kind"] == "not available"
    assert report["state"]["reason"].startswith("no environment")


def test_the_report_page_has_a_quality_row_per_recipe_and_source(hopper) -> None:
    with_states, source = hopper
    report = quality_report(with_states, source, settings=SMALL)
    missing = quality_report(source, source, {}, settings=SMALL)
    page = render_html(
        {"recipes": {"augmented": {"quality": {"simulator": report, "state_noise": missing}}}}
    )
    assert "Augmented data quality" in page
    assert "<td>simulator</td><td>recorded</td>" in page
    assert "not available" in page and "no environment" in page
    assert "No quality report" in render_html({"recipes": {"plain": {"quality": None}}})
