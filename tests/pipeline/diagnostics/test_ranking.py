"""Ranking: by return then success; sequential and Dask evaluation agree."""

from __future__ import annotations

from offaug.pipeline import diagnostics as diag
from tests.pipeline.diagnostics.helpers import (
    Hopper,
)


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
