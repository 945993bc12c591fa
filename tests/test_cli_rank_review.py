"""``offaug rank`` and ``offaug review`` as a user runs them, on two tiny trained checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import Client, LocalCluster
from typer.testing import CliRunner

from offaug.cli import app
from offaug.datasets import load_transitions
from offaug.pipeline.engine.workers import WorkerSetup
from tests.pipeline.point_policies import make_run

runner = CliRunner()


@pytest.fixture(scope="module")
def two_checkpoints(
    make_test_dataset, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[Path]]:
    root = tmp_path_factory.mktemp("cli-rank")
    dataset_id = make_test_dataset("point", "hdf5").dataset_id
    runs = []
    for name, steps in (("short", "2"), ("longer", "20")):
        out = root / name
        args = ["train", "bc", dataset_id, "--steps", steps, "--eval-every", "0", "--out", str(out)]
        trained = runner.invoke(app, [*args, "--log-every", steps, "--threads", "1"])
        assert trained.exit_code == 0, trained.output
        runs.append(out)
    return dataset_id, runs


def test_rank_prints_a_weighted_ranking_with_intervals(
    two_checkpoints: tuple[str, list[Path]],
) -> None:
    _, runs = two_checkpoints
    args = ["rank", str(runs[0]), str(runs[1] / "checkpoint.pt"), "--starts", "3"]
    ranked = runner.invoke(
        app, [*args, "--metric", "return:0.7,-length:0.3", "--workers", "1", "--json"]
    )
    assert ranked.exit_code == 0, ranked.output
    entries = json.loads(ranked.stdout)
    assert [e["rank"] for e in entries] == [1, 2]
    assert {e["path"] for e in entries} == {str(r / "checkpoint.pt") for r in runs}
    scores = [e["weighted"]["score"] for e in entries]
    assert scores == sorted(scores, reverse=True)
    for entry in entries:
        weighted = entry["weighted"]
        assert weighted["metric"] == "return:0.7,-length:0.3"
        assert weighted["low"] <= weighted["score"] <= weighted["high"]
        assert len(entry["rank_by"]) == 3


def test_rank_joins_a_running_scheduler_sets_its_workers_up_and_leaves_it_running(
    two_checkpoints: tuple[str, list[Path]],
) -> None:
    _, runs = two_checkpoints
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster.scheduler_address, timeout="30s") as client,
    ):
        args = ["rank", str(runs[0]), str(runs[1]), "--starts", "2", "--json"]
        ranked = runner.invoke(app, [*args, "--scheduler", cluster.scheduler_address])
        assert ranked.exit_code == 0, ranked.output
        assert [e["rank"] for e in json.loads(ranked.stdout)] == [1, 2]
        plugins = client.run(lambda dask_worker: sorted(dask_worker.plugins))
        assert plugins and all(WorkerSetup.name in names for names in plugins.values())
        assert len(client.scheduler_info()["workers"]) == 1


def test_rank_refuses_a_bad_metric_before_rolling_anything(
    two_checkpoints: tuple[str, list[Path]],
) -> None:
    _, runs = two_checkpoints
    refused = runner.invoke(app, ["rank", str(runs[0]), "--metric", "return:0.5,delay:0.5"])
    assert refused.exit_code == 2
    assert "'delay'" in refused.output and "return, success, length" in refused.output


def test_review_writes_a_page_and_applies_choices(
    two_checkpoints: tuple[str, list[Path]], tmp_path: Path
) -> None:
    dataset_id, runs = two_checkpoints
    data = load_transitions(dataset_id)
    models = {"bc": runs[0] / "checkpoint.pt", "train:bc-plain": runs[1] / "checkpoint.pt"}
    run = make_run(data, models, tmp_path / "run")
    reviewed = runner.invoke(app, ["review", str(run), "--starts", "2", "--top", "2"])
    assert reviewed.exit_code == 0, reviewed.output
    page = run / "review" / "review.html"
    assert page.read_text(encoding="utf-8").count('<input type="radio"') == 4
    candidates = json.loads((run / "review" / "review.json").read_text())["candidates"]
    chosen = {str(c["start"]): c["episode_id"] for c in candidates if c["policy"] == "longer"}
    choices = tmp_path / "choices.json"
    choices.write_text(json.dumps({"run": "run", "choices": chosen}))
    applied = runner.invoke(app, ["review", str(run), "--apply", str(choices)])
    assert applied.exit_code == 0, applied.output
    labelled = load_transitions(str(run / "review" / "labelled"))
    assert labelled.num_episodes == 4
    assert int(labelled.extras["label"].sum()) == sum(
        c["length"] for c in candidates if c["policy"] == "longer"
    )
