"""``torch.compile`` of learners' declared targets: real Inductor compiles, and the eager fallback.

The fallback is exercised with a real ``torch.compile`` whose backend raises, as a machine
without a C++ compiler would.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from offaug.algorithms import registry
from offaug.algorithms.base import spaces_from_transitions
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.training.compiling import CompileFallbackWarning, compile_trainer
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import MixtureSampler, Transitions, load_transitions

HAVE_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
needs_cxx = pytest.mark.skipif(not HAVE_CXX, reason="Inductor on CPU needs a C++ compiler")


def _hopper(make_test_dataset) -> Transitions:
    return load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)


def _bc(data: Transitions, policy: str = "gaussian", seed: int = 0) -> Any:
    torch.manual_seed(seed)
    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    config = {"policy": policy, "hidden": (32, 32), "batch_size": 32}
    return registry.build("bc", spaces, config, device="cpu")


def _losses(trainer: Any, data: Transitions, steps: int = 8) -> list[float]:
    sampler = MixtureSampler([data], 32, seed=0)
    return [
        float(trainer.update(TorchBatch.from_batch(sampler.sample()))["loss"]) for _ in range(steps)
    ]


def _raising_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    raise RuntimeError("no C++ compiler on this machine")


@needs_cxx
def test_compiled_gaussian_bc_matches_eager_and_repeats_exactly(make_test_dataset) -> None:
    data = _hopper(make_test_dataset)
    eager = _losses(_bc(data), data)
    runs = []
    for _ in range(2):
        trainer = _bc(data)
        assert compile_trainer(trainer) == ("loss",)
        runs.append(_losses(trainer, data))
        assert trainer.loss.compiled, "the compile fell back to eager"
    # Fused element-wise code rounds differently from eager code, nothing more.
    assert runs[0] == pytest.approx(eager, rel=1e-4, abs=1e-5)
    assert runs[0] == runs[1]


def test_learners_without_targets_are_left_as_they_are(make_test_dataset) -> None:
    data = _hopper(make_test_dataset)
    deterministic = _bc(data, policy="deterministic")
    loss = deterministic.loss
    assert compile_trainer(deterministic) == ()
    assert deterministic.loss == loss
    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    cql = registry.build("cql", spaces, {"hidden": (32, 32)}, device="cpu")
    assert compile_trainer(cql) == ()


def test_a_failed_compile_warns_once_and_trains_eagerly(make_test_dataset) -> None:
    data = _hopper(make_test_dataset)
    eager = _losses(_bc(data), data)
    trainer = _bc(data)
    compile_trainer(trainer, backend=_raising_backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _losses(trainer, data)
    fallbacks = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(fallbacks) == 1
    message = str(fallbacks[0].message)
    assert "BC.loss" in message and "no C++ compiler on this machine" in message
    assert not trainer.loss.compiled
    assert losses == eager  # the eager path is the uncompiled code, bit for bit


@needs_cxx
def test_train_with_compile_option_records_it_and_finishes(
    make_test_dataset, tmp_path: Path
) -> None:
    data = _hopper(make_test_dataset)
    options = TrainOptions(steps=20, log_every=10, eval_every=0, checkpoint_every=20, compile=True)
    config = {"policy": "gaussian", "hidden": (32, 32), "batch_size": 32}
    result = train("bc", [data], tmp_path / "run", config=config, options=options)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["options"]["compile"] is True
    assert recorded["compiled"] == ["loss"]
    assert result.checkpoint.is_file()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [10, 20]


def test_workflow_compile_options_reach_the_bc_and_train_stages(
    make_test_dataset, tmp_path: Path
) -> None:
    from offaug.pipeline.contracts import DatasetRef
    from offaug.pipeline.schema.run_sections import EvaluationModel
    from offaug.pipeline.schema.sections import BCConfigModel, TrainModel
    from offaug.pipeline.stages.learning import train_bc, train_offline

    dataset_id = make_test_dataset("hopper", "hdf5").dataset_id
    data = load_transitions(dataset_id)
    ref = DatasetRef(dataset_id, len(data), data.num_episodes, "", False, dict(data.meta))
    bc_config = BCConfigModel(steps=10, hidden=(32, 32), batch_size=32, compile=True)
    model = train_bc(ref, bc_config, str(tmp_path / "bc"), seed=0)
    recorded = json.loads((Path(model.path).parent / "config.json").read_text())
    assert recorded["options"]["compile"] is True and recorded["compiled"] == ["loss"]

    train_config = TrainModel(
        algorithms=("bc",), steps=10, compile=True, configs={"bc": {"hidden": [32, 32]}}
    )
    evaluation = EvaluationModel(episodes=1)
    trained = train_offline(
        "bc", ref, None, train_config, evaluation, str(tmp_path / "train"), seed=0
    )
    recorded = json.loads((Path(trained.path).parent / "config.json").read_text())
    assert recorded["options"]["compile"] is True and recorded["compiled"] == ["loss"]
