"""The media stages on real components: a BC policy trained and evaluated in Hopper-v5, a real
noisy rollout branched from dataset states, offscreen frames (EGL/OSMesa), and the dataset
doctor on shard sets built to have a pitfall. Every film keeps a few small frames.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import imageio.v3 as iio
import numpy as np
import pytest

from offaug.datasets import write_shard_set
from offaug.pipeline.contracts import AugmentedRef, DatasetRef, ModelRef
from offaug.pipeline.media.render import RenderUnavailable, gl_backend
from offaug.pipeline.outcome.summary import media_metrics
from offaug.pipeline.schema.rollout_section import RolloutModel
from offaug.pipeline.schema.run_sections import EvaluationModel, ReportModel
from offaug.pipeline.schema.sections import BCConfigModel, SourceConfig, TrainModel
from offaug.pipeline.stages import learning as stages
from offaug.pipeline.stages import rollouts as rollout_stages
from offaug.pipeline.stages.doctor import doctor_stage
from offaug.pipeline.stages.media import (
    render_best_policy_stage,
    render_data_stage,
    render_policy_stage,
    return_ranks,
)
from tests.datasets.test_doctor import clean_dataset

FILMS = ReportModel(videos=True, video_episodes=2, width=64, height=48, max_frames=3)


@pytest.fixture(scope="module")
def opengl() -> str:
    try:
        return gl_backend()
    except RenderUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def trained(
    make_test_dataset: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[DatasetRef, ModelRef, AugmentedRef]:
    """The hopper fixture as a stage sees it, a BC policy with 3 evaluation episodes, and two
    augmented episodes branched from dataset states."""
    root = tmp_path_factory.mktemp("media")
    data = stages.prepare_source(SourceConfig(dataset=make_test_dataset("hopper").dataset_id))
    bc = stages.train_bc(data, BCConfigModel(steps=20, hidden=(16, 16)), str(root / "bc"), 0)
    train = TrainModel(algorithms=("bc",), steps=20, configs={"bc": {"hidden": [16, 16]}})
    model = stages.train_offline(
        "bc", data, None, train, EvaluationModel(episodes=3), str(root / "bc-plain"), 0
    )
    rollout = RolloutModel(episodes=3, tasks=1, n_envs=3, start="dataset", noise="gaussian:0.2")
    shards = str(root / "augmented")
    shard = rollout_stages.rollout_shard(data, bc, rollout, shards, 0, 0)
    return data, model, rollout_stages.merge_rollouts([shard], shards, rollout)


def test_return_ranks_pick_best_worst_and_evenly_between() -> None:
    returns = [3.0, 9.0, 1.0, 5.0, 7.0]
    assert return_ranks(returns, 2) == [(1, "best"), (2, "worst")]
    assert return_ranks(returns, 1) == [(1, "best")]
    assert return_ranks(returns, 3) == [(1, "best"), (3, "rank 3 of 5"), (2, "worst")]
    assert [i for i, _ in return_ranks(returns, 9)] == [1, 4, 3, 0, 2]
    assert return_ranks([], 2) == []


def test_policy_films_are_its_best_and_worst_evaluation_episodes(
    opengl: str, trained: Any, tmp_path: Path
) -> None:
    data, model, _ = trained
    record = render_policy_stage(data, model, FILMS, tmp_path / "videos", 0)
    recorded = model.metrics["eval"]["returns"]
    assert [c["label"] for c in record["clips"]] == ["best", "worst"]
    best, worst = record["clips"]
    # The same reset seeds and the same greedy policy: each film is that evaluation episode.
    assert best["episode_return"] == pytest.approx(max(recorded), rel=1e-5)
    assert worst["episode_return"] == pytest.approx(min(recorded), rel=1e-5)
    assert best["evaluation_return"] == max(recorded)
    for clip in record["clips"]:
        frames = iio.imread(clip["path"], index=None)
        assert frames.shape[1:] == (48, 64, 3) and 1 <= frames.shape[0] <= 3
        assert clip["bytes"] == Path(clip["path"]).stat().st_size
    assert record["paths"] == [best["path"], worst["path"]] and record["kind"] == "files"


def test_the_best_policy_is_the_arm_of_highest_iqm_filmed_on_the_primary_seed(
    opengl: str, trained: Any, tmp_path: Path
) -> None:
    data, model, _ = trained

    def scored(score: float) -> ModelRef:
        evaluation = {**model.metrics["eval"], "normalised_score": score}
        return dataclasses.replace(model, metrics={**model.metrics, "eval": evaluation})

    # bc-plain has the single best run (90) but the lower IQM over its three seeds.
    arms = [("bc", "plain", s) for s in (0, 1, 2)] + [("bc", "aug", s) for s in (0, 1, 2)]
    models = [scored(v) for v in (90.0, 10.0, 12.0, 60.0, 55.0, 58.0)]
    record = render_best_policy_stage(data, models, arms, FILMS, tmp_path / "best", 0)
    assert record["arm"] == {
        "learner": "bc",
        "recipe": "aug",
        "seed": 0,
        "iqm": pytest.approx(np.mean([60.0, 55.0, 58.0])),
        "seeds": 3,
        "score": 60.0,
        "metric": "normalised_score",
    }
    (clip,) = record["clips"]
    # Its best evaluation episode: the primary seed's run, from its evaluation's reset seeds.
    assert clip["label"] == "best" and Path(clip["path"]).is_file()
    assert clip["episode_return"] == pytest.approx(max(model.metrics["eval"]["returns"]), rel=1e-5)
    metrics = media_metrics({"video:best": record}, FILMS)
    assert metrics["best_video"]["arm"]["recipe"] == "aug" and "videos" not in metrics
    unevaluated = dataclasses.replace(model, metrics={"train": {}})
    nothing = render_best_policy_stage(data, [unevaluated], arms[:1], FILMS, tmp_path, 0)
    assert set(nothing) == {"unavailable"}


def test_data_films_show_recorded_states_and_exact_replays(
    opengl: str, trained: Any, tmp_path: Path
) -> None:
    data, _, augmented = trained
    record = render_data_stage(data, augmented, FILMS, tmp_path / "videos", 0)
    original, rollouts = record["original"], record["augmented"]
    assert "set_state" in original["method"] and len(original["clips"]) == 2
    assert original["clips"][0]["episode_return"] >= original["clips"][1]["episode_return"]
    assert "replayed" in rollouts["method"] and len(rollouts["clips"]) == 2
    for clip in rollouts["clips"]:
        # Recorded actions from the recorded branch state give back the recorded observations.
        assert clip["replay_error"] < 1e-4
        frames = iio.imread(clip["path"], index=None)
        assert frames.std() > 5 and frames.shape[1:] == (48, 64, 3)
    assert len(record["paths"]) == 4 and all(Path(p).is_file() for p in record["paths"])
    metrics = media_metrics({"video:data": record, "video:bc-plain": {"unavailable": "x"}}, FILMS)
    assert metrics["videos"]["data"] is record and metrics["videos"]["max_report_mb"] == 20


def test_an_env_that_cannot_render_gives_an_unavailable_record(
    make_test_dataset: Any, tmp_path: Path
) -> None:
    data = stages.prepare_source(SourceConfig(dataset=make_test_dataset("point").dataset_id))
    record = render_data_stage(data, None, FILMS, tmp_path, 0)
    assert set(record) == {"unavailable"} and "rgb_array" in record["unavailable"]


def test_doctor_stage_reports_the_source_and_the_augmented_data(tmp_path: Path) -> None:
    clean = clean_dataset()
    scaled = write_shard_set(
        clean.with_columns(rewards=(clean.rewards * 1000).astype(np.float32)), tmp_path / "aug"
    )
    source = write_shard_set(clean, tmp_path / "source")
    data = DatasetRef(str(source.directory), len(clean), clean.num_episodes, "", False, {})
    augmented = AugmentedRef(str(scaled.directory), len(clean), clean.num_episodes, 1, "", {}, 0)
    report = doctor_stage(data, augmented, 0.99)
    assert report["source"]["worst"] == "info"
    findings = {f["code"]: f for f in report["augmented"]["findings"]}
    assert findings["reward-scale"]["severity"] == "warning"
    assert media_metrics({"doctor": report}, FILMS) == {"doctor": report}
    assert doctor_stage(data, None, 0.99)["augmented"] is None
