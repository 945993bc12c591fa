"""Data-layer speed: loading Minari datasets, sampling minibatches, writing shards.

Every figure is offaug ÷ a peer measured in this process, the two interleaved, median of the
repeats (see ``/work/shared/BENCHMARKS.md``):

* ``load_minari_{cold,warm}_{short,long}_{hdf5,arrow}``: ``offaug.datasets.load_transitions``
  against ``minari.MinariDataset(path)`` + ``iterate_episodes`` + concatenation into the same
  arrays. *Cold* starts from an empty ``OFFAUG_CACHE_DIR`` (reads Minari's storage and writes
  the cache); *warm* memory-maps the cache. Both run with the files in the OS page cache. The
  cold records carry the storage floor in ``absolute``: the bare cost of opening and reading
  each stored object (HDF5) or episode file (Arrow) in one process.
* ``sample_batch256_{short,long}``: ``MixtureSampler`` over a memory-mapped shard set against
  d3rlpy 2.8's ``MDPDataset.sample_transition_batch``, both holding offaug's exact transitions.
* ``write_shard_{short,long}``: ``write_shard`` (Arrow IPC + xxh3 checksum + atomic rename)
  against ``np.save`` of every column to its own ``.npy`` file.

Usage: ``python benchmarks/bench_io.py [--quick] [--only load_short_arrow,sample,...]``
(cases: ``load_{short,long}_{hdf5,arrow}``, ``sample``, ``write``; default all). The first run
generates the datasets with Minari (minutes, cached under ``benchmarks/.data/``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BenchDataset,
    Reporter,
    calibrate,
    ensure_dataset,
    env_var,
    interleave,
    interleave_many,
    log,
    protect_stdout,
    scratch_dir,
    throughput_record,
)

SHORT_ENV = "Hopper-v5"  # a random policy falls over after ~20 steps
LONG_ENV = "HalfCheetah-v5"  # never terminates: 1000-step episodes, truncated
SIZES = {
    "quick": {"short": 10_000, "long": 20_000},
    "full": {"short": 50_000, "long": 200_000},
}
GOALS = {
    "cold_short": 3.0,
    "cold_long": 1.2,
    "warm": 100.0,
    "sample": 25.0,
    "write": 0.7,
}
BATCH_SIZE = 256
HDF5_OBJECTS = (b"observations", b"actions", b"rewards", b"terminations", b"truncations")

Arrays = dict[str, npt.NDArray[Any]]


# --------------------------------------------------------------------------- loading


def minari_baseline(data_dir: Path) -> Arrays:
    """Minari's own way to get flat transition arrays: iterate episodes and concatenate.

    ``observations``/``next_observations`` are each episode's ``obs[:-1]``/``obs[1:]``, so next
    observations never cross an episode boundary (the same arrays offaug builds).
    """
    import minari

    dataset = minari.MinariDataset(data_dir)
    episodes = list(dataset.iterate_episodes())
    return {
        "observations": np.concatenate([e.observations[:-1] for e in episodes]),
        "next_observations": np.concatenate([e.observations[1:] for e in episodes]),
        "actions": np.concatenate([e.actions for e in episodes]),
        "rewards": np.concatenate([e.rewards for e in episodes]),
        "terminals": np.concatenate([e.terminations for e in episodes]),
        "timeouts": np.concatenate([e.truncations for e in episodes]),
    }


def sanity_problems(transitions: Any, baseline: Arrays) -> list[str]:
    """Columns where offaug differs from the baseline cast to offaug's dtypes (empty: same)."""
    problems = []
    for name, theirs in baseline.items():
        mine = getattr(transitions, name)
        if not np.array_equal(mine, theirs.astype(mine.dtype)):
            problems.append(f"{name} differs from Minari's")
    return problems


def hdf5_floor(dataset: BenchDataset, repeats: int) -> dict[str, Any]:
    """The bare cost of ``h5d.open`` + ``read_direct_chunk`` per stored object, one process.

    Each repeat opens the file afresh (HDF5's metadata cache cold, as every loader finds it;
    the OS page cache warm) and times, per episode, opening its group and its five transition
    objects and reading each. Objects that are not one uncompressed chunk (observations of
    long episodes) are read with a plain ``read`` into a preallocated array instead, as offaug
    does. What to read is worked out beforehand, through another file handle; the checks
    offaug makes per object are not part of the floor.
    """
    import h5py

    file_path = dataset.data_dir / "main_data.hdf5"
    plan: list[tuple[bytes, list[tuple[bytes, tuple[int, ...] | None, Any]]]] = []
    with h5py.File(file_path, "r") as handle:
        for episode in range(dataset.episodes):
            group_name = f"episode_{episode}".encode()
            group = h5py.h5g.open(handle.id, group_name)
            objects: list[tuple[bytes, tuple[int, ...] | None, Any]] = []
            for name in HDF5_OBJECTS:
                obj = h5py.h5d.open(group, name)
                plist = obj.get_create_plist()
                one_chunk = (
                    plist.get_layout() == h5py.h5d.CHUNKED
                    and plist.get_nfilters() == 0
                    and plist.get_chunk()[0] >= obj.shape[0]
                )
                if one_chunk:
                    objects.append((name, (0,) * len(obj.shape), None))
                else:
                    objects.append((name, None, np.empty(obj.shape, dtype=obj.dtype)))
            plan.append((group_name, objects))
    times = []
    for _ in range(repeats):
        with h5py.File(file_path, "r") as handle:
            root = handle.id
            start = time.perf_counter()
            for group_name, objects in plan:
                group = h5py.h5g.open(root, group_name)
                for name, offset, out in objects:
                    obj = h5py.h5d.open(group, name)
                    if out is None:
                        obj.read_direct_chunk(offset)
                    else:
                        obj.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
            times.append(time.perf_counter() - start)
    elapsed = statistics.median(times)
    count = sum(len(objects) for _, objects in plan)
    return {
        "floor": "per episode: h5g.open + 5 x (h5d.open + read_direct_chunk), fresh file "
        "handle, one process",
        "us_per_object": elapsed / count * 1e6,
        "objects_per_episode": len(HDF5_OBJECTS),
        "one_chunk_fraction": sum(o[2] is None for _, objects in plan for o in objects) / count,
        "floor_steps_per_s": dataset.steps / elapsed,
    }


def arrow_floor(dataset: BenchDataset, repeats: int) -> dict[str, Any]:
    """The bare cost of reading each episode file whole and parsing its IPC stream
    (``pa.ipc.open_stream(bytes[8:]).read_all()``, skipping the file's magic; the cheapest way
    found to read a small Arrow file, cheaper than mapping it and parsing its footer)."""
    import pyarrow as pa

    files = [str(dataset.data_dir / str(i) / "part-0.arrow") for i in range(dataset.episodes)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for file in files:
            with open(file, "rb") as handle:
                data = handle.read()
            pa.ipc.open_stream(pa.py_buffer(data)[8:]).read_all()
        times.append(time.perf_counter() - start)
    elapsed = statistics.median(times)
    return {
        "floor": "open(f).read() + pa.ipc.open_stream(bytes[8:]).read_all() per episode file, "
        "one process",
        "us_per_file": elapsed / len(files) * 1e6,
        "floor_steps_per_s": dataset.steps / elapsed,
    }


def bench_load(
    dataset: BenchDataset, kind: str, repeats: int, reporter: Reporter
) -> tuple[bool, Any]:
    """Cold and warm ``load_transitions`` against Minari; returns (sanity ok, transitions)."""
    from offaug.datasets import load_transitions
    from offaug.datasets.minari_reader import _PARALLEL_MIN_EPISODES

    path = str(dataset.path)
    label = f"{kind}_{dataset.data_format}"
    log(f"loading {label}: {dataset.steps} steps, {dataset.episodes} episodes")

    def offaug_cold() -> float:
        with scratch_dir("cache-") as cache, env_var("OFFAUG_CACHE_DIR", str(cache)):
            start = time.perf_counter()
            load_transitions(path)
            return time.perf_counter() - start

    def baseline() -> float:
        start = time.perf_counter()
        minari_baseline(dataset.data_dir)
        return time.perf_counter() - start

    # Untimed warm-up of both sides (imports, the fork server of the reader's workers, the page
    # cache), and the sanity check that both did the same work.
    with scratch_dir("cache-") as cache, env_var("OFFAUG_CACHE_DIR", str(cache)):
        transitions = load_transitions(path)
    problems = sanity_problems(transitions, minari_baseline(dataset.data_dir))

    with scratch_dir("cache-") as warm_cache, env_var("OFFAUG_CACHE_DIR", str(warm_cache)):
        load_transitions(path)  # writes the cache

        def offaug_warm() -> float:
            with env_var("OFFAUG_CACHE_DIR", str(warm_cache)):
                start = time.perf_counter()
                load_transitions(path)
                return time.perf_counter() - start

        if not load_transitions(path).equals(transitions):
            problems.append("warm load differs from cold load")
        # Cold, warm and Minari in turn, rotating which goes first: the two offaug records share
        # the baseline's measurements.
        times = interleave_many(
            {"cold": offaug_cold, "warm": offaug_warm, "baseline": baseline}, repeats
        )
    ok = not problems
    sanity = "sanity check passed: every column equals Minari's (cast to offaug's dtypes)"
    if not ok:
        sanity = f"SANITY CHECK FAILED: {'; '.join(problems)}"
        log(sanity)
    cold_mine, warm_mine, theirs = times["cold"], times["warm"], times["baseline"]

    floor = (hdf5_floor if dataset.data_format == "hdf5" else arrow_floor)(dataset, 3)
    cold_rate = dataset.steps / statistics.median(cold_mine)
    floor["offaug_cold_vs_floor"] = cold_rate / floor["floor_steps_per_s"]
    workers = os.cpu_count() or 1
    parallel = dataset.data_format == "hdf5" and dataset.episodes >= _PARALLEL_MIN_EPISODES
    size = {
        "steps": dataset.steps,
        "episodes": dataset.episodes,
        "env": dataset.env_id,
        "format": dataset.data_format,
    }
    common_notes = (
        f"{sanity}. Minari also reads infos/qpos and infos/qvel (it has no way to skip them); "
        "offaug reads only the transition columns. Files are in the OS page cache."
    )
    reporter.emit(
        throughput_record(
            benchmark=f"load_minari_cold_{label}",
            unit="steps/s",
            work=dataset.steps,
            offaug_times=cold_mine,
            baseline_times=theirs,
            baseline_name="minari.MinariDataset + iterate_episodes + np.concatenate",
            goal=GOALS[f"cold_{kind}"],
            size=size,
            notes=(
                "cold: empty OFFAUG_CACHE_DIR every repeat, so offaug reads Minari's storage "
                "and writes its shard cache (checksummed). "
                + (
                    f"Read with {workers} processes. "
                    if parallel
                    else f"Read in one process (below {_PARALLEL_MIN_EPISODES} episodes or Arrow). "
                )
                + "absolute.floor_steps_per_s is one process's bare storage cost. "
                + common_notes
            ),
            absolute=floor,
        )
    )

    reporter.emit(
        throughput_record(
            benchmark=f"load_minari_warm_{label}",
            unit="steps/s",
            work=dataset.steps,
            offaug_times=warm_mine,
            baseline_times=theirs,
            baseline_name="minari.MinariDataset + iterate_episodes + np.concatenate",
            goal=GOALS["warm"],
            size=size,
            notes=(
                "warm: the shard cache exists; offaug memory-maps it, verifies its xxh3 "
                "checksum and checks every float is finite. " + common_notes
            ),
        )
    )
    return ok, transitions


# --------------------------------------------------------------------------- sampling


def d3rlpy_arrays(transitions: Any) -> Arrays:
    """offaug's transitions as d3rlpy's flat arrays (see ``offaug.datasets.interop``)."""
    from offaug.datasets.interop import to_d3rlpy_arrays

    return to_d3rlpy_arrays(transitions)


def bench_sample(
    transitions: Any, kind: str, repeats: int, target_s: float, reporter: Reporter
) -> bool:
    """Minibatches of 256 from a memory-mapped shard set against d3rlpy's replay buffer."""
    import d3rlpy
    from d3rlpy.dataset import MDPDataset

    from offaug.datasets import MixtureSampler, ShardSet, write_shard_set

    log(f"sampling {kind}: {len(transitions)} transitions")
    d3rlpy.seed(0)
    replay = MDPDataset(**d3rlpy_arrays(transitions))
    with scratch_dir("shards-") as scratch:
        write_shard_set(transitions, scratch / "set", overwrite=True)
        sampler = MixtureSampler([ShardSet.open(scratch / "set")], BATCH_SIZE, seed=0)
        mine_batch = sampler.sample()
        theirs_batch = replay.sample_transition_batch(BATCH_SIZE)
        same = (
            replay.transition_count == len(transitions)
            and len(mine_batch) == len(theirs_batch) == BATCH_SIZE
            and mine_batch.observations.shape[1:] == theirs_batch.observations.shape[1:]
            and mine_batch.next_observations.shape == theirs_batch.next_observations.shape
        )
        if not same:
            log("SANITY CHECK FAILED: d3rlpy's buffer or batch differs from offaug's")
        mine_count = calibrate(sampler.sample, target_s)
        theirs_count = calibrate(lambda: replay.sample_transition_batch(BATCH_SIZE), target_s)

        def mine() -> float:
            start = time.perf_counter()
            for _ in range(mine_count):
                sampler.sample()
            return time.perf_counter() - start

        def theirs() -> float:
            start = time.perf_counter()
            for _ in range(theirs_count):
                replay.sample_transition_batch(BATCH_SIZE)
            return time.perf_counter() - start

        mine_times, theirs_times = interleave(mine, theirs, repeats)
    reporter.emit(
        throughput_record(
            benchmark=f"sample_batch{BATCH_SIZE}_{kind}",
            unit="transitions/s",
            work=mine_count * BATCH_SIZE,
            baseline_work=theirs_count * BATCH_SIZE,
            offaug_times=mine_times,
            baseline_times=theirs_times,
            baseline_name="d3rlpy 2.8 MDPDataset.sample_transition_batch",
            goal=GOALS["sample"],
            size={
                "transitions": len(transitions),
                "episodes": transitions.num_episodes,
                "batch_size": BATCH_SIZE,
                "batches_per_repeat": {"offaug": mine_count, "baseline": theirs_count},
            },
            notes=(
                ("sanity check passed" if same else "SANITY CHECK FAILED")
                + ": d3rlpy holds exactly offaug's transitions. offaug: MixtureSampler over a "
                "memory-mapped one-shard ShardSet. d3rlpy is fed offaug's arrays (not its own "
                "Minari loader): its picker would drop the last step of every truncated "
                "episode (no next row), so each truncated episode gets one extra row with the "
                "true final next observation and the timeout flag; terminal steps get d3rlpy's "
                "zero next observation. d3rlpy also returns next_action, rewards_to_go and "
                "intervals; offaug returns weights and set_index."
            ),
        )
    )
    return same


# --------------------------------------------------------------------------- writing


def bench_write(
    transitions: Any, kind: str, repeats: int, target_s: float, reporter: Reporter
) -> None:
    """``write_shard`` against ``np.save`` per column, in MB/s of column data."""
    from offaug.datasets import write_shard

    columns = {**transitions.columns(), **transitions.extras}
    megabytes = sum(v.nbytes for v in columns.values()) / 1e6
    log(f"writing {kind}: {megabytes:.1f} MB in {len(columns)} columns")

    def write_mine(directory: Path, i: int) -> None:
        write_shard(transitions, directory / f"shard-{i}.arrow")

    def write_theirs(directory: Path, i: int) -> None:
        for name, values in columns.items():
            np.save(directory / f"{i}-{name}.npy", values)

    def timed(write: Callable[[Path, int], None], count: int) -> float:
        with scratch_dir("write-") as directory:
            start = time.perf_counter()
            for i in range(count):
                write(directory, i)
            return time.perf_counter() - start

    # Each measurement writes `count` copies (so that small datasets still take a while).
    per_write = min(timed(write_mine, 1), timed(write_theirs, 1))
    count = max(1, round(target_s / max(per_write, 1e-6)))
    mine_times, theirs_times = interleave(
        lambda: timed(write_mine, count), lambda: timed(write_theirs, count), repeats
    )
    reporter.emit(
        throughput_record(
            benchmark=f"write_shard_{kind}",
            unit="MB/s",
            work=megabytes * count,
            offaug_times=mine_times,
            baseline_times=theirs_times,
            baseline_name="np.save per column",
            goal=GOALS["write"],
            size={
                "transitions": len(transitions),
                "megabytes": megabytes,
                "columns": list(columns),
                "writes_per_repeat": count,
            },
            notes=(
                "Same columns on both sides, written to the page cache (no fsync). write_shard "
                "also hashes the file it wrote (xxh3-128) and renames it into place."
            ),
        )
    )


# --------------------------------------------------------------------------- main


LOAD_CASES = tuple(
    f"load_{kind}_{data_format}" for kind in ("short", "long") for data_format in ("hdf5", "arrow")
)
CASES = (*LOAD_CASES, "sample", "write")


def main(argv: list[str] | None = None) -> int:
    """Run the data-layer benchmarks; exit 1 when a sanity check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, about a minute")
    parser.add_argument(
        "--only",
        default=",".join(CASES),
        help=f"comma-separated cases to measure, of {', '.join(CASES)} (default: all)",
    )
    args = parser.parse_args(argv)
    only = [case for case in args.only.split(",") if case]
    unknown = sorted(set(only) - set(CASES))
    if unknown:
        parser.error(f"--only: unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    reporter = Reporter(protect_stdout())
    mode = "quick" if args.quick else "full"
    repeats = 7 if args.quick else 9
    target_s = 0.1 if args.quick else 0.3
    started = time.perf_counter()
    log(f"bench_io ({mode}); missing datasets are generated first and cached")
    # Sampling and writing use the HDF5 sets' transitions, loaded unmeasured when their load
    # case is not asked for.
    needs_transitions = "sample" in only or "write" in only
    wanted = {
        (kind, data_format)
        for kind in ("short", "long")
        for data_format in ("hdf5", "arrow")
        if f"load_{kind}_{data_format}" in only or (needs_transitions and data_format == "hdf5")
    }
    datasets = {
        (kind, data_format): ensure_dataset(env, SIZES[mode][kind], data_format)
        for kind, env in (("short", SHORT_ENV), ("long", LONG_ENV))
        for data_format in ("hdf5", "arrow")
        if (kind, data_format) in wanted
    }
    ok = True
    loaded = {}
    for (kind, data_format), dataset in datasets.items():
        if f"load_{kind}_{data_format}" in only:
            good, transitions = bench_load(dataset, kind, repeats, reporter)
            ok &= good
        else:
            from offaug.datasets import load_transitions

            transitions = load_transitions(str(dataset.path), cache=False)
        if data_format == "hdf5":
            loaded[kind] = transitions
    if "sample" in only:
        for kind, transitions in loaded.items():
            ok &= bench_sample(transitions, kind, repeats, target_s, reporter)
    if "write" in only:
        for kind, transitions in loaded.items():
            bench_write(transitions, kind, repeats, target_s, reporter)
    log(f"bench_io done in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
