"""Review: a page of each start state's best rollouts, and the picks kept as labelled data.

The run directory is made of real stage records over the three trained point policies. The
browser check runs when ``chromium`` is on PATH.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import DataError, Source, load_transitions
from offaug.pipeline.outcome.review import (
    LABEL_COLUMN,
    ReviewOptions,
    ReviewResult,
    apply_choices,
    review_run,
)
from tests.pipeline.diagnostics.helpers import checkpoint
from tests.pipeline.point_policies import PointPolicies, make_run


@pytest.fixture(scope="module")
def reviewed(
    point_policies: PointPolicies, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, ReviewResult]:
    stages = {"bc": "still", "train:bc-plain": "toward", "train:bc-augmented": "away"}
    models = {stage: point_policies.checkpoints[name] for stage, name in stages.items()}
    run = make_run(point_policies.data, models, tmp_path_factory.mktemp("run"))
    return run, review_run(run, ReviewOptions(starts=2, top=2))


def test_page_holds_the_top_candidates_of_each_start_state(
    reviewed: tuple[Path, ReviewResult],
) -> None:
    run, result = reviewed
    assert result.page == run / "review" / "review.html"
    assert len(result.candidates) == 4
    for start in (0, 1):
        shown = [c for c in result.candidates if c.start == start]
        # Best first; the policy that walks away from the goal is never among the top two.
        assert [c.policy for c in shown] == ["toward", "still"]
        assert shown[0].episode_return > shown[1].episode_return
    page = result.page.read_text(encoding="utf-8")
    assert len(re.findall(r'<input type="radio"', page)) == 4
    assert "http://" not in page and "https://" not in page
    # PointGoal cannot render: the page says so and shows return curves.
    assert result.media_note is not None and "No animations" in result.media_note
    assert page.count("data:image/png;base64,") == 4
    written = json.loads((run / "review" / "review.json").read_text())
    assert [c["episode_id"] for c in written["candidates"]] == [0, 1, 2, 3]
    candidates = load_transitions(str(result.shard_set))
    assert candidates.num_episodes == 4
    assert set(candidates.source.tolist()) == {Source.REVIEWED}
    returns = [
        float(candidates.rewards[candidates.episode_ids == c.episode_id].sum())
        for c in result.candidates
    ]
    assert returns == pytest.approx([c.episode_return for c in result.candidates], rel=1e-5)


def test_applied_choices_become_a_labelled_training_source(
    reviewed: tuple[Path, ReviewResult], point_policies: PointPolicies, tmp_path: Path
) -> None:
    run, _ = reviewed
    # The second candidate of start 0 chosen; start 1 left unmarked (so left out).
    choices = tmp_path / "choices.json"
    choices.write_text(json.dumps({"run": run.name, "choices": {"0": 1}}))
    labelled = apply_choices(choices, run / "review")
    assert Path(labelled.directory) == run / "review" / "labelled"
    data = load_transitions(labelled.directory)
    assert sorted(set(data.episode_ids.tolist())) == [0, 1]
    labels = np.asarray(data.extras[LABEL_COLUMN])
    assert labels.dtype == np.int8
    assert np.array_equal(labels, (data.episode_ids == 1).astype(np.int8))
    assert set(data.source.tolist()) == {int(Source.REVIEWED)} == {3}
    assert data.meta["env_spec"] == point_policies.data.meta["env_spec"]
    # Another training source with its own mixing share.
    dataset_id = str(point_policies.data.meta["dataset_id"])
    trained = train(
        "bc",
        [dataset_id, labelled.directory],
        tmp_path / "bc-reviewed",
        config={"hidden": (16, 16), "batch_size": 32},
        options=TrainOptions(steps=5, mixing=(0.8, 0.2), eval_every=0, log_every=5),
    )
    assert trained.checkpoint.is_file()


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"choices": {"0": 2}}, "not a candidate of start state 0"),
        ({"choices": {"5": 0}}, "not a candidate of start state 5"),
        ({"picks": {}}, "not a choices file"),
        ({"choices": {}}, "no start state is marked"),
    ],
)
def test_bad_choices_are_refused(
    reviewed: tuple[Path, ReviewResult], tmp_path: Path, document: object, message: str
) -> None:
    run, _ = reviewed
    choices = tmp_path / "choices.json"
    choices.write_text(json.dumps(document))
    with pytest.raises(DataError, match=message):
        apply_choices(choices, run / "review", out=tmp_path / "labelled")


def test_page_shows_its_radio_buttons_in_headless_chromium(
    reviewed: tuple[Path, ReviewResult], tmp_path: Path
) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not on PATH (CI installs Debian's chromium package)")
    _, result = reviewed
    dom = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            result.page.absolute().as_uri(),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert len(re.findall(r'<input type="radio"', dom)) == 4
    assert 'id="save"' in dom
    # The page's script ran: it wrote the count of marked start states.
    assert "0 of 2 start states marked" in dom


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ReviewOptions(starts=0)
    assert dataclasses.replace(ReviewOptions(), top=1).top == 1


def test_mujoco_candidates_are_animated(make_test_dataset, tmp_path: Path) -> None:
    dataset_id = make_test_dataset("hopper", "hdf5").dataset_id
    data = load_transitions(dataset_id)
    config = {"policy": "gaussian", "hidden": (8, 8)}
    models = {
        stage: Path(checkpoint("bc", data, tmp_path / name / "checkpoint.pt", config).path)
        for stage, name in (("bc", "bc"), ("train:bc-plain", "bc-plain"))
    }
    run = make_run(data, models, tmp_path / "run")
    result = review_run(run, ReviewOptions(starts=1, top=2))
    if result.media_note is not None:
        pytest.skip(f"no offscreen rendering here: {result.media_note}")
    page = result.page.read_text(encoding="utf-8")
    assert page.count('<img src="data:image/gif;base64,') == 2
    assert "data:image/png" not in page
