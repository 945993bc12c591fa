"""CQL's pace on a GPU: gradient steps per second at 3x256 networks, and minutes per 1M steps.

The GPU goal: time 100k CQL steps at 3x256 hidden units and report the pace per 1M steps (goal
under 30 minutes; CORL's PyTorch CQL takes 11.5 h per 1M steps on a GTX 1080 Ti, JAX-CORL 56 min).
offaug's CQL (CQL(H), its defaults, batch 256) trains as ``offaug train cql --device cuda`` does:
``TorchBatch.from_batch(MixtureSampler.sample(), device)`` + ``trainer.update`` on transitions with
Hopper-v5's shapes (11-dim observations, 3-dim actions; synthetic values, as the pace does not
depend on them), timed in blocks with the device synchronised at each block's end, until ``--steps``
or ``--time-limit`` (then the pace is that of the steps done, and the record says how many). Then
the same updates on batches staged on the device beforehand (``absolute.update_only_steps_per_s``):
the gap is what sampling and copying cost a step. The baseline, in the same process: d3rlpy 2.8's
CQL at the same sizes on the same device when d3rlpy is importable, else offaug's own CQL on one CPU
thread.

Made to be run as one prepared command on a lent GPU machine (docs/performance.md, GPU); it
also runs on a CPU (``--device cpu``), which is how the test suite keeps it working.
It needs only torch, numpy, pyarrow, xxhash and gymnasium: run from a checkout that is not
installed, it imports offaug from the source folders through a temporary package link.

``--suite graph`` measures the graph-safe step instead (:mod:`offaug.algorithms.training.graphed`):
for every learner (BC, TD3+BC, IQL, ReBRAC, CQL, BCQ at their default sizes) and K = 1, 2, 5 and
10 members, today's eager step (``trainer.update`` for K = 1, ``FusedTrainer.update`` beyond, on
``TorchBatch.from_batch`` of the numpy sampler's batches) against the same update captured in a
CUDA graph ``--steps-per-call`` steps at a time, its batches drawn on the device; where
``--compiled-members`` says (K = 1 by default: compiling costs tens of seconds a shape), also
compiled by Inductor before capture. For TD3+BC and IQL the plainest compiled-and-captured loop
of the same update (``_plain_loops``' nn.Sequential step, fused Adam, indices drawn on the device,
``torch.compile`` then captured by hand, two steps per graph) is in ``absolute``. Each side is
timed for ``--seconds`` after a warm-up, the device synchronised at each end; one JSON record per
(learner, K, captured form), each with the device's name. ``--time-limit`` stops starting new
measurements (those left are logged). ``--dry-run`` runs every piece on the CPU at a tiny size
and in eager mode (what the test suite checks).

Usage: ``python benchmarks/bench_gpu.py [--quick] [--device cuda] [--steps 100000]
[--time-limit 420]``; one JSON line on stdout. ``python benchmarks/bench_gpu.py --suite graph
[--learners td3bc,cql] [--members 1,2,5,10] [--seconds 2] [--dry-run]``: a line per record.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Reporter, log, protect_stdout, throughput_record

REPO = Path(__file__).resolve().parent.parent
OBSERVATION_DIM, ACTION_DIM = 11, 3  # Hopper-v5
CORL_PYTORCH_MINUTES = 11.5 * 60
JAX_CORL_MINUTES = 56.0
GOAL_MINUTES = 30.0


def _import_offaug() -> None:
    """Make ``import offaug`` work from an uninstalled checkout (the layout of pyproject)."""
    try:
        import offaug  # noqa: F401
    except ImportError:
        root = Path(tempfile.mkdtemp(prefix="offaug-src-"))
        package = root / "offaug"
        package.mkdir()
        for item in (REPO / "offaug").iterdir():
            (package / item.name).symlink_to(item)
        for sub in ("datasets", "algorithms", "pipeline"):
            (package / sub).symlink_to(REPO / sub)
        sys.path.insert(0, str(root))


def _synthetic_transitions(rows: int, seed: int) -> Any:
    import numpy as np

    from offaug.datasets import Transitions

    rng = np.random.default_rng(seed)
    ends = np.zeros(rows, dtype=bool)
    ends[999::1000] = True  # 1,000-step episodes, as Hopper's time limit
    ends[-1] = True
    terminals = (rng.random(rows) < 0.002) & ~ends
    episode_ids = np.concatenate([[0], np.cumsum((ends | terminals)[:-1])]).astype(np.int64)
    return Transitions(
        observations=rng.standard_normal((rows, OBSERVATION_DIM), dtype=np.float32),
        actions=rng.uniform(-1, 1, (rows, ACTION_DIM)).astype(np.float32),
        rewards=rng.standard_normal(rows, dtype=np.float32),
        next_observations=rng.standard_normal((rows, OBSERVATION_DIM), dtype=np.float32),
        terminals=terminals,
        timeouts=ends,
        episode_ids=episode_ids,
    )


def _d3rlpy_cql(hidden: list[int], batch: int, data: Any, device: str) -> Any | None:
    try:
        import d3rlpy
    except ImportError:
        return None
    from offaug.datasets.interop import to_d3rlpy

    encoder = d3rlpy.models.VectorEncoderFactory(hidden_units=hidden)
    config = d3rlpy.algos.CQLConfig(
        batch_size=batch, actor_encoder_factory=encoder, critic_encoder_factory=encoder
    )
    d3rlpy_device = "cuda:0" if device == "cuda" else device
    if ":" not in d3rlpy_device:
        d3rlpy_device += ":0"
    algo = config.create(device=d3rlpy_device)
    dataset = to_d3rlpy(data)
    algo.build_with_dataset(dataset)
    return algo, dataset


def _blocks(
    step: Any, block: int, max_steps: int, limit_s: float, sync: Any
) -> tuple[list[float], int]:
    """Time ``step`` in blocks of ``block`` steps until ``max_steps`` or ``limit_s``."""
    times: list[float] = []
    done = 0
    started = time.perf_counter()
    while done < max_steps and time.perf_counter() - started < limit_s:
        n = min(block, max_steps - done)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        elapsed = time.perf_counter() - t0
        # Scale a short last block to a full one so the median compares like with like.
        times.append(elapsed * block / n)
        done += n
    return times, done


GRAPH_LEARNERS = ("bc", "td3bc", "iql", "rebrac", "cql", "bcq")
GRAPH_MEMBERS = (1, 2, 5, 10)


def parse_graph_args(argv: list[str] | None) -> argparse.Namespace:
    """The options of ``--suite graph`` (and the CQL pace's, which share the parser)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--suite", choices=("cql", "graph"), default="cql")
    parser.add_argument("--quick", action="store_true", help="2,000 steps, about a minute")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--steps", type=int, default=100_000, help="offaug steps to time")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds for offaug (CQL pace, default 420) or to start measurements (graph, 270)",
    )
    parser.add_argument("--baseline-steps", type=int, default=2_000, help="baseline steps")
    parser.add_argument("--block", type=int, default=1_000, help="steps per timed block")
    parser.add_argument("--learners", default=",".join(GRAPH_LEARNERS), help="graph suite")
    parser.add_argument(
        "--members", default=",".join(map(str, GRAPH_MEMBERS)), help="graph suite: K values"
    )
    parser.add_argument(
        "--compiled-members", default="1", help="graph suite: K values also compiled ('' none)"
    )
    parser.add_argument("--seconds", type=float, default=1.5, help="graph suite: per side")
    parser.add_argument("--steps-per-call", type=int, default=8, help="graph suite")
    parser.add_argument("--dry-run", action="store_true", help="graph suite: tiny, CPU, eager")
    args = parser.parse_args(argv)
    args.learners = [name for name in args.learners.split(",") if name]
    unknown = sorted(set(args.learners) - set(GRAPH_LEARNERS))
    if unknown:
        parser.error(f"--learners: unknown {unknown}; choose from {', '.join(GRAPH_LEARNERS)}")
    args.members = [int(k) for k in args.members.split(",") if k]
    args.compiled_members = [int(k) for k in args.compiled_members.split(",") if k]
    if args.time_limit is None:
        args.time_limit = 420.0 if args.suite == "cql" else 270.0
    if args.dry_run:
        args.device, args.seconds, args.time_limit = "cpu", 0.05, 120.0
    return args


def _timed(call: Any, steps_per_call: int, seconds: float, sync: Any) -> float:
    """Steps per second of ``call`` (``steps_per_call`` steps each) over about ``seconds``."""
    call()
    sync()
    calls, started = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        if calls % 4 == 0 or seconds < 0.5:
            sync()
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                return calls * steps_per_call / elapsed


def graph_suite(args: argparse.Namespace, reporter: Reporter) -> int:
    """``--suite graph``: see the module's docstring."""
    import torch

    from offaug.algorithms.runtime import configure_torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log(f"no CUDA device here (torch {torch.__version__}); try --dry-run")
        return 2
    configure_torch(1 if device.type == "cpu" else None)
    data = _synthetic_transitions(2_000 if args.dry_run else 200_000, seed=0)
    started = time.perf_counter()
    left: list[str] = []
    # Every captured form first, then the compiled ones (tens of seconds of compiling each).
    plan = [(name, k, False) for name in args.learners for k in args.members]
    plan += [(name, k, True) for k in args.compiled_members for name in args.learners]
    for name, members, compiled in plan:
        label = f"{name} K={members}{' compiled' if compiled else ''}"
        if time.perf_counter() - started > args.time_limit:
            left.append(label)
            continue
        log(f"graph suite: {label} on {device}")
        reporter.emit(_graph_record(name, members, compiled, data, device, args))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if left:
        log(f"graph suite: time limit reached; not measured: {', '.join(left)}")
    return 0


def _graph_record(
    name: str, members: int, compiled: bool, data: Any, device: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """One learner at K members: today's eager step against the graph-safe step captured."""
    import torch
    from _plain_loops import PLAIN_STEPS  # imports offaug: after _import_offaug

    from offaug.algorithms.batch import TorchBatch
    from offaug.algorithms.fused.trainer import FusedTrainer
    from offaug.algorithms.training.fused_loop import build_members
    from offaug.algorithms.training.graphed import graphed_updates
    from offaug.algorithms.training.options import TrainOptions
    from offaug.datasets.sampler import sample_stacked

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    tiny: dict[str, Any] = {"hidden": [8], "batch_size": 8}
    if name == "bcq":
        tiny = {"actor_hidden": [8], "critic_hidden": [8], "vae_hidden": [8], "batch_size": 8}
    config = tiny if args.dry_run else {}
    seeds = tuple(range(members))
    options = TrainOptions(device=args.device)
    eager = build_members(name, [data], seeds, [config] * members, options)
    fused = FusedTrainer(eager.trainers, eager.generators, seeds)

    def eager_call() -> None:
        if members == 1:
            batch = TorchBatch.from_batch(eager.samplers[0].sample(), device)
            eager.trainers[0].update(batch)
        else:
            fused.update(TorchBatch.from_batch(sample_stacked(eager.samplers), device))

    eager_rate = _timed(eager_call, 1, args.seconds, sync)
    built = build_members(name, [data], seeds, [config] * members, options)
    begin = time.perf_counter()
    per_call = args.steps_per_call
    updates = graphed_updates(
        built.trainers,
        built.generators,
        seeds,
        built.samplers,
        mode="eager" if args.dry_run else "captured",
        steps_per_call=per_call,
        compile_update=compiled,
    )
    prepare_seconds = time.perf_counter() - begin
    captured_rate = _timed(lambda: updates.run(per_call), per_call, args.seconds, sync)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    absolute: dict[str, Any] = {
        "device": device_name,
        "torch": torch.__version__,
        "mode": updates.mode,
        "compiled": compiled,
        "prepare_seconds": prepare_seconds,
        "member_steps_per_s": captured_rate * members,
        "eager_member_steps_per_s": eager_rate * members,
    }
    if compiled and members == 1 and name in PLAIN_STEPS:
        absolute.update(_plain_captured(name, data, device, args, sync))
    form = "compiled_captured" if compiled else "captured"
    return {
        "benchmark": f"graph_step_{name}_k{members}_{form}_{device.type}",
        "unit": "gradient steps/s (each member's)",
        "offaug": captured_rate,
        "baseline": eager_rate,
        "baseline_name": "today's eager step"
        + (" (trainer.update)" if members == 1 else " (FusedTrainer.update)"),
        "ratio": captured_rate / eager_rate,
        "goal": None,
        "repeats": 1,
        "size": {
            "members": members,
            "steps_per_call": per_call,
            "config": config or "defaults",
            "seconds_per_side": args.seconds,
        },
        "notes": (
            "synthetic transitions with Hopper-v5's shapes; the graph-safe step"
            f" {form.replace('_', ' then ')} ({per_call} steps per CUDA graph, batches drawn on"
            " the device) against the eager step on numpy batches; the device synchronised at"
            " each timing's ends"
        ),
        "absolute": absolute,
    }


def _plain_captured(
    name: str, data: Any, device: Any, args: argparse.Namespace, sync: Any
) -> dict[str, Any]:
    """The plainest compiled-and-captured loop of ``name``'s update (two steps a graph)."""
    import torch
    from _plain_loops import PLAIN_STEPS  # imports offaug: after _import_offaug

    from offaug.algorithms.base import Spaces
    from offaug.algorithms.batch import TorchBatch

    spaces = Spaces(OBSERVATION_DIM, ACTION_DIM, False, (-1.0,) * 3, (1.0,) * 3)
    hidden = 8 if args.dry_run else 256
    batch = 8 if args.dry_run else 256
    torch.manual_seed(0)
    update = PLAIN_STEPS[name](spaces, hidden, device=str(device))
    columns = {
        field: torch.as_tensor(getattr(data, field)).to(device).float()
        for field in ("observations", "actions", "rewards", "next_observations", "terminals")
    }
    rows = len(data)
    # The dry run checks the pieces, not Inductor (minutes on a small CPU).
    compiled = update if args.dry_run else torch.compile(update)

    def two_steps() -> None:
        for _ in range(2):
            index = torch.randint(0, rows, (batch,), device=device)
            picked = {k: v[index] for k, v in columns.items()}
            ones = torch.ones_like(picked["rewards"])
            compiled(TorchBatch(**picked, timeouts=ones, weights=ones))

    begin = time.perf_counter()
    try:
        for _ in range(3):
            two_steps()
        sync()
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                two_steps()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                two_steps()
            call = graph.replay
        else:
            call = two_steps
    except Exception as exc:  # a plain loop that cannot be captured is reported, not fatal
        return {"plain_compiled_captured_error": f"{type(exc).__name__}: {exc}"[:300]}
    prepare = time.perf_counter() - begin
    rate = _timed(call, 2, args.seconds, sync)
    return {
        "plain_compiled_captured_steps_per_s": rate,
        "plain_compiled_captured_prepare_seconds": prepare,
        "plain_compiled_captured": f"_plain_loops.{name}_step, torch.compile, captured by hand"
        " two steps a graph (IQL's cosine rate frozen at capture); indices drawn on the device",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_graph_args(argv)
    if args.suite == "graph" or args.dry_run:
        reporter = Reporter(protect_stdout())
        _import_offaug()
        return graph_suite(args, reporter)
    return cql_pace(args)


def cql_pace(args: argparse.Namespace) -> int:
    """The CQL pace (the default suite): see the module's docstring."""
    if args.quick:
        args.steps, args.baseline_steps = min(args.steps, 2_000), min(args.baseline_steps, 500)
    out = protect_stdout()
    reporter = Reporter(out)
    _import_offaug()
    import torch

    from offaug.algorithms import registry
    from offaug.algorithms.base import Spaces
    from offaug.algorithms.batch import TorchBatch
    from offaug.algorithms.runtime import configure_torch
    from offaug.datasets import MixtureSampler

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log(f"no CUDA device here (torch {torch.__version__}); run with --device cpu to try it")
        return 2
    configure_torch(1 if args.device == "cpu" else None)
    hidden = [256, 256, 256]
    batch = 256
    data = _synthetic_transitions(200_000, seed=0)
    spaces = Spaces(OBSERVATION_DIM, ACTION_DIM, False, (-1.0,) * 3, (1.0,) * 3)
    torch.manual_seed(0)
    trainer = registry.build(
        "cql", spaces, {"hidden": tuple(hidden), "batch_size": batch}, device=args.device
    )
    sampler = MixtureSampler([data], batch, seed=0)
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def offaug_step() -> None:
        trainer.update(TorchBatch.from_batch(sampler.sample(), device))

    warmup = min(200, max(1, args.steps // 10))
    for _ in range(warmup):
        offaug_step()
    sync()
    block = min(args.block, args.steps)
    log(f"offaug CQL {hidden} on {device}: up to {args.steps} steps or {args.time_limit:.0f} s")
    mine, done = _blocks(offaug_step, block, args.steps, args.time_limit, sync)

    # The same updates on batches already on the device (64 drawn before timing, cycled): the
    # gap to the figure above is what sampling and the host-to-device copies cost per step
    # (from pageable memory, such a copy waits for the stream, so it is one sync a step).
    staged = itertools.cycle([TorchBatch.from_batch(sampler.sample(), device) for _ in range(64)])

    def update_only_step() -> None:
        trainer.update(next(staged))

    update_steps = max(1, min(args.steps // 10, 10_000))
    update_times, update_done = _blocks(
        update_only_step, min(block, update_steps), update_steps, args.time_limit / 4, sync
    )
    update_rate = min(block, update_steps) / statistics.median(update_times)

    baseline = _d3rlpy_cql(hidden, batch, data, args.device)
    if baseline is not None:
        algo, dataset = baseline
        baseline_name = f"d3rlpy 2.8 CQL, same sizes and batch, on {device}"

        def baseline_step() -> None:
            algo.update(dataset.sample_transition_batch(batch))

        baseline_device_sync = sync
    else:
        baseline_name = "offaug's CQL on one CPU thread (d3rlpy is not installed here)"
        torch.set_num_threads(1)
        torch.manual_seed(0)
        cpu_trainer = registry.build(
            "cql", spaces, {"hidden": tuple(hidden), "batch_size": batch}, device="cpu"
        )

        def baseline_step() -> None:
            cpu_trainer.update(TorchBatch.from_batch(sampler.sample(), "cpu"))

        def baseline_device_sync() -> None:
            return None

    for _ in range(min(20, args.baseline_steps)):
        baseline_step()
    baseline_device_sync()
    baseline_block = min(block, max(1, args.baseline_steps // 3))
    log(f"baseline ({baseline_name}): {args.baseline_steps} steps")
    theirs, baseline_done = _blocks(
        baseline_step, baseline_block, args.baseline_steps, args.time_limit, baseline_device_sync
    )

    record = throughput_record(
        benchmark=f"train_cql_3x256_{device.type}",
        unit="gradient steps/s",
        work=block,
        offaug_times=mine,
        baseline_times=theirs,
        baseline_work=baseline_block,
        baseline_name=baseline_name,
        goal=None,
        size={"hidden": hidden, "batch_size": batch, "steps_per_block": block},
        notes=(
            "offaug train's step (TorchBatch.from_batch(sampler.sample(), device) + CQL.update) "
            "on transitions with Hopper-v5's shapes; blocks end with a device synchronisation; "
            "the goal is absolute (minutes per 1M steps, in 'absolute'), not a ratio"
        ),
    )
    minutes = 1e6 / record["offaug"] / 60
    record["absolute"] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps_timed": done,
        "steps_asked": args.steps,
        "baseline_steps_timed": baseline_done,
        "minutes_per_1M_steps": minutes,
        "update_only_steps_per_s": update_rate,
        "update_only_steps_timed": update_done,
        "update_only": "the same trainer.update on 64 batches staged on the device beforehand",
        "goal_minutes_per_1M_steps": GOAL_MINUTES,
        "goal_met": minutes < GOAL_MINUTES,
        "corl_pytorch_minutes_per_1M_steps_gtx1080ti": CORL_PYTORCH_MINUTES,
        "jax_corl_minutes_per_1M_steps": JAX_CORL_MINUTES,
    }
    reporter.emit(record)
    log(
        f"pace: {minutes:.1f} min per 1M steps ({done} steps timed; goal < {GOAL_MINUTES:.0f});"
        f" CORL PyTorch {CORL_PYTORCH_MINUTES:.0f}, JAX-CORL {JAX_CORL_MINUTES:.0f}"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
