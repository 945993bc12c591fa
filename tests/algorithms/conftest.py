"""Fixtures the learner tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from offaug.datasets import Transitions, load_transitions


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread: on a busy machine, thread hand-offs cost more than these tiny nets."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def hopper(make_test_dataset) -> Transitions:
    """The small Hopper-v5 test dataset (real Minari HDF5, made by offaug's generator)."""
    return load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
