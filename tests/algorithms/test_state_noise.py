"""S4RL state noise: per-dimension scale, independence of s and s', exact repetition, training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.algorithms.training.state_noise import StateNoise, StateNoiser, observation_std
from offaug.datasets import MixtureSampler, ShardSet, Transitions, load_transitions, write_shard_set

STD = np.array([0.5, 2.0, 0.0, 10.0])
ROWS = 40_000


def _zero_batch(rows: int = ROWS) -> TorchBatch:
    zeros = torch.zeros(rows, len(STD))
    flags = torch.zeros(rows)
    return TorchBatch(zeros, torch.zeros(rows, 1), flags, zeros.clone(), flags, flags, flags + 1)


def _noise(kind: str, scale: float = 0.1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    noiser = StateNoiser(StateNoise(kind, scale), STD, torch.device("cpu"), seed)  # type: ignore[arg-type]
    noisy = noiser(_zero_batch())
    return noisy.observations.numpy(), noisy.next_observations.numpy()


def test_gaussian_noise_has_each_dimensions_scale() -> None:
    observations, next_observations = _noise("gaussian", 0.1)
    for drawn in (observations, next_observations):
        # The std of 40,000 draws is within 2% of sigma (about 5 standard errors).
        np.testing.assert_allclose(drawn.std(0), 0.1 * STD, rtol=0.02)
        np.testing.assert_allclose(drawn.mean(0), 0.0, atol=0.1 * STD.max() * 0.03)
        assert (drawn[:, 2] == 0).all()  # a constant dimension stays put


def test_uniform_noise_is_bounded_by_each_dimensions_scale() -> None:
    observations, _ = _noise("uniform", 0.1)
    bound = 0.1 * STD
    assert (np.abs(observations) <= bound + 1e-6).all()
    # U(-b, b) has std b / sqrt(3) and fills its interval.
    np.testing.assert_allclose(observations.std(0), bound / math.sqrt(3), rtol=0.02)
    np.testing.assert_allclose(np.abs(observations).max(0), bound, rtol=0.01)


def test_observations_and_next_observations_get_independent_noise() -> None:
    observations, next_observations = _noise("gaussian")
    for dim in (0, 1, 3):
        correlation = np.corrcoef(observations[:, dim], next_observations[:, dim])[0, 1]
        assert abs(correlation) < 0.025  # ~5 standard errors of a zero correlation
    # Rows and dimensions are independent too.
    assert abs(np.corrcoef(observations[:, 0], observations[:, 1])[0, 1]) < 0.025


def test_the_same_seed_draws_the_same_noise() -> None:
    first, _ = _noise("gaussian", seed=4)
    again, _ = _noise("gaussian", seed=4)
    other, _ = _noise("gaussian", seed=5)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_observation_std_pools_every_shard(make_test_dataset, tmp_path: Path) -> None:
    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id, cache=False)
    write_shard_set(data, tmp_path / "set", rows_per_shard=170)
    shard_set = ShardSet.open(tmp_path / "set")
    assert len(shard_set.shards) > 2
    expected = data.observations.astype(np.float64).std(0)
    np.testing.assert_allclose(observation_std(shard_set.iter_shards()), expected, rtol=1e-9)


def _with_observations(data: Transitions, observations: np.ndarray) -> Transitions:
    return Transitions(
        **{**data.columns(), "observations": observations, "next_observations": observations}
    )


def test_discrete_and_image_observations_are_refused(make_test_dataset) -> None:
    data = load_transitions(make_test_dataset("cartpole", "hdf5").dataset_id, cache=False)
    n = len(data)
    discrete = _with_observations(data, np.zeros(n, dtype=np.int64))
    with pytest.raises(ValueError, match="Box"):
        observation_std([discrete])
    images = _with_observations(data, np.zeros((n, 4, 4, 1), dtype=np.float32))
    with pytest.raises(ValueError, match="images"):
        observation_std([images])


@pytest.mark.parametrize("text", ["gaussian", "gaussian:0", "normal:0.1", "uniform:-1", "0.1"])
def test_bad_state_noise_text_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="KIND:SCALE"):
        StateNoise.parse(text)


def test_state_noise_text_parses() -> None:
    assert StateNoise.parse("gaussian:0.003") == StateNoise("gaussian", 0.003)
    assert StateNoise.parse("uniform:0.01") == StateNoise("uniform", 0.01)


def _train(dataset: str, out: Path, steps: int, resume: bool = False) -> list[dict[str, float]]:
    options = TrainOptions(
        steps=steps,
        seed=3,
        state_noise=StateNoise("gaussian", 0.05),
        eval_every=0,
        log_every=10,
        checkpoint_every=10,
    )
    train(
        "cql",
        [dataset],
        out,
        config={"hidden": (32, 32), "batch_size": 32},
        options=options,
        resume=resume,
    )
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _without_speed(lines: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in line.items() if k != "steps_per_s"} for line in lines]


def test_a_learner_trains_with_state_noise_and_repeats_exactly(
    make_test_dataset, tmp_path: Path
) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    first = _train(dataset, tmp_path / "a", 20)
    assert all(math.isfinite(v) for line in first for v in line.values() if not isinstance(v, str))
    again = _train(dataset, tmp_path / "b", 20)
    assert _without_speed(first) == _without_speed(again)
    # Resuming half-way continues the same noise (its generator is in the checkpoint).
    _train(dataset, tmp_path / "c", 10)
    resumed = _train(dataset, tmp_path / "c", 20, resume=True)
    assert _without_speed(resumed) == _without_speed(first)
    a, c = (
        load_trainer(tmp_path / "a" / "checkpoint.pt"),
        load_trainer(tmp_path / "c" / "checkpoint.pt"),
    )
    for x, y in zip(a.actor.parameters(), c.actor.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    recorded = json.loads((tmp_path / "a" / "config.json").read_text())["options"]
    assert recorded["state_noise"] == {"kind": "gaussian", "scale": 0.05}


def test_state_noise_leaves_the_sampled_batch_and_other_columns_alone(make_test_dataset) -> None:
    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id, cache=False)
    batch = TorchBatch.from_batch(MixtureSampler([data], 16, seed=0).sample())
    before = batch.observations.clone()
    noiser = StateNoiser(
        StateNoise("gaussian", 0.05), observation_std([data]), torch.device("cpu"), 0
    )
    noisy = noiser(batch)
    assert not torch.equal(noisy.observations, batch.observations)
    assert not torch.equal(noisy.next_observations, batch.next_observations)
    # Out of place: what was sampled is unchanged; actions, rewards and flags pass through.
    torch.testing.assert_close(batch.observations, before, rtol=0, atol=0)
    for name in ("actions", "rewards", "terminals", "timeouts", "weights"):
        assert getattr(noisy, name) is getattr(batch, name)


def test_a_noisy_copy_has_the_loops_noise_and_no_recorded_states(make_test_dataset) -> None:
    from offaug.algorithms.training.state_noise import noisy_copy
    from offaug.pipeline.rollouts.env_state import load_with_states

    data, _ = load_with_states(make_test_dataset("hopper").dataset_id)
    assert "infos/qpos" in data.extras
    noisy = noisy_copy(data, StateNoise("gaussian", 0.1), seed=0)
    assert not any(name.startswith("infos/") for name in noisy.extras)
    std = observation_std([data])
    for clean, perturbed in (
        (data.observations, noisy.observations),
        (data.next_observations, noisy.next_observations),
    ):
        offsets = (np.asarray(perturbed, np.float64) - clean) / np.where(std > 0, std, 1.0)
        assert offsets.std() == pytest.approx(0.1, rel=0.1)
    np.testing.assert_array_equal(noisy.actions, data.actions)
    np.testing.assert_array_equal(noisy.rewards, data.rewards)
    # The same seed draws the same copy.
    again = noisy_copy(data, StateNoise("gaussian", 0.1), seed=0)
    np.testing.assert_array_equal(again.observations, noisy.observations)
