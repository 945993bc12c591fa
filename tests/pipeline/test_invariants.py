"""The data's quadratic invariants and the projection of model predictions onto them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from offaug.datasets import load_transitions
from offaug.pipeline.models.dynamics import (
    DynamicsConfig,
    load_dynamics,
    save_dynamics,
    train_dynamics,
)
from offaug.pipeline.models.invariants import find_invariants
from offaug.pipeline.rollouts.model_rollouts import model_rollout
from offaug.pipeline.rollouts.noise import parse_noise


def _circle(n: int, seed: int = 0) -> npt.NDArray[np.float64]:
    """(cos θ, sin θ, θ̇, u) rows: one exact quadratic relation, two free dimensions."""
    rng = np.random.default_rng(seed)
    theta = rng.uniform(-math.pi, math.pi, n)
    return np.stack([np.cos(theta), np.sin(theta), rng.normal(0, 3, n), rng.normal(5, 1, n)], 1)


def test_the_circle_is_found_and_states_are_put_back_on_it() -> None:
    invariants = find_invariants(_circle(5000))
    assert invariants.count == 1
    on = torch.as_tensor(_circle(50, seed=1), dtype=torch.float32)
    # States on the circle stay where they are.
    np.testing.assert_allclose(invariants.project(on).numpy(), on.numpy(), atol=1e-5)
    off = on.clone()
    off[:, :2] *= torch.linspace(0.7, 1.3, 50)[:, None]
    off[:, 2] += 0.5
    projected = invariants.project(off)
    radius = projected[:, 0] ** 2 + projected[:, 1] ** 2
    np.testing.assert_allclose(radius.numpy(), 1.0, atol=1e-5)
    assert (
        invariants.violation(projected).abs().max() < 1e-5 < invariants.violation(off).abs().max()
    )
    # The free dimensions are untouched, and (cos, sin having near-equal spreads) the nearest
    # point on the circle keeps the angle.
    np.testing.assert_allclose(projected[:, 2:].numpy(), off[:, 2:].numpy(), atol=1e-5)
    angle = torch.atan2(projected[:, 1], projected[:, 0]) - torch.atan2(on[:, 1], on[:, 0])
    assert torch.remainder(angle + math.pi, 2 * math.pi).sub(math.pi).abs().max() < 0.05


def test_data_without_a_relation_or_with_too_few_rows_has_none() -> None:
    rng = np.random.default_rng(0)
    free = find_invariants(rng.normal(size=(5000, 4)))
    assert free.count == 0
    states = torch.as_tensor(rng.normal(size=(10, 4)))
    assert torch.equal(free.project(states), states)
    # Ten rows cannot tell a relation from a coincidence of the sample.
    assert find_invariants(_circle(10)).count == 0
    # A constant dimension is left out, not taken for a relation.
    constant = _circle(5000)
    constant[:, 3] = 2.0
    found = find_invariants(constant)
    assert found.count == 1 and found.dimensions.tolist() == [0, 1, 2]


class _SwingPolicy:
    """A fixed Gaussian policy for Pendulum-v1 (one action in [-2, 2])."""

    discrete = False

    def __call__(
        self, observations: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        mean = np.tanh(observations[:, 2:3]).astype(np.float64)
        return mean, np.full_like(mean, math.log(0.5))

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return (2.0 * actions).astype(np.float32)

    @property
    def log_abs_det(self) -> float:
        return math.log(2.0)


def test_long_model_rollouts_of_pendulum_stay_on_its_states(
    make_test_dataset, tmp_path: Path
) -> None:
    """A real Pendulum-v1 dataset keeps cos² + sin² = 1; the ensemble's 40-step rollouts drift
    off it, and stay on it with the projection. The invariants travel with the checkpoint."""
    data = load_transitions(make_test_dataset("pendulum", "hdf5").dataset_id)
    config = DynamicsConfig(members=3, hidden=(32, 32), steps=150, horizon=40, seed=0)
    model, _ = train_dynamics(data, config)
    assert model.invariants is not None and model.invariants.count == 1
    starts = np.asarray(data.observations[::9], dtype=np.float32)

    def radius_error(rollouts: Any) -> float:
        following = np.asarray(rollouts.next_observations, dtype=np.float64)
        return float(np.abs(np.hypot(following[:, 0], following[:, 1]) - 1.0).max())

    noise = parse_noise("gaussian:0.3")
    drifting = model_rollout(model, _SwingPolicy(), starts, noise=noise)
    model.config = dataclasses.replace(config, invariants=True)
    kept = model_rollout(model, _SwingPolicy(), starts, noise=noise)
    assert len(kept) > 0 and radius_error(kept) < 1e-4 < radius_error(drifting)
    loaded = load_dynamics(save_dynamics(model, tmp_path / "dynamics.pt"))
    assert loaded.invariants is not None
    assert torch.equal(loaded.invariants.weights, model.invariants.weights)
