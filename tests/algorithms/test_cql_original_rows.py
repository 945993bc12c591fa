"""CQL's ``conservative_rows: original`` (COMBO's penalty): the log-sum-exp pushed down at every
row's state, the data actions pushed up on the first source's rows only."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from offaug.algorithms.base import spaces_from_transitions
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.learners.cql import CQL, CQLConfig
from offaug.algorithms.learners.cql_losses import (
    conservative_gap,
    conservative_penalty,
    original_rows_gap,
)
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.algorithms.training.fused_loop import train_fused
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import MixtureSampler, Transitions

SMALL = {"hidden": (32, 32), "batch_size": 64, "n_action_samples": 4, "lagrange": False}


pytestmark = pytest.mark.usefixtures("one_thread")


def _halves(data: Transitions) -> tuple[Transitions, Transitions]:
    """The first episodes as "original" data and the rest as a second ("augmented") source."""
    cut = int(data.episode_bounds()[3])
    return data.slice(0, cut), data.slice(cut, len(data.rewards))


def test_the_penalty_pushes_down_everywhere_and_up_on_original_rows_only() -> None:
    torch.manual_seed(0)
    e, s, b = 2, 6, 8
    q_data, q_sampled, log_density = torch.randn(e, b), torch.randn(e, s, b), torch.randn(s, b)
    weights = torch.rand(b) + 0.5
    source = torch.tensor([0, 0, 0, 1, 1, 0, 1, 1])
    gap = conservative_gap(q_data, q_sampled, log_density)
    combo = original_rows_gap(gap, q_data, weights, source)
    # By hand: E_w[logsumexp] over every row minus the weighted mean of Q over source 0's rows.
    lse = torch.logsumexp(q_sampled - log_density, dim=1)  # (E, B)
    original = source == 0
    push_up = (q_data[:, original] * weights[original]).sum(1) / weights[original].sum()
    expected = 5.0 * ((lse * weights).mean(1).sum() - push_up.sum() - e * 10.0)
    torch.testing.assert_close(conservative_penalty(combo, None, 5.0, 10.0), expected)
    # One source: CQL's own penalty (training weights average 1 within a source).
    weights = weights / weights.mean()
    torch.testing.assert_close(
        conservative_penalty(original_rows_gap(gap, q_data, weights, source * 0), None, 5.0, 10.0),
        conservative_penalty(gap, weights, 5.0, 10.0),
    )


def test_on_one_source_the_losses_are_cqls(hopper: Transitions) -> None:
    spaces = spaces_from_transitions(hopper.meta, hopper.observations.shape[1], hopper.actions)
    batch = TorchBatch.from_batch(MixtureSampler([hopper], 64, seed=0).sample(), with_sources=True)
    losses = {}
    for rows in ("all", "original"):
        torch.manual_seed(0)
        trainer = CQL(spaces, CQLConfig(**SMALL, conservative_rows=rows), device="cpu")
        torch.manual_seed(1)
        losses[rows] = trainer.losses(batch)
    for field in dataclasses.fields(losses["all"]):
        if getattr(losses["all"], field.name) is not None:
            torch.testing.assert_close(
                getattr(losses["original"], field.name), getattr(losses["all"], field.name)
            )


def test_config_refuses_unknown_rows() -> None:
    with pytest.raises(ValueError, match="conservative_rows"):
        CQLConfig(conservative_rows="augmented")  # type: ignore[arg-type]


def test_training_reads_sources_single_and_fused_alike(hopper: Transitions, tmp_path: Path) -> None:
    """Both training loops hand the losses each row's source: a fused member trains as its
    single-seed run, and either differs from CQL's penalty on the same batches."""
    original, augmented = _halves(hopper)
    options = TrainOptions(steps=20, log_every=10, eval_every=0, mixing=(0.5, 0.5), threads=1)
    config = {**SMALL, "conservative_rows": "original"}
    fused = train_fused(
        "cql",
        [original, augmented],
        tmp_path / "fused",
        config=config,
        options=dataclasses.replace(options, seeds=(0, 1)),
    )
    runs = {
        rows: train(
            "cql",
            [original, augmented],
            tmp_path / rows,
            config={**SMALL, "conservative_rows": rows},
            options=options,
        )
        for rows in ("original", "all")
    }
    mine = load_trainer(fused.runs[0].checkpoint).critic.state_dict()
    theirs = load_trainer(runs["original"].checkpoint).critic.state_dict()
    cqls = load_trainer(runs["all"].checkpoint).critic.state_dict()
    for name, value in mine.items():
        torch.testing.assert_close(value, theirs[name], rtol=1e-4, atol=1e-5)
    assert any(not torch.allclose(theirs[n], cqls[n], rtol=1e-3) for n in theirs)
