"""A small workflow with ``report.videos: true`` on real Dask worker processes: the report
embeds GIF animations of the trained policies and the data, and the doctor's findings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from offaug.pipeline.engine.graph import run_workflow
from offaug.pipeline.media.render import RenderUnavailable, gl_backend
from tests.pipeline.test_graph import Cluster, _workflow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, minari_root: Path) -> Iterator[Cluster]:
    started = Cluster(tmp_path_factory.mktemp("dask"), workers=2)
    yield started
    started.close()


@pytest.mark.slow
def test_a_run_with_videos_embeds_animations_and_the_doctor(
    cluster: Cluster, tmp_path: Path
) -> None:
    try:
        gl_backend()
    except RenderUnavailable as exc:
        pytest.skip(str(exc))
    workflow = _workflow(
        tmp_path,
        rollout={"episodes": 2, "tasks": 1},
        evaluation={"episodes": 2},
        report={"videos": True, "width": 64, "height": 48, "max_frames": 3},
    )
    run_dir = tmp_path / "run"
    first = run_workflow(workflow, run_dir, scheduler=cluster.address)
    # Every trained policy is filmed, the equal-steps plain arm (BC's 60 steps + 40) too.
    policies = {"bc-plain", "bc-augmented", "bc-baseline[100]"}
    media = {*(f"video:{p}" for p in policies), "video:data", "video:best", "doctor"}
    assert media <= set(first.executed)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    videos = metrics["videos"]
    assert set(videos["policies"]) == policies
    for record in videos["policies"].values():
        assert [c["label"] for c in record["clips"]] == ["best", "worst"]
    assert len(videos["data"]["original"]["clips"]) == 2
    assert len(videos["data"]["augmented"]["clips"]) == 2
    assert all(Path(p).parent == run_dir / "videos" for p in videos["data"]["paths"])
    assert metrics["doctor"]["source"]["findings"] and metrics["doctor"]["augmented"]
    report = (run_dir / "report.html").read_text(encoding="utf-8")
    # Two films per policy, four of the data, and the best policy's under the verdict.
    best = metrics["best_video"]
    assert best["arm"]["learner"] == "bc" and best["arm"]["recipe"] in {
        r.split("-", 1)[1] for r in policies
    }
    assert Path(best["clips"][0]["path"]).parent == run_dir / "videos" / "best"
    assert report.count('<img src="data:image/gif') == 2 * 3 + 4 + 1
    assert report.index("<h2>The best policy</h2>") < report.index("<h2>Videos</h2>")
    assert "<h2>Dataset doctor</h2>" in report

    again = run_workflow(workflow, run_dir, scheduler=cluster.address)
    assert media <= set(again.skipped) and again.executed == []
