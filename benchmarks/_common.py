"""Shared helpers of offaug's benchmarks: clean JSON output, interleaved timing, cached datasets,
learners' update blocks (offaug's and d3rlpy's) and an update's matmul floor.

Every benchmark script prints one JSON object per line on stdout and nothing else (see
``/work/shared/BENCHMARKS.md``). Libraries are not that careful (d3rlpy logs through structlog
to stdout, worker processes inherit file descriptor 1), so :func:`protect_stdout` moves the real
stdout aside and points descriptor 1 at stderr before anything else runs.

Generated Minari datasets are cached under ``benchmarks/.data/`` (or ``OFFAUG_BENCH_DATA``),
keyed by environment, steps, storage format and seed: Minari's Arrow writer is quadratic in the
number of episodes, so a dataset is generated once and reused by later runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

BENCH_DIR = Path(__file__).resolve().parent
DATA_DIR = Path(os.environ.get("OFFAUG_BENCH_DATA", BENCH_DIR / ".data")).absolute()
MINARI_ROOT = DATA_DIR / "minari"
SCRATCH_ROOT = DATA_DIR / "tmp"


def log(message: str) -> None:
    """Progress for humans: always on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def protect_stdout() -> TextIO:
    """Keep the real stdout for results only; everything else written to stdout goes to stderr.

    Returns:
        A line-buffered text stream on the original stdout, for :class:`Reporter`.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(saved, "w", buffering=1)


class Reporter:
    """Writes result records, one JSON object per line, to the protected stdout."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.records: list[dict[str, Any]] = []

    def emit(self, record: dict[str, Any]) -> None:
        """Print ``record`` as one JSON line (and log a short summary on stderr)."""
        self.records.append(record)
        self.stream.write(json.dumps(record, default=_json_default) + "\n")
        self.stream.flush()
        log(
            f"{record['benchmark']}: ratio {record['ratio']:.3g} (goal {record['goal']}), "
            f"offaug {record['offaug']:.4g} vs {record['baseline']:.4g} {record['unit']}"
        )


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def interleave(
    offaug: Callable[[], float], baseline: Callable[[], float], repeats: int
) -> tuple[list[float], list[float]]:
    """Run both sides ``repeats`` times, alternating which goes first.

    Each callable does its own untimed setup and returns the seconds of its timed part.

    Returns:
        The offaug times and the baseline times, in seconds.
    """
    times = interleave_many({"offaug": offaug, "baseline": baseline}, repeats)
    return times["offaug"], times["baseline"]


def interleave_many(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Run every side once per repeat, rotating which goes first; their times by name."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(sides[name]())
    return times


def one_cpu_thread() -> None:
    """Torch set up as offaug's Dask workers train: one CPU thread, denormals flushed, freed
    memory kept for reuse (``configure_torch``)."""
    from offaug.algorithms.runtime import configure_torch

    configure_torch(1)


def update_block(trainer: Any, sampler: Any, steps: int) -> float:
    """Seconds for ``steps`` of offaug's training step: sample a batch, update."""
    from offaug.algorithms.batch import TorchBatch

    start = time.perf_counter()
    for _ in range(steps):
        trainer.update(TorchBatch.from_batch(sampler.sample()))
    return time.perf_counter() - start


def d3rlpy_update_block(algo: Any, dataset: Any, batch: int, steps: int) -> float:
    """Seconds for ``steps`` of d3rlpy's training step: ``sample_transition_batch``, update."""
    start = time.perf_counter()
    for _ in range(steps):
        algo.update(dataset.sample_transition_batch(batch))
    return time.perf_counter() - start


def matmul_shapes(trainer: Any, batch: Any, updates: int = 1) -> list[tuple[str, list[list[int]]]]:
    """The matrix multiplies of ``updates`` updates, with their operand shapes (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(updates):
            trainer.update(batch)
    kinds = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
    return [(e.name, [list(s) for s in e.input_shapes]) for e in prof.events() if e.name in kinds]


def plain_matmuls(shapes: list[tuple[str, list[list[int]]]], repeats: int) -> tuple[float, int]:
    """Seconds per pass of the same matmuls done plainly, and their FLOPs per pass.

    One pass is the update's matrix multiplies back to back with nothing else: its inverse is
    the update's *matmul floor*, a step rate no implementation of the same multiplies exceeds.
    """
    import torch

    ops = []
    flops = 0
    for name, operands in shapes:
        if name == "aten::mm":
            a, b = (torch.randn(*operands[0]), torch.randn(*operands[1]))
            ops.append(lambda a=a, b=b: torch.mm(a, b))
            flops += 2 * operands[0][0] * operands[0][1] * operands[1][1]
        elif name == "aten::addmm":
            bias, a, b = (torch.randn(*o) for o in operands[:3])
            ops.append(lambda bias=bias, a=a, b=b: torch.addmm(bias, a, b))
            flops += 2 * operands[1][0] * operands[1][1] * operands[2][1]
        elif name == "aten::bmm":
            a, b = (torch.randn(*operands[0]), torch.randn(*operands[1]))
            ops.append(lambda a=a, b=b: torch.bmm(a, b))
            flops += 2 * operands[0][0] * operands[0][1] * operands[0][2] * operands[1][2]
        else:  # baddbmm
            bias, a, b = (torch.randn(*o) for o in operands[:3])
            ops.append(lambda bias=bias, a=a, b=b: torch.baddbmm(bias, a, b))
            flops += 2 * operands[1][0] * operands[1][1] * operands[1][2] * operands[2][2]
    for op in ops:
        op()
    start = time.perf_counter()
    for _ in range(repeats):
        for op in ops:
            op()
    return (time.perf_counter() - start) / repeats, flops


def calibrate(fn: Callable[[], object], target_s: float, *, cap: int = 1_000_000) -> int:
    """How many calls of ``fn`` take about ``target_s`` seconds (at least one)."""
    count = 1
    while True:
        start = time.perf_counter()
        for _ in range(count):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= target_s / 4 or count >= cap:
            return max(1, min(cap, round(count * target_s / max(elapsed, 1e-9))))
        count *= 4


def throughput_record(
    *,
    benchmark: str,
    unit: str,
    work: float,
    offaug_times: list[float],
    baseline_times: list[float],
    baseline_name: str,
    goal: float | None,
    size: dict[str, Any],
    notes: str,
    baseline_work: float | None = None,
    absolute: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A result record in the shape of BENCHMARKS.md: throughput = work ÷ median time.

    Args:
        work: Units of work (steps, transitions, MB) one offaug measurement does.
        baseline_work: Units one baseline measurement does (default ``work``).
    """
    mine = statistics.median(offaug_times)
    theirs = statistics.median(baseline_times)
    offaug_rate = work / mine
    baseline_rate = (work if baseline_work is None else baseline_work) / theirs
    record: dict[str, Any] = {
        "benchmark": benchmark,
        "unit": unit,
        "offaug": offaug_rate,
        "baseline": baseline_rate,
        "baseline_name": baseline_name,
        "ratio": offaug_rate / baseline_rate,
        "goal": goal,
        "repeats": len(offaug_times),
        "size": size,
        "seconds": {"offaug_median": mine, "baseline_median": theirs},
        "notes": notes,
    }
    if absolute is not None:
        record["absolute"] = absolute
    return record


@contextlib.contextmanager
def scratch_dir(prefix: str = "bench-") -> Iterator[Path]:
    """A temporary directory on the same disk as the datasets, removed afterwards."""
    SCRATCH_ROOT.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=SCRATCH_ROOT))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    """Set an environment variable for the duration of the block."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@dataclass(frozen=True)
class BenchDataset:
    """A generated Minari dataset on disk."""

    env_id: str
    data_format: str
    seed: int
    path: Path
    """The dataset directory (the one holding ``data/``)."""
    episodes: int
    steps: int

    @property
    def data_dir(self) -> Path:
        """Minari's ``data/`` folder."""
        return self.path / "data"


def dataset_id_for(env_id: str, steps: int, data_format: str, seed: int) -> str:
    """The Minari id a cached benchmark dataset is stored under."""
    return f"bench/{env_id.lower()}-s{steps}-{data_format}-seed{seed}-v0"


def ensure_dataset(env_id: str, steps: int, data_format: str, seed: int = 0) -> BenchDataset:
    """The cached dataset for (env, steps, format, seed), generated with Minari when missing.

    A file lock per dataset keeps two benchmark processes from generating the same dataset at once.
    """
    from offaug.datasets import make_dataset
    from offaug.datasets.paths import resolve_dataset_dir

    dataset_id = dataset_id_for(env_id, steps, data_format, seed)
    path = resolve_dataset_dir(dataset_id, MINARI_ROOT)
    MINARI_ROOT.mkdir(parents=True, exist_ok=True)
    lock_name = f".{dataset_id.replace('/', '__')}.lock"
    with open(MINARI_ROOT / lock_name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "data" / "metadata.json").is_file():
            log(
                f"generating {dataset_id} ({env_id}, {steps} steps, {data_format}); "
                "done once and cached in "
                f"{DATA_DIR} (Minari's Arrow writer can take minutes)"
            )
            start = time.perf_counter()
            make_dataset(
                env_id,
                dataset_id,
                steps=steps,
                data_format=data_format,  # type: ignore[arg-type,unused-ignore]
                seed=seed,
                root=MINARI_ROOT,
                overwrite=True,
            )
            log(f"generated {dataset_id} in {time.perf_counter() - start:.1f} s")
    metadata = json.loads((path / "data" / "metadata.json").read_text())
    return BenchDataset(
        env_id=env_id,
        data_format=data_format,
        seed=seed,
        path=path,
        episodes=int(metadata["total_episodes"]),
        steps=int(metadata["total_steps"]),
    )


def learner_data(quick: bool) -> tuple[Any, Any]:
    """The learner benchmarks' data: a Hopper-v5 dataset (10,000 steps with ``quick``, else
    50,000) as offaug's transitions and the same transitions as d3rlpy's dataset."""
    from offaug.datasets import load_transitions
    from offaug.datasets.interop import to_d3rlpy

    generated = ensure_dataset("Hopper-v5", 10_000 if quick else 50_000, "hdf5", seed=0)
    data = load_transitions(generated.path, cache=False)
    return data, to_d3rlpy(data)


def data_fingerprint(data: Any) -> str:
    """A hash of a dataset's transition columns (``offaug.datasets.Transitions``).

    Benchmark datasets are made by offaug's own SAC and cached; a change to that code makes a
    different dataset under the same id, so records carry this to tell which data they measured
    (and runs that join records refuse data that differs)."""
    import numpy as np
    import xxhash

    from offaug.datasets.transitions import REQUIRED_FIELDS

    digest = xxhash.xxh3_64()
    for name in REQUIRED_FIELDS:
        digest.update(np.ascontiguousarray(getattr(data, name)).tobytes())
    return digest.hexdigest()


def load_records(path: Path) -> list[dict[str, Any]]:
    """The records of an earlier run's JSON lines (log lines skipped) or of ``results.json``."""
    import json

    text = path.read_text()
    try:
        loaded = json.loads(text)
        lines = loaded["results"] if isinstance(loaded, dict) else loaded
    except json.JSONDecodeError:
        lines = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    return [record for record in lines if isinstance(record, dict)]
