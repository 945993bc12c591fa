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

Usage: ``python benchmarks/bench_gpu.py [--quick] [--device cuda] [--steps 100000]
[--time-limit 420]``; one JSON line on stdout.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2,000 steps, about a minute")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--steps", type=int, default=100_000, help="offaug steps to time")
    parser.add_argument("--time-limit", type=float, default=420.0, help="seconds for offaug")
    parser.add_argument("--baseline-steps", type=int, default=2_000, help="baseline steps")
    parser.add_argument("--block", type=int, default=1_000, help="steps per timed block")
    args = parser.parse_args(argv)
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
