"""Learner throughput against d3rlpy 2.8, and each update's FLOP/s and matmul floor.

For each learner (BC, CQL, BCQ, SAC) at 64x64 (overhead-bound) and 256x256 (matmul-bound) networks:
gradient steps per second of offaug's ``TorchBatch.from_batch(sampler.sample())`` +
``trainer.update`` and of d3rlpy's ``dataset.sample_transition_batch() + algo.update`` on the same
data (offaug's exact transitions, handed over with ``offaug.datasets.interop.to_d3rlpy``), the same
network sizes, batch size and hyperparameters, both on one CPU thread, interleaved blocks, median of
repeats. At both sizes it also counts one offaug update's FLOPs (``torch.utils.flop_counter``) and
prints the FLOP/s achieved next to a plain torch matmul loop of the same shapes in the same run (the
FLOP-share goal is the 256x256 one), and the matmul floor: the step rate of those multiplies alone,
beside the step rate the goal asks for.

IQL and TD3+BC are compared with d3rlpy's ``IQLConfig`` / ``TD3PlusBCConfig`` set up as offaug's
defaults are (observations standardised from the data; for IQL rewards scaled by 1000 over the
return range and the actor's learning rate cosine-decayed over 1M steps); at 256x256 also with
the plainest eager PyTorch loop of the same update (``_plain_loops.py``). ReBRAC has no d3rlpy
version: ``rebrac`` times offaug's ReBRAC against offaug's TD3+BC at the same network sizes
and batch (goal: ReBRAC's step at most 1.3x TD3+BC's, i.e. a ratio >= 1/1.3).

``bc_compile`` measures what ``--compile`` (``torch.compile`` of the learners' declared targets)
buys where offaug turns it on, Gaussian BC (the behaviour model of every pipeline run): the
compiled trainer against the same trainer uncompiled, in the same process, interleaved; the
compile time is in ``absolute``. Its goal is 1.0: compiling is only offered where it pays.

``compiled_step`` measures the CPU's compiled graph-safe step (``offaug train --compile-step
on``: the learner's update as one function, ``torch.compile(fullgraph=True)``, its batches drawn
by the device sampler) for IQL, TD3+BC and CQL against today's eager single-seed step
(``TorchBatch.from_batch(sampler.sample())`` + ``trainer.update``), same sizes, same process,
interleaved; the compile time is in ``absolute``. Goals: 1.3x at 64x64, at least 1.0 at 256x256.

``kept_memory`` times one CQL trainer with offaug's malloc settings
(``offaug.algorithms.runtime.keep_freed_memory``, which every offaug training process and Dask
worker applies) against the settings Dask's nanny starts workers with (freed memory handed back
to the kernel at once), switching the process-wide settings between interleaved blocks; the
minor page faults per step of each side are in ``absolute``.

Usage: ``python benchmarks/bench_algorithms.py [--quick] [--only cql,iql,compiled_step]``; JSON
lines on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Reporter,
    d3rlpy_update_block,
    interleave,
    learner_data,
    log,
    matmul_shapes,
    one_cpu_thread,
    plain_matmuls,
    protect_stdout,
    throughput_record,
    update_block,
)
from _plain_loops import PLAIN_STEPS, plain_loop

GOALS = {
    64: {"bc": 2.5, "cql": 2.0, "bcq": 2.0, "sac": 2.0, "iql": 2.0, "td3bc": 2.0},
    256: dict.fromkeys(("bc", "cql", "bcq", "sac", "iql", "td3bc"), 1.05),
}
REBRAC_GOAL = 1 / 1.3
"""ReBRAC's steps/s over offaug TD3+BC's at equal sizes and batch: its step within 1.3x."""


def _break_even(
    compile_seconds: float, mine: list[float], theirs: list[float], steps: int, gain: float
) -> float | None:
    """Steps after which compiling has paid for itself: its cost over the seconds a compiled
    step saves (medians of block times of ``steps`` steps); None when it saves nothing."""
    if gain <= 1:
        return None
    saved_per_step = (statistics.median(theirs) - statistics.median(mine)) / steps
    return compile_seconds / max(1e-12, saved_per_step)


def offaug_trainer(name: str, hidden: int, batch: int, spaces: Any) -> Any:
    import dataclasses

    from offaug.algorithms import registry
    from offaug.algorithms.base import config_from_json

    sizes = (hidden, hidden)
    if name == "sac":
        from offaug.algorithms.learners.sac import SAC, SACConfig

        fields = {f.name for f in dataclasses.fields(SACConfig)}
        config = {k: v for k, v in {"hidden": sizes, "batch_size": batch}.items() if k in fields}
        return SAC(spaces, config_from_json(SACConfig, config), device="cpu")
    fields = {f.name for f in dataclasses.fields(registry.config_type(name))}
    config: dict[str, Any] = {"batch_size": batch}
    for field in fields:
        if field == "hidden" or field.endswith("_hidden"):
            config[field] = sizes
    if name == "bc":
        config["policy"] = "deterministic"
    return registry.build(name, spaces, config, device="cpu")


def d3rlpy_algo(name: str, hidden: int, batch: int, dataset: Any) -> Any:
    import d3rlpy

    encoder = d3rlpy.models.VectorEncoderFactory(hidden_units=[hidden, hidden])
    if name == "bc":
        config = d3rlpy.algos.BCConfig(
            batch_size=batch, encoder_factory=encoder, policy_type="deterministic"
        )
    elif name == "cql":
        config = d3rlpy.algos.CQLConfig(
            batch_size=batch, actor_encoder_factory=encoder, critic_encoder_factory=encoder
        )
    elif name == "bcq":
        config = d3rlpy.algos.BCQConfig(
            batch_size=batch,
            actor_encoder_factory=encoder,
            critic_encoder_factory=encoder,
            imitator_encoder_factory=encoder,
        )
    elif name == "sac":
        config = d3rlpy.algos.SACConfig(
            batch_size=batch, actor_encoder_factory=encoder, critic_encoder_factory=encoder
        )
    elif name == "iql":
        config = d3rlpy.algos.IQLConfig(
            batch_size=batch,
            actor_encoder_factory=encoder,
            critic_encoder_factory=encoder,
            value_encoder_factory=encoder,
            **_d3rlpy_iql_settings(),
        )
    elif name == "td3bc":
        config = d3rlpy.algos.TD3PlusBCConfig(
            batch_size=batch,
            actor_encoder_factory=encoder,
            critic_encoder_factory=encoder,
            observation_scaler=d3rlpy.preprocessing.StandardObservationScaler(),
        )
    else:
        raise ValueError(name)
    algo = config.create(device="cpu:0")
    # Fits the scalers as fit() does (IQL's and TD3+BC's observation and reward scalers).
    d3rlpy.algos.utility.build_scalers_with_transition_picker(algo, dataset)
    algo.build_with_dataset(dataset)
    return algo


def _d3rlpy_iql_settings() -> dict[str, Any]:
    """d3rlpy's IQL set up as offaug's defaults: standardised observations, rewards x 1000 over
    the return range, the actor's learning rate cosine-decayed over 1M steps."""
    import d3rlpy

    schedule = d3rlpy.optimizers.CosineAnnealingLRFactory(T_max=1_000_000)
    return {
        "observation_scaler": d3rlpy.preprocessing.StandardObservationScaler(),
        "reward_scaler": d3rlpy.preprocessing.ReturnBasedRewardScaler(multiplier=1000.0),
        "actor_optim_factory": d3rlpy.optimizers.AdamFactory(lr_scheduler_factory=schedule),
    }


def _measure(
    name: str, hidden: int, data: Any, dataset: Any, steps: int, repeats: int, reporter: Reporter
) -> None:
    import numpy as np
    import torch

    from offaug.algorithms.base import spaces_from_transitions
    from offaug.algorithms.training.batches import make_sampler

    batch = 100 if name == "bcq" else 256
    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    torch.manual_seed(0)
    trainer = offaug_trainer(name, hidden, batch, spaces)
    sampler = make_sampler(trainer, [data], seed=0)
    algo = d3rlpy_algo(name, hidden, batch, dataset)

    def offaug_block() -> float:
        return update_block(trainer, sampler, steps)

    def d3rlpy_block() -> float:
        return d3rlpy_update_block(algo, dataset, batch, steps)

    offaug_block()
    d3rlpy_block()
    mine, theirs = interleave(offaug_block, d3rlpy_block, repeats)
    baseline_rate = steps / float(np.median(theirs))
    absolute = _flops(
        trainer, sampler, steps / float(np.median(mine)), baseline_rate * GOALS[hidden][name]
    )
    if hidden != 256:  # the FLOP-share goal is the 256x256 one
        del absolute["share_goal"]
    if name == "bc" or (name in PLAIN_STEPS and hidden == 256):
        if name == "bc":
            absolute.update(_minimal_loop(hidden, spaces, sampler, offaug_block, steps, repeats))
        else:
            absolute.update(plain_loop(name, hidden, spaces, sampler, offaug_block, steps, repeats))
        absolute["minimal_loop_share_of_matmul"] = (
            absolute["flops_per_update"]
            * absolute["minimal_loop_steps_per_s"]
            / absolute["plain_matmul_flops_per_s"]
        )
    reporter.emit(
        throughput_record(
            benchmark=f"train_{name}_{hidden}x{hidden}",
            unit="gradient steps/s",
            work=steps,
            offaug_times=mine,
            baseline_times=theirs,
            baseline_name="d3rlpy 2.8 sample_transition_batch + update",
            goal=GOALS[hidden][name],
            size={
                "hidden": [hidden, hidden],
                "batch_size": batch,
                "steps_per_block": steps,
                "transitions": len(data),
            },
            notes=(
                "one CPU thread each; d3rlpy fed offaug's exact transitions "
                "(interop.to_d3rlpy); same network sizes, batch size and d3rlpy's default "
                "hyperparameters; BC deterministic on both sides; IQL and TD3+BC with "
                "d3rlpy's scalers and schedule set as offaug's defaults"
            ),
            absolute=absolute,
        )
    )


def _minimal_loop(
    hidden: int,
    spaces: Any,
    sampler: Any,
    offaug_block: Any,
    steps: int,
    repeats: int,
) -> dict[str, Any]:
    """The plainest eager PyTorch loop of deterministic BC, interleaved with offaug's.

    ``nn.Sequential`` MLP, tanh, squared error, fused Adam, on the same batches; no action
    normalisation, weights or metrics. What eager PyTorch itself reaches on this core, so the
    FLOP share it gets is the share an eager implementation can hope for.
    """
    import numpy as np
    import torch
    from torch import nn

    from offaug.algorithms.batch import TorchBatch

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(spaces.observation_dim, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, spaces.action_dim),
    )
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)

    def minimal_block() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            batch = TorchBatch.from_batch(sampler.sample())
            loss = (torch.tanh(net(batch.observations)) - batch.actions).pow(2).sum(-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return time.perf_counter() - start

    minimal_block()
    minimal, mine = interleave(minimal_block, offaug_block, repeats)
    return {
        "minimal_loop": "nn.Sequential + tanh + squared error + fused Adam, same batches",
        "minimal_loop_steps_per_s": steps / float(np.median(minimal)),
        "offaug_vs_minimal_loop": float(np.median(minimal) / np.median(mine)),
    }


def _measure_rebrac(hidden: int, data: Any, steps: int, repeats: int, reporter: Reporter) -> None:
    """offaug's ReBRAC against offaug's TD3+BC: same hidden sizes (two layers) and batch."""
    import numpy as np
    import torch

    from offaug.algorithms import registry
    from offaug.algorithms.base import spaces_from_transitions
    from offaug.algorithms.training.batches import make_sampler

    batch = 256
    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    config = {"hidden": (hidden, hidden), "batch_size": batch}
    torch.manual_seed(0)
    rebrac = registry.build("rebrac", spaces, config, device="cpu")
    td3bc = registry.build("td3bc", spaces, config, device="cpu")
    rebrac_sampler = make_sampler(rebrac, [data], seed=0)
    td3bc_sampler = make_sampler(td3bc, [data], seed=0)
    update_block(rebrac, rebrac_sampler, steps)
    update_block(td3bc, td3bc_sampler, steps)
    mine, theirs = interleave(
        lambda: update_block(rebrac, rebrac_sampler, steps),
        lambda: update_block(td3bc, td3bc_sampler, steps),
        repeats,
    )
    reporter.emit(
        throughput_record(
            benchmark=f"train_rebrac_vs_td3bc_{hidden}x{hidden}",
            unit="gradient steps/s",
            work=steps,
            offaug_times=mine,
            baseline_times=theirs,
            baseline_name="offaug TD3+BC, same network sizes and batch",
            goal=REBRAC_GOAL,
            size={"hidden": [hidden, hidden], "batch_size": batch, "steps_per_block": steps},
            notes=(
                "one CPU thread; ReBRAC's extra work per step: LayerNorm in the critics, the "
                "next dataset action gathered per row and the critic penalty"
            ),
            absolute={
                "rebrac_steps_per_s": steps / float(np.median(mine)),
                "td3bc_steps_per_s": steps / float(np.median(theirs)),
            },
        )
    )


def _measure_compile(hidden: int, data: Any, steps: int, repeats: int, reporter: Reporter) -> None:
    import numpy as np
    import torch

    from offaug.algorithms import registry
    from offaug.algorithms.base import spaces_from_transitions
    from offaug.algorithms.batch import TorchBatch
    from offaug.algorithms.training.compiling import compile_trainer
    from offaug.datasets import MixtureSampler

    batch = 256
    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    config = {"policy": "gaussian", "hidden": (hidden, hidden), "batch_size": batch}
    torch.manual_seed(0)
    eager = registry.build("bc", spaces, config, device="cpu")
    torch.manual_seed(0)
    compiled = registry.build("bc", spaces, config, device="cpu")
    if compile_trainer(compiled) != ("loss",):
        raise RuntimeError("Gaussian BC declares no compile target: nothing to measure")
    sampler = MixtureSampler([data], batch, seed=0)
    # A fresh Inductor cache: the compile time a user meets on a new machine (later runs on
    # the same machine reuse the on-disk cache and compile in a fraction of it).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="offaug-bench-inductor-")
    start = time.perf_counter()
    compiled.update(TorchBatch.from_batch(sampler.sample()))  # the first call compiles
    compile_seconds = time.perf_counter() - start
    if not compiled.loss.compiled:
        raise RuntimeError("torch.compile fell back to eager (see the warning above)")

    update_block(eager, sampler, steps)
    update_block(compiled, sampler, steps)
    mine, theirs = interleave(
        lambda: update_block(compiled, sampler, steps),
        lambda: update_block(eager, sampler, steps),
        repeats,
    )
    gain = float(np.median(theirs) / np.median(mine))
    reporter.emit(
        throughput_record(
            benchmark=f"train_bc_gaussian_compiled_{hidden}x{hidden}",
            unit="gradient steps/s",
            work=steps,
            offaug_times=mine,
            baseline_times=theirs,
            baseline_name="the same offaug Gaussian BC, uncompiled",
            goal=1.0,
            size={"hidden": [hidden, hidden], "batch_size": batch, "steps_per_block": steps},
            notes=(
                "one CPU thread; torch.compile (Inductor) of BC.loss, the truncated-normal "
                "negative log-likelihood, as offaug train --compile does"
            ),
            absolute={
                "compile_seconds_cold_cache": compile_seconds,
                "break_even_steps": _break_even(compile_seconds, mine, theirs, steps, gain),
            },
        )
    )


def _flops(
    trainer: Any, sampler: Any, steps_per_s: float, goal_steps_per_s: float
) -> dict[str, Any]:
    """FLOPs of one update and the FLOP/s achieved, beside the same matmuls done plainly.

    ``matmul_floor_steps_per_s`` is the rate at which the update's matrix multiplies alone,
    run back to back with nothing else, could repeat: no implementation doing the same
    multiplies on this core exceeds it. ``goal_steps_per_s`` is the rate the goal asks for
    (goal ratio x the baseline's measured rate), so the two side by side say whether the goal
    is reachable without doing less arithmetic.
    """
    from torch.utils.flop_counter import FlopCounterMode

    # A learner with delayed actor steps (TD3+BC, ReBRAC) is measured over one whole cycle of
    # ``policy_freq`` updates and reported per update.
    cycle = int(getattr(trainer.config, "policy_freq", 1))
    from offaug.algorithms.batch import TorchBatch

    batch = TorchBatch.from_batch(sampler.sample())
    counter = FlopCounterMode(display=False)
    with counter:
        for _ in range(cycle):
            trainer.update(batch)
    flops = int(counter.get_total_flops()) // cycle
    seconds, matmul_flops = plain_matmuls(matmul_shapes(trainer, batch, cycle), repeats=30)
    seconds, matmul_flops = seconds / cycle, matmul_flops // cycle
    achieved = flops * steps_per_s
    plain = matmul_flops / seconds
    return {
        "flops_per_update": flops,
        "achieved_flops_per_s": achieved,
        "plain_matmul_flops_per_s": plain,
        "plain_matmul": "the update's mm/addmm/bmm/baddbmm shapes (torch.profiler), back to back",
        "share_of_matmul": achieved / plain,
        "share_goal": 0.85,
        "matmul_seconds_per_update": seconds,
        "matmul_floor_steps_per_s": 1.0 / seconds,
        "goal_steps_per_s": goal_steps_per_s,
    }


DASK_NANNY_MALLOC = (128 * 1024, 65536)
"""glibc's mmap threshold (its default, made fixed by any setting) and the trim threshold Dask's
nanny starts workers with (``distributed.nanny.pre-spawn-environ``)."""


def _measure_kept_memory(
    hidden: int, data: Any, steps: int, repeats: int, reporter: Reporter
) -> None:
    """One CQL trainer's steps with offaug's malloc settings against Dask's nanny's, alternating
    the process-wide settings between the blocks; minor page faults per step beside."""
    import resource

    import numpy as np
    import torch

    from offaug.algorithms.base import spaces_from_transitions
    from offaug.algorithms.runtime import keep_freed_memory, set_malloc
    from offaug.algorithms.training.batches import make_sampler

    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    torch.manual_seed(0)
    trainer = offaug_trainer("cql", hidden, 256, spaces)
    sampler = make_sampler(trainer, [data], seed=0)
    faults: dict[str, list[float]] = {"kept": [], "nanny": []}

    def block(side: str) -> Any:
        def run() -> float:
            if side == "kept":
                keep_freed_memory()
            else:
                set_malloc(*DASK_NANNY_MALLOC)
            update_block(trainer, sampler, 1)  # the step that grows or trims the heap
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            seconds = update_block(trainer, sampler, steps)
            faults[side].append(
                (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps
            )
            return seconds

        return run

    kept, nanny = interleave(block("kept"), block("nanny"), repeats)
    keep_freed_memory()
    reporter.emit(
        {
            "benchmark": f"train_cql_{hidden}x{hidden}_kept_memory",
            "unit": "gradient steps/s",
            "offaug": steps / float(np.median(kept)),
            "baseline": steps / float(np.median(nanny)),
            "baseline_name": "the same trainer under Dask's nanny malloc settings",
            "ratio": float(np.median(nanny)) / float(np.median(kept)),
            "goal": None,
            "repeats": repeats,
            "size": {"hidden": [hidden, hidden], "batch_size": 256},
            "notes": "one CPU thread; interleaved blocks; median of repeats",
            "absolute": {
                "page_faults_per_step_kept": float(np.median(faults["kept"])),
                "page_faults_per_step_nanny": float(np.median(faults["nanny"])),
                "steps_per_block": steps,
            },
        }
    )


COMPILED_STEP_GOALS = {64: 1.3, 256: 1.0}
COMPILED_STEP_LEARNERS = ("iql", "td3bc", "cql")


def _measure_compiled_step(
    name: str, hidden: int, data: Any, steps: int, repeats: int, reporter: Reporter
) -> None:
    import numpy as np
    import torch

    from offaug.algorithms.training.fused_loop import build_members
    from offaug.algorithms.training.graphed import graphed_updates
    from offaug.algorithms.training.options import TrainOptions

    batch = 256
    sizes = [hidden, hidden]
    config = {"hidden": sizes, "batch_size": batch}
    options = TrainOptions(device="cpu")
    eager = build_members(name, [data], (0,), [config], options)
    graphed = build_members(name, [data], (0,), [config], options)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="offaug-bench-inductor-")
    torch._dynamo.reset()
    start = time.perf_counter()
    updates = graphed_updates(
        graphed.trainers, graphed.generators, (0,), graphed.samplers, mode="compiled"
    )
    compile_seconds = time.perf_counter() - start
    if updates.mode != "compiled":
        raise RuntimeError("torch.compile fell back to eager (see the warning above)")

    def compiled_block() -> float:
        begin = time.perf_counter()
        updates.run(steps)
        return time.perf_counter() - begin

    def eager_block() -> float:
        return update_block(eager.trainers[0], eager.samplers[0], steps)

    compiled_block()
    eager_block()
    mine, theirs = interleave(compiled_block, eager_block, repeats)
    gain = float(np.median(theirs) / np.median(mine))
    reporter.emit(
        throughput_record(
            benchmark=f"train_{name}_compiled_step_{hidden}x{hidden}",
            unit="gradient steps/s",
            work=steps,
            offaug_times=mine,
            baseline_times=theirs,
            baseline_name=f"offaug {name} eager single-seed step (sample, from_batch, update)",
            goal=COMPILED_STEP_GOALS[hidden],
            size={"hidden": sizes, "batch_size": batch, "steps_per_block": steps},
            notes=(
                "one CPU thread; the graph-safe step (device sampler, masked phases, written-out"
                " Adam) compiled by torch.compile(fullgraph=True, Inductor), as offaug train"
                " --compile-step on runs it"
            ),
            absolute={
                "compile_seconds_cold_cache": compile_seconds,
                "break_even_steps": _break_even(compile_seconds, mine, theirs, steps, gain),
            },
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="about a minute")
    parser.add_argument(
        "--only",
        default="bc,cql,bcq,sac,iql,td3bc,rebrac,bc_compile,kept_memory",
        help="learners to measure",
    )
    args = parser.parse_args(argv)
    reporter = Reporter(protect_stdout())
    one_cpu_thread()
    data, dataset = learner_data(args.quick)
    repeats = 3 if args.quick else 5
    for name in args.only.split(","):
        for hidden in (64, 256):
            steps = (20 if hidden == 256 else 50) if args.quick else (100 if hidden == 256 else 300)
            log(f"{name} {hidden}x{hidden}: {repeats} x {steps} steps each side")
            if name == "compiled_step":
                for learner in COMPILED_STEP_LEARNERS:
                    _measure_compiled_step(learner, hidden, data, 2 * steps, repeats, reporter)
            elif name == "bc_compile":
                _measure_compile(hidden, data, 4 * steps, repeats, reporter)
            elif name == "kept_memory":
                _measure_kept_memory(hidden, data, max(steps // 10, 5), repeats, reporter)
            elif name == "rebrac":
                _measure_rebrac(hidden, data, 4 * steps, repeats, reporter)
            else:
                _measure(name, hidden, data, dataset, steps, repeats, reporter)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
