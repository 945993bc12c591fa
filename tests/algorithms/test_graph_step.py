"""The graph-safe step: equal to each learner's own update, traceable whole, captured on CUDA."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from offaug.algorithms.base import Trainer
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.fused.graph_step import GraphStep, every_phase_step, phase_pattern
from offaug.algorithms.fused.trainer import FusedTrainer
from offaug.algorithms.training.fused_loop import build_members
from offaug.algorithms.training.graphed import GraphedUpdates
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import Transitions
from offaug.datasets.sampler import stack_numpy
from tests.algorithms.fused_runs import SMALL, assert_states_close

LEARNERS = ("bc", "td3bc", "iql", "rebrac", "cql", "bcq")
TINY: dict[str, dict[str, Any]] = {
    "bc": {"hidden": [8], "batch_size": 8},
    "td3bc": {"hidden": [8], "batch_size": 8},
    "iql": {"hidden": [8], "batch_size": 8, "actor_lr_decay_steps": 30},
    "rebrac": {"hidden": [8], "batch_size": 8},
    "cql": {"hidden": [8], "batch_size": 8, "n_action_samples": 2, "bc_steps": 2},
    "bcq": {
        "actor_hidden": [8],
        "critic_hidden": [8],
        "vae_hidden": [8],
        "batch_size": 8,
        "n_action_samples": 2,
        "rl_start_step": 2,
    },
}


def graph_step(
    algorithm: str, data: Transitions, config: dict[str, Any], seeds: tuple[int, ...] = (0,)
) -> tuple[GraphStep, Any]:
    built = build_members(algorithm, [data], seeds, [config] * len(seeds), TrainOptions())
    fused = FusedTrainer(built.trainers, built.generators, list(seeds))
    return GraphStep(fused), built


def fields_of(batch: TorchBatch) -> dict[str, torch.Tensor]:
    return {name: value for name, value in vars(batch).items() if value is not None}


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "host_pattern"])
@pytest.mark.parametrize("algorithm", LEARNERS)
def test_graph_step_equals_the_learners_update(
    algorithm: str, masked: bool, hopper: Transitions, one_thread: None
) -> None:
    """Same initial parameters, batches and noise: the graph-safe step (its delayed phases
    masked by the device's counter or left out by the host's, its Adam written out) ends where
    the learner's own ``update`` does."""
    config = dict(SMALL[algorithm])
    config.update({"bc_steps": 2} if algorithm == "cql" else {})
    config.update({"rl_start_step": 2} if algorithm == "bcq" else {})
    step, built = graph_step(algorithm, hopper, config)
    single: Trainer = build_members(algorithm, [hopper], (0,), [config], TrainOptions()).trainers[0]
    batch_size = int(config["batch_size"])
    for number in range(5):
        batch = TorchBatch.from_batch(stack_numpy([built.samplers[0].sample()]))
        noise = step.draw(batch_size)
        step(fields_of(batch), noise, None if masked else phase_pattern(step.spec, number))
        member_noise = {name: value[0] for name, value in noise.items()}
        single.draw_noise = lambda *_, given=member_noise: given  # type: ignore[attr-defined]
        single.update(TorchBatch(**{k: v[0] for k, v in fields_of(batch).items()}))
    step.sync_host(5)
    assert step.fused.frozen == []
    assert_states_close(step.fused.member_state_dict(0), single.state_dict())


def test_every_phase_step_is_where_all_phases_run(hopper: Transitions) -> None:
    step, _ = graph_step(
        "bcq", hopper, {**TINY["bcq"], "rl_start_step": 3, "update_actor_interval": 2}
    )
    assert every_phase_step(step.spec) == 4  # update_actor_interval 2, from step 3


def test_metrics_are_summed_on_the_device_and_flushed(hopper: Transitions) -> None:
    step, built = graph_step("td3bc", hopper, TINY["td3bc"], seeds=(0, 1))
    for _ in range(3):
        batch = TorchBatch.from_batch(stack_numpy([s.sample() for s in built.samplers]))
        step(fields_of(batch), step.draw(8))
    means = step.flush_metrics()
    assert set(means) == set(step.spec.metrics)
    assert all(value.shape == (2,) for value in means.values())
    assert float(step.metric_count) == 0.0
    assert int(step.step) == 3


@pytest.mark.parametrize(
    ("algorithm", "backend"),
    [
        *[(algorithm, "aot_eager") for algorithm in LEARNERS],
        # Inductor's code generation takes 30-45 s a learner with a cold cache: every learner is
        # traced whole above; two are also generated and run.
        ("td3bc", "inductor"),
        pytest.param("cql", "inductor", marks=pytest.mark.slow),
    ],
)
def test_graph_step_compiles_whole(
    algorithm: str, backend: str, hopper: Transitions, one_thread: None
) -> None:
    """``torch.compile(fullgraph=True)`` traces one step without a graph break (a host sync or
    a Python branch on a tensor would be one): Dynamo refuses a break whatever the backend, and
    ``aot_eager`` traces the backward pass too; the compiled step equals the eager one."""
    torch._dynamo.reset()
    eager, built = graph_step(algorithm, hopper, TINY[algorithm])
    compiled, _ = graph_step(algorithm, hopper, TINY[algorithm])
    run = torch.compile(compiled.__call__, fullgraph=True, dynamic=False, backend=backend)
    for _ in range(3):
        batch = fields_of(TorchBatch.from_batch(stack_numpy([built.samplers[0].sample()])))
        noise = eager.draw(8)
        eager(batch, noise)
        run(batch, noise)
    for name, flat in eager.fused.flats.items():
        torch.testing.assert_close(compiled.fused.flats[name].flat, flat.flat, rtol=1e-4, atol=1e-5)


def test_graphed_updates_run_eagerly_on_the_cpu(hopper: Transitions, one_thread: None) -> None:
    """The driver with the device sampler, without compiling: steps are counted on both sides
    and the metrics come back once."""
    step, built = graph_step("td3bc", hopper, TINY["td3bc"], seeds=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        updates = GraphedUpdates.build(step, built.samplers, mode="eager", steps_per_call=2)
        updates.run(5)
    assert step.fused.steps == 5 and int(step.step) == 5
    metrics = updates.flush_metrics()
    assert metrics["critic_loss"].shape == (2,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_update", [False, True])
def test_captured_step_equals_eager_step_after_100_steps(
    hopper: Transitions, compile_update: bool
) -> None:
    """The same sampler and noise streams replayed from a CUDA graph: the eager step's
    parameters exactly (captured as it is) or to float rounding (compiled, then captured)."""
    runs = {}
    for mode in ("eager", "captured"):
        step, built = graph_step("td3bc", hopper, SMALL["td3bc"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to eager would prove nothing
            updates = GraphedUpdates.build(
                step, built.samplers, mode=mode, steps_per_call=4, compile_update=compile_update
            )
        assert updates.mode == mode
        updates.run(98)  # 24 replays and 2 uncaptured steps
        runs[mode] = step
    tolerance = {"rtol": 1e-3, "atol": 1e-4} if compile_update else {}
    for name, flat in runs["eager"].fused.flats.items():
        torch.testing.assert_close(runs["captured"].fused.flats[name].flat, flat.flat, **tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_nan_member_stops_alone_when_captured(hopper: Transitions) -> None:
    step, built = graph_step("td3bc", hopper, SMALL["td3bc"], seeds=(0, 1))
    updates = GraphedUpdates.build(step, built.samplers, mode="captured", steps_per_call=2)
    assert updates.mode == "captured"
    with torch.no_grad():
        step.fused.flats["critic"].flat[1].fill_(float("nan"))
    updates.run(6)
    assert step.fused.frozen == [1]
    assert torch.isfinite(step.fused.flats["critic"].flat[0]).all()


def test_train_takes_the_graph_step_between_logs_and_checkpoints(
    hopper: Transitions, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """``train`` runs the graph-safe step up to each log line and checkpoint, logs its device
    metrics, and checkpoints the trainer as the step left it."""
    from offaug.algorithms.base import load_checkpoint
    from offaug.algorithms.training import loop

    monkeypatch.setattr(loop, "graph_step_mode", lambda *_: "eager")
    options = TrainOptions(steps=7, log_every=3, checkpoint_every=5, eval_every=0)
    result = loop.train("td3bc", [hopper], tmp_path, config=TINY["td3bc"], options=options)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [int(line.split('"step": ')[1].split(",")[0]) for line in lines] == [3, 6, 7]
    state = load_checkpoint(result.checkpoint).state
    assert state["steps"] == 7
    assert state["actor_optimizer"]["state"][0]["step"] == 4  # actor steps 0, 2, 4, 6


def test_graph_step_mode_is_chosen_once_from_the_options() -> None:
    from offaug.algorithms.training.loop import graph_step_mode

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert graph_step_mode("td3bc", TrainOptions(), cuda) == "captured"
    assert graph_step_mode("td3bc", TrainOptions(compile_step="on"), cpu) == "compiled"
    assert graph_step_mode("td3bc", TrainOptions(compile_step="off"), cuda) is None
    # auto on a CPU: small networks in long runs only.
    long = TrainOptions(steps=200_000)
    assert graph_step_mode("iql", long, cpu, (64, 64)) == "compiled"
    assert graph_step_mode("cql", long, cpu, (256, 256)) is None
    assert graph_step_mode("iql", long, cpu, (512, 512)) is None
    assert graph_step_mode("iql", TrainOptions(steps=1_000), cpu, (64, 64)) is None
    assert graph_step_mode("bcq", long, cpu, (64, 64)) is None
    assert graph_step_mode("sac", TrainOptions(), cuda) is None
    assert graph_step_mode("td3bc", TrainOptions(weighting="behaviour"), cuda) is None
    with pytest.raises(ValueError, match="no graph-safe step"):
        graph_step_mode("sac", TrainOptions(compile_step="on"), cpu)


def test_a_failed_capture_warns_once_and_trains_eagerly(hopper: Transitions) -> None:
    from offaug.algorithms.training.graphed import GraphFallbackWarning

    step, built = graph_step("td3bc", hopper, TINY["td3bc"])
    before = step.fused.flats["actor"].flat.clone()
    with pytest.warns(GraphFallbackWarning, match="could not be captured.*CUDA device"):
        updates = GraphedUpdates.build(step, built.samplers, mode="captured")
    assert updates.mode == "eager"
    assert torch.equal(step.fused.flats["actor"].flat, before)  # nothing ran before the warning
    updates.run(2)
    assert step.fused.steps == 2


def test_a_fused_run_takes_the_graph_step_too(
    hopper: Transitions, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    from offaug.algorithms.base import load_checkpoint
    from offaug.algorithms.training import fused_loop as fused_train

    monkeypatch.setattr(fused_train, "graph_step_mode", lambda *_: "eager")
    options = TrainOptions(steps=5, log_every=2, checkpoint_every=5, eval_every=0, seeds=(0, 1))
    result = fused_train.train_fused(
        "td3bc", [hopper], tmp_path, config=TINY["td3bc"], options=options
    )
    for run in result.runs:
        lines = (run.out / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 3 and '"critic_loss"' in lines[0]
        assert load_checkpoint(run.checkpoint).state["steps"] == 5


def test_train_falls_back_to_the_learners_update_with_one_warning(
    hopper: Transitions, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    from offaug.algorithms.training import loop
    from offaug.algorithms.training.graphed import GraphFallbackWarning

    monkeypatch.setattr(loop, "graph_step_mode", lambda *_: "captured")  # no CUDA here
    options = TrainOptions(steps=3, log_every=3, checkpoint_every=3, eval_every=0)
    with pytest.warns(GraphFallbackWarning) as caught:
        loop.train("td3bc", [hopper], tmp_path, config=TINY["td3bc"], options=options)
    assert len(caught) == 1
    assert (tmp_path / "checkpoint.pt").is_file()
