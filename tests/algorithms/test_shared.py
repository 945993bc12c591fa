"""One shared tester over every offline learner (as d3rlpy runs one tester over all algorithms).

For each learner: a few updates on a tiny real dataset give finite losses; a state_dict round
trip gives identical outputs; all-ones weights give exactly the unweighted update; the same seed
repeats exactly; and a checkpoint written by the training loop loads without pickle.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from offaug.algorithms import registry
from offaug.algorithms.base import spaces_from_transitions
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.training.batches import make_sampler
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import MixtureSampler, Transitions, load_transitions

ALGORITHMS = sorted(registry.ALGORITHMS)
# Small networks keep the suite fast; every learner's config has a hidden-size field.
SMALL = {"hidden": (32, 32)}


def _small_config(name: str) -> dict[str, object]:
    fields = {f.name for f in dataclasses.fields(registry.config_type(name))}
    config = {k: v for k, v in SMALL.items() if k in fields}
    for field in fields:
        if field.endswith("hidden") and field != "hidden":
            config[field] = (32, 32)
    if "batch_size" in fields:
        config["batch_size"] = 32
    return config


def _data(make_test_dataset, name: str) -> Transitions:
    kind = "cartpole" if registry.ALGORITHMS[name].discrete else "hopper"
    return load_transitions(make_test_dataset(kind, "hdf5").dataset_id)


def _build(name: str, data: Transitions, seed: int = 0):
    torch.manual_seed(seed)
    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    trainer = registry.build(name, spaces, _small_config(name), device="cpu")
    make_sampler(trainer, [data])  # learners with data statistics (TD3+BC, IQL) take them
    return trainer


def _batches(data: Transitions, n: int, seed: int = 0):
    # next_actions for the learners that need them (ReBRAC); the others ignore the column.
    sampler = MixtureSampler([data], 32, seed=seed, next_actions=True)
    return [TorchBatch.from_batch(sampler.sample()) for _ in range(n)]


def _parameters(trainer) -> list[torch.Tensor]:
    tensors = []
    for value in trainer.state_dict().values():
        if isinstance(value, dict):
            tensors.extend(v for v in value.values() if isinstance(v, torch.Tensor))
    return tensors


@pytest.fixture(params=ALGORITHMS)
def algorithm(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name not in registry.available():
        pytest.fail(f"learner {name} is registered but its module is missing")
    return name


def test_updates_give_finite_metrics(make_test_dataset, algorithm: str) -> None:
    data = _data(make_test_dataset, algorithm)
    trainer = _build(algorithm, data)
    for batch in _batches(data, 5):
        metrics = trainer.update(batch)
    assert metrics
    for name, value in metrics.items():
        assert torch.isfinite(value).all(), name
    actions = trainer.act(data.observations[:7])
    assert actions.shape[0] == 7


def test_state_dict_round_trip_gives_identical_outputs(make_test_dataset, algorithm: str) -> None:
    data = _data(make_test_dataset, algorithm)
    trainer = _build(algorithm, data, seed=1)
    for batch in _batches(data, 3):
        trainer.update(batch)
    fresh = _build(algorithm, data, seed=2)
    fresh.load_state_dict(trainer.state_dict())
    torch.manual_seed(5)
    expected = trainer.act(data.observations[:16])
    torch.manual_seed(5)
    np.testing.assert_array_equal(fresh.act(data.observations[:16]), expected)
    # Training continues identically from the restored state.
    batch = _batches(data, 1, seed=9)[0]
    torch.manual_seed(3)
    a = trainer.update(batch)
    torch.manual_seed(3)
    b = fresh.update(batch)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # ... and so do the parameters after it: optimiser state was copied, not shared.
    for mine, theirs in zip(_parameters(trainer), _parameters(fresh), strict=True):
        assert torch.equal(mine, theirs)


def test_all_ones_weights_equal_the_unweighted_update(make_test_dataset, algorithm: str) -> None:
    data = _data(make_test_dataset, algorithm)
    batch = _batches(data, 1)[0]
    doubled = dataclasses.replace(batch, weights=torch.full_like(batch.weights, 2.0))
    ones = dataclasses.replace(batch, weights=torch.ones_like(batch.weights))
    results = []
    for weighted in (batch, ones, doubled):
        trainer = _build(algorithm, data, seed=4)
        torch.manual_seed(6)
        results.append(trainer.update(weighted))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
    # The weights are used: doubling them changes at least one loss.
    assert any(not torch.equal(results[0][n], results[2][n]) for n in results[0])


def test_same_seed_repeats_exactly(make_test_dataset, algorithm: str) -> None:
    data = _data(make_test_dataset, algorithm)
    runs = []
    for _ in range(2):
        trainer = _build(algorithm, data, seed=7)
        torch.manual_seed(8)
        for batch in _batches(data, 4, seed=3):
            trainer.update(batch)
        runs.append(_parameters(trainer))
    assert len(runs[0]) > 0
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_training_loop_checkpoint_and_resume(
    make_test_dataset, algorithm: str, tmp_path: Path
) -> None:
    data = _data(make_test_dataset, algorithm)
    options = TrainOptions(
        steps=20, log_every=10, eval_every=20, eval_episodes=1, checkpoint_every=10
    )
    result = train(
        algorithm, [data], tmp_path / "run", config=_small_config(algorithm), options=options
    )
    assert result.last_evaluation is not None
    assert (tmp_path / "run" / "checkpoints" / "step_10.pt").is_file()
    restored = load_trainer(result.checkpoint)
    assert restored.act(data.observations[:3]).shape[0] == 3
    # Resuming to 30 steps continues from 20 and logs only the new steps.
    longer = dataclasses.replace(options, steps=30)
    train(
        algorithm,
        [data],
        tmp_path / "run",
        config=_small_config(algorithm),
        options=longer,
        resume=True,
    )
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in lines if '"train"' in line]
    assert steps == [10, 20, 30]
