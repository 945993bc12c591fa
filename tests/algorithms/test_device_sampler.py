"""DeviceSampler: each source's share, uniform rows, per-member streams, weights."""

from __future__ import annotations

import numpy as np
import torch

from offaug.algorithms.training.device_sampler import DeviceSampler
from offaug.datasets import MixtureSampler, Transitions


def _tagged(n: int, tag: float, weights: bool = False) -> Transitions:
    """Observations all ``tag``; rewards the row index; next rows follow within one episode."""
    rows = np.arange(n, dtype=np.float32)
    return Transitions(
        observations=np.stack([np.full(n, tag, np.float32), rows], 1),
        actions=rows[:, None].copy(),
        rewards=rows,
        next_observations=np.stack([np.full(n, tag, np.float32), rows + 1], 1),
        terminals=np.zeros(n, dtype=bool),
        timeouts=np.zeros(n, dtype=bool),
        episode_ids=np.zeros(n, dtype=np.int64),
        importance_weight=np.linspace(0.1, 2.0, n, dtype=np.float32) if weights else None,
    )


def _sampler(sets: list[Transitions], batch: int, members: int, **kwargs: object) -> DeviceSampler:
    numpy_samplers = [MixtureSampler(sets, batch, seed=k, **kwargs) for k in range(members)]  # type: ignore[arg-type]
    generators = [torch.Generator().manual_seed(100 + k) for k in range(members)]
    return DeviceSampler(numpy_samplers, generators, torch.device("cpu"), with_sources=True)


def test_each_source_holds_its_share_of_every_batch() -> None:
    sampler = _sampler([_tagged(100, 0.0), _tagged(1000, 1.0)], 256, 3, mixing=[0.25, 0.75])
    batch = sampler.sample()
    assert batch["observations"].shape == (3, 256, 2)
    from_second = batch["observations"][..., 0] == 1.0
    assert from_second.sum(-1).tolist() == [192, 192, 192]
    assert torch.equal(batch["set_index"] == 1, from_second)


def test_rows_are_uniform_within_a_source_over_many_batches() -> None:
    sampler = _sampler([_tagged(10, 0.0), _tagged(30, 1.0)], 400, 2, mixing=[0.5, 0.5])
    # Every batch's first 200 rows are the first source's.
    rows = torch.cat([sampler.sample()["rewards"][:, :200] for _ in range(50)], 1)
    assert rows.max() < 10
    counts = np.bincount(rows.reshape(-1).numpy().astype(int), minlength=10)
    expected = rows.numel() / 10
    # Chi-square with 9 degrees of freedom: 27.9 is the 0.999 quantile.
    assert ((counts - expected) ** 2 / expected).sum() < 27.9


def test_members_draw_their_own_rows() -> None:
    sampler = _sampler([_tagged(10_000, 0.0)], 64, 3)
    index = sampler.indices()
    assert not torch.equal(index[0], index[1]) and not torch.equal(index[1], index[2])
    # A member's stream is its generator's alone: re-seeded, it draws the same rows again.
    sampler.generators[1].manual_seed(101)
    again = sampler.indices()
    assert torch.equal(again[1], index[1])


def test_next_actions_and_normalised_weights() -> None:
    sets = [_tagged(50, 0.0), _tagged(50, 1.0, weights=True)]
    sampler = _sampler(sets, 64, 2, mixing=[0.5, 0.5], use_weights=True, next_actions=True)
    batch = sampler.sample()
    second = batch["set_index"] == 1
    # Each weighted source's rows average 1 in every batch; unweighted rows stay 1.
    assert torch.allclose(batch["weights"][second].view(2, -1).mean(-1), torch.ones(2))
    assert torch.equal(batch["weights"][~second], torch.ones(64))
    # The successor's action is the next row's (the last row of an episode repeats its own).
    rows = batch["rewards"]
    expected = torch.where(rows < 49, rows + 1, rows)
    assert torch.equal(batch["next_actions"][..., 0], expected)
