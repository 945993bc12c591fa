"""Ranking: by return then success, or by a weighted score with its bootstrap interval;
sequential and Dask evaluation agree; trained policies of known quality come out in order."""

from __future__ import annotations

import numpy as np
import pytest

from offaug.pipeline import diagnostics as diag
from offaug.pipeline.schema.rank_metric import parse_rank_metric
from tests.pipeline.diagnostics.helpers import (
    Hopper,
)
from tests.pipeline.point_policies import QUALITY_ORDER, PointPolicies


def test_rank_results_orders_by_return_then_success() -> None:
    results = [
        {"name": "a", "mean_return": 1.0, "success_rate": 1.0, "mean_length": 10.0},
        {"name": "b", "mean_return": 5.0, "success_rate": 0.0, "mean_length": 3.0},
        {"name": "c", "mean_return": 5.0, "success_rate": 0.5, "mean_length": 3.0},
    ]
    ranked = diag.rank_results(results)
    assert [r["name"] for r in ranked] == ["c", "b", "a"]
    assert ranked[0]["rank_by"] == {"return": 1, "success": 2, "length": 2}
    assert ranked[2]["rank_by"] == {"return": 3, "success": 1, "length": 1}


def test_rank_checkpoints_sequential_and_on_dask_agree(hopper: Hopper) -> None:
    checkpoints = [hopper.bc.path] + ([hopper.critic.path] if hopper.critic else [])
    sequential = diag.rank_checkpoints(checkpoints, hopper.ref.meta, episodes=2, seeds=[0, 100])
    assert len(sequential) == len(checkpoints)
    returns = [r["mean_return"] for r in sequential]
    assert returns == sorted(returns, reverse=True)
    assert [r["rank"] for r in sequential] == list(range(1, len(checkpoints) + 1))

    from distributed import Client

    with Client(
        processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0"
    ) as client:
        parallel = diag.rank_checkpoints(
            checkpoints, hopper.ref.meta, episodes=2, seeds=[0, 100], client=client
        )
    assert parallel == sequential


def _results(**episodes: dict[str, list[float]]) -> list[dict[str, object]]:
    return [
        {
            "name": name,
            "returns": values["returns"],
            "successes": values["successes"],
            "lengths": values["lengths"],
            "mean_return": float(np.mean(values["returns"])),
            "success_rate": float(np.mean(values["successes"])),
            "mean_length": float(np.mean(values["lengths"])),
        }
        for name, values in episodes.items()
    ]


def test_weighted_scores_scale_each_metric_over_every_episode() -> None:
    results = _results(
        a={"returns": [0.0, 10.0], "successes": [1, 1], "lengths": [5, 5]},
        b={"returns": [5.0, 5.0], "successes": [1, 1], "lengths": [5, 15]},
    )
    metric = parse_rank_metric("return:0.5,success:0.25,-length:0.25")
    a, b = diag.weighted_scores(results, metric)
    # return scaled over [0, 10]; success is 1 everywhere (no information: 0); shorter is better.
    assert a.scaled_means == {"return": 0.5, "success": 0.0, "-length": 1.0}
    assert b.scaled_means == {"return": 0.5, "success": 0.0, "-length": 0.5}
    assert a.score == pytest.approx(0.5 * 0.5 + 0.25 * 1.0)
    assert b.score == pytest.approx(0.5 * 0.5 + 0.25 * 0.5)
    ranked = diag.rank_results(results, metric)
    assert [r["name"] for r in ranked] == ["a", "b"]
    assert ranked[0]["weighted"] is not None
    assert ranked[0]["weighted"]["metric"] == "return:0.5,success:0.25,-length:0.25"
    longer = diag.rank_results(results, parse_rank_metric("length:1"))
    assert [r["name"] for r in longer] == ["b", "a"]


def test_weighted_interval_brackets_the_score_and_repeats_with_its_seed() -> None:
    rng = np.random.default_rng(3)
    results = _results(
        **{
            name: {
                "returns": list(rng.normal(mean, 3.0, size=12)),
                "successes": list(rng.random(12) < 0.5),
                "lengths": list(rng.integers(10, 50, size=12)),
            }
            for name, mean in (("x", 0.0), ("y", 2.0), ("z", 4.0))
        }
    )
    metric = parse_rank_metric("return:0.6,success:0.3,length:0.1")
    scores = diag.weighted_scores(results, metric, seed=5)
    for score in scores:
        assert score.low <= score.score <= score.high
        assert score.low < score.high
    assert diag.weighted_scores(results, metric, seed=5) == scores
    assert diag.weighted_scores(results, metric, seed=6) != scores


def test_weighted_ranking_needs_the_same_start_states() -> None:
    results = _results(
        a={"returns": [1.0, 2.0], "successes": [1, 1], "lengths": [5, 5]},
        b={"returns": [1.0], "successes": [1], "lengths": [5]},
    )
    with pytest.raises(ValueError, match="same start states"):
        diag.rank_results(results, parse_rank_metric("return:1"))


def test_default_ranking_carries_no_weighted_score() -> None:
    results = _results(a={"returns": [1.0], "successes": [1], "lengths": [5]})
    assert diag.rank_results(results)[0]["weighted"] is None


def test_rank_orders_three_trained_policies_as_direct_evaluation_does(
    point_policies: PointPolicies,
) -> None:
    paths = [str(point_policies.checkpoints[name]) for name in reversed(QUALITY_ORDER)]
    meta = point_policies.data.meta
    metric = parse_rank_metric("return:0.6,success:0.3,length:0.1")
    from distributed import Client

    with Client(
        processes=False, n_workers=2, threads_per_worker=1, dashboard_address=":0"
    ) as client:
        ranked = diag.rank_checkpoints(
            paths, meta, episodes=6, seeds=[0], client=client, metric=metric
        )
    by_return = diag.rank_checkpoints(
        paths, meta, episodes=6, seeds=[0], metric=parse_rank_metric("return:1")
    )
    names = {str(path): name for name, path in point_policies.checkpoints.items()}
    assert [names[r["name"]] for r in ranked] == list(QUALITY_ORDER)
    assert [names[r["name"]] for r in by_return] == list(QUALITY_ORDER)
    # Direct evaluation of each policy alone, from the same reset seeds, gives the same order.
    direct = {p: diag.evaluate_checkpoint(p, meta, list(range(6)))["mean_return"] for p in paths}
    assert [r["name"] for r in ranked] == sorted(direct, key=lambda p: -(direct[p] or 0.0))
    for entry in ranked:
        weighted = entry["weighted"]
        assert weighted is not None
        assert weighted["low"] <= weighted["score"] <= weighted["high"]
        assert entry["mean_return"] == pytest.approx(direct[entry["name"]])
