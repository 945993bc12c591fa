"""TorchBatch: the one conversion of a sampler's numpy batch into tensors."""

from __future__ import annotations

import numpy as np
import torch

from offaug.algorithms.batch import TorchBatch
from offaug.datasets import MixtureSampler, Transitions


def _tagged(n: int, tag: float) -> Transitions:
    """Transitions whose observations all equal ``tag`` and whose rewards are the row index."""
    return Transitions(
        observations=np.full((n, 3), tag, dtype=np.float32),
        actions=np.zeros((n, 2), dtype=np.float32),
        rewards=np.arange(n, dtype=np.float32),
        next_observations=np.full((n, 3), tag, dtype=np.float32),
        terminals=np.zeros(n, dtype=bool),
        timeouts=np.zeros(n, dtype=bool),
        episode_ids=np.zeros(n, dtype=np.int64),
    )


def test_torch_batch_is_the_one_conversion() -> None:
    batch = MixtureSampler([_tagged(20, 2.0)], 8).sample()
    tensors = TorchBatch.from_batch(batch)
    assert tensors.observations.dtype == torch.float32 and tensors.observations.shape == (8, 3)
    assert tensors.terminals.dtype == torch.float32
    assert torch.equal(tensors.rewards, torch.from_numpy(batch.rewards))
