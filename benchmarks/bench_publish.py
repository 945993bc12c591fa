"""Publishing speed: ``offaug.datasets.publish.publish_dataset`` against Minari's own writer.

Both sides write the same episodes as a Minari dataset, in Hopper-v5's spaces, from memory:

* offaug: ``publish_dataset([transitions], ...)`` from a :class:`Transitions` (it also checks
  the episodes, hashes every file and writes the dataset card);
* baseline: ``minari.create_dataset_from_buffers`` from prebuilt ``EpisodeBuffer`` objects
  (observations already float64, rewards float64: no conversion left for Minari to do).

Records ``publish_{short,long}_{hdf5,arrow}`` in steps/s, interleaved, median of the repeats.
Short episodes are 10-30 steps (a falling Hopper), long ones 1000 steps (truncated). The data
is synthetic (random values in Hopper's spaces), so no simulator time is involved. After the
timed runs both datasets are read back with ``minari.MinariDataset`` and compared episode by
episode (the sanity check that both sides did the same work).

Both sides always write the same number of episodes. Minari's Arrow writer rewrites
``metadata.json`` and walks the whole dataset directory after every episode, so its cost grows
with the square of the episode count (about three minutes for the full short-episode size): in
the full run that one measurement is made once, between offaug's repeats, rather than repeated,
and the record shows Minari's rate at a tenth of the episodes beside it (``by_episodes``), to
make the dependence on size visible. The HDF5 records carry the cost of each object HDF5
creates (group, attribute, one-chunk dataset), measured in the same run, as ``absolute``; the
Arrow records the bare file-system cost of Minari's one-directory-per-episode layout.

Usage: ``python benchmarks/bench_publish.py [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Reporter,
    env_var,
    interleave,
    log,
    protect_stdout,
    throughput_record,
)

ENV_ID = "Hopper-v5"
SIZES: dict[str, dict[str, int]] = {
    "quick": {"short": 5_000, "long": 20_000},
    "full": {"short": 50_000, "long": 200_000},
}
GOALS = {"short_hdf5": 5.0, "short_arrow": 50.0, "long_hdf5": 1.5, "long_arrow": 1.5}
# Minari's optional metadata, the same on both sides (unset ones make Minari warn).
MINARI_INFO = {
    "algorithm_name": "bench",
    "author": "offaug",
    "author_email": "offaug@users.noreply.invalid",
    "code_permalink": "https://pypi.org/project/offaug/",
    "description": "offaug publishing benchmark",
}
STEP_KEYS = ("observations", "actions", "rewards", "terminations", "truncations")
# Where both sides write (--scratch): the system's temporary directory by default, not
# benchmarks/.data, because creating files in the repository's tree can be several times slower
# (a file watcher on the working tree) and would measure that instead of the writers.
SCRATCH: dict[str, str | None] = {"dir": None}


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory under ``--scratch`` (default: the system temp dir), removed after."""
    with tempfile.TemporaryDirectory(prefix=f"offaug-{prefix}", dir=SCRATCH["dir"]) as path:
        yield Path(path)


# --------------------------------------------------------------------------- data


def synthetic_transitions(kind: str, steps: int, seed: int = 0) -> Any:
    """Whole episodes in Hopper-v5's spaces: ``short`` 10-30 steps ending in a termination,
    ``long`` 1000 steps ending in a truncation; at least ``steps`` steps in total."""
    import gymnasium as gym
    from minari.serialization import serialize_space

    from offaug.datasets import Transitions

    rng = np.random.default_rng(seed)
    if kind == "short":
        lengths = rng.integers(10, 31, size=steps // 10 + 1)
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), steps)) + 1]
    else:
        lengths = np.full(-(-steps // 1000), 1000)
    episodes = len(lengths)
    total = int(lengths.sum())
    env = gym.make(ENV_ID)
    # Each episode's N+1 observations; a step's next observation is the following one.
    stored = rng.normal(size=(total + episodes, 11)).astype(np.float32)
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    step_rows = np.arange(total) + np.repeat(np.arange(episodes), lengths)
    last = bounds[1:] - 1
    terminals = np.zeros(total, dtype=bool)
    timeouts = np.zeros(total, dtype=bool)
    (terminals if kind == "short" else timeouts)[last] = True
    transitions = Transitions(
        observations=stored[step_rows],
        actions=rng.uniform(-1, 1, size=(total, 3)).astype(np.float32),
        rewards=rng.normal(size=total).astype(np.float32),
        next_observations=stored[step_rows + 1],
        terminals=terminals,
        timeouts=timeouts,
        episode_ids=np.repeat(np.arange(episodes, dtype=np.int64), lengths),
        meta={
            "observation_space": serialize_space(env.observation_space),
            "action_space": serialize_space(env.action_space),
            "env_spec": env.spec.to_json() if env.spec is not None else None,
        },
    )
    env.close()  # type: ignore[no-untyped-call]
    return transitions


def episode_buffers(transitions: Any) -> list[Any]:
    """The same episodes as Minari ``EpisodeBuffer`` objects, in the spaces' dtypes."""
    from minari.data_collector import EpisodeBuffer

    buffers = []
    for index, episode in enumerate(transitions.iter_episodes()):
        observations = np.concatenate(
            (episode.observations, episode.next_observations[-1:])
        ).astype(np.float64)
        buffers.append(
            EpisodeBuffer(
                id=index,
                observations=observations,
                actions=np.array(episode.actions),
                rewards=episode.rewards.astype(np.float64),
                terminations=np.array(episode.terminals),
                truncations=np.array(episode.timeouts),
            )
        )
    return buffers


# --------------------------------------------------------------------------- writers


def publish_offaug(transitions: Any, root: Path, dataset_id: str, data_format: str) -> float:
    from offaug.datasets.publish import publish_dataset

    start = time.perf_counter()
    publish_dataset(
        [transitions],
        dataset_id,
        root=root,
        data_format=data_format,
        **MINARI_INFO,
    )
    return time.perf_counter() - start


def publish_minari(buffers: list[Any], root: Path, dataset_id: str, data_format: str) -> float:
    import gymnasium as gym
    import minari

    spec = gym.spec(ENV_ID)
    with env_var("MINARI_DATASETS_PATH", str(root)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        minari.create_dataset_from_buffers(
            dataset_id=dataset_id,
            buffer=buffers,
            env=spec,
            data_format=data_format,
            **MINARI_INFO,
        )
        return time.perf_counter() - start


def read_back(path: Path) -> list[dict[str, npt.NDArray[Any]]]:
    """Every episode as Minari reads it."""
    import minari

    dataset = minari.MinariDataset(path / "data")
    return [
        {key: getattr(episode, key) for key in STEP_KEYS} for episode in dataset.iterate_episodes()
    ]


def same_episodes(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> bool:
    return len(mine) == len(theirs) and all(
        a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key])
        for a, b in zip(mine, theirs, strict=True)
        for key in STEP_KEYS
    )


# --------------------------------------------------------------------------- floors


def hdf5_object_costs(
    repeats: int, objects: int = 2000, in_memory: bool = False
) -> dict[str, float]:
    """Microseconds HDF5 takes to create a group, an int64 attribute and a one-chunk resizable
    dataset (21x11 float64, written with ``write_direct_chunk``), via h5py's low-level API;
    ``in_memory`` builds the file with the core driver (as offaug does for files that fit)."""
    import h5py
    from h5py import h5a, h5d, h5g, h5p, h5s, h5t

    values = np.zeros((21, 11))
    times: dict[str, list[float]] = {"group": [], "attribute": [], "dataset": []}
    with scratch_dir("h5floor-") as scratch:
        for repeat in range(repeats):
            driver = {"driver": "core", "backing_store": True} if in_memory else {}
            with h5py.File(scratch / f"floor-{repeat}.h5", "w", **driver) as handle:
                root = handle.id
                dcpl = h5p.create(h5p.DATASET_CREATE)
                dcpl.set_chunk(values.shape)
                dcpl.set_obj_track_times(False)
                space = h5s.create_simple(values.shape, (h5s.UNLIMITED, 11))
                float_type = h5t.py_create(values.dtype, logical=True)
                int_type = h5t.py_create(np.dtype(np.int64), logical=True)
                scalar = h5s.create(h5s.SCALAR)
                one = np.array(1, dtype=np.int64)
                start = time.perf_counter()
                groups = [h5g.create(root, f"g{i}".encode()) for i in range(objects)]
                times["group"].append(time.perf_counter() - start)
                start = time.perf_counter()
                for group in groups:
                    h5a.create(group, b"id", int_type, scalar).write(one)
                times["attribute"].append(time.perf_counter() - start)
                start = time.perf_counter()
                for group in groups:
                    dataset = h5d.create(group, b"d", float_type, space, dcpl=dcpl)
                    dataset.write_direct_chunk((0, 0), values.data)
                times["dataset"].append(time.perf_counter() - start)
    return {name: statistics.median(t) / objects * 1e6 for name, t in times.items()}


def hdf5_absolute(transitions: Any, offaug_rate: float, repeats: int) -> dict[str, Any]:
    """HDF5's object-creation floor for these episodes (the bytes themselves not counted: it
    binds for short episodes, not for long ones)."""

    def floor(costs: dict[str, float]) -> float:
        # Per episode Minari's layout has a group, two attributes (id, total_steps) and five
        # datasets (observations, actions, rewards, terminations, truncations).
        per_episode_us = costs["group"] + 2 * costs["attribute"] + 5 * costs["dataset"]
        return len(transitions) / (transitions.num_episodes * per_episode_us * 1e-6)

    on_disk = hdf5_object_costs(repeats)
    in_memory = hdf5_object_costs(repeats, in_memory=True)
    best = max(floor(on_disk), floor(in_memory))
    return {
        "floor": (
            "HDF5 object creation only (h5py low-level), one process, same run; the faster of "
            "a file on disk and one built in memory (core driver), which offaug uses for files "
            "up to 256 MiB"
        ),
        "us_per_group": on_disk["group"],
        "us_per_attribute": on_disk["attribute"],
        "us_per_dataset": on_disk["dataset"],
        "in_memory_us_per_group": in_memory["group"],
        "in_memory_us_per_attribute": in_memory["attribute"],
        "in_memory_us_per_dataset": in_memory["dataset"],
        "objects_per_episode": {"group": 1, "attribute": 2, "dataset": 5},
        "on_disk_floor_steps_per_s": floor(on_disk),
        "in_memory_floor_steps_per_s": floor(in_memory),
        "floor_steps_per_s": best,
        "offaug_vs_floor": offaug_rate / best,
    }


def arrow_absolute(
    transitions: Any, offaug_rate: float, repeats: int, part_bytes: int
) -> dict[str, Any]:
    """The bare file-system cost of Minari's Arrow layout: per episode one directory and two
    files (``os.mkdir`` + ``open``/``write``, as offaug does; the episode file as large as
    offaug's on average), one process."""
    episodes = transitions.num_episodes
    part = b"x" * part_bytes
    metadata = b'{"id": 0, "total_steps": 20}'
    times = []
    with scratch_dir("arrowfloor-") as scratch:
        for repeat in range(repeats):
            base = f"{scratch}/{repeat}"
            os.mkdir(base)
            start = time.perf_counter()
            for episode in range(episodes):
                directory = f"{base}/{episode}"
                os.mkdir(directory)
                with open(f"{directory}/part-0.arrow", "wb") as handle:
                    handle.write(part)
                with open(f"{directory}/metadata.json", "wb") as handle:
                    handle.write(metadata)
            times.append(time.perf_counter() - start)
    floor = len(transitions) / statistics.median(times)
    return {
        "floor": "os.mkdir + two file writes per episode, one process, same run",
        "bytes_per_episode_file": part_bytes,
        "us_per_episode": statistics.median(times) / episodes * 1e6,
        "floor_steps_per_s": floor,
        "offaug_vs_floor": offaug_rate / floor,
    }


# --------------------------------------------------------------------------- benchmark


def bench(
    kind: str, data_format: str, steps: int, repeats: int, baseline_once: bool
) -> dict[str, Any]:
    """One ``publish_{kind}_{format}`` record; ``baseline_once`` times Minari's side once."""
    transitions = synthetic_transitions(kind, steps)
    baseline_buffers = episode_buffers(transitions)
    label = f"{kind}_{data_format}"
    log(f"publish {label}: {len(transitions)} steps, {transitions.num_episodes} episodes")
    counter = iter(range(10_000))

    def mine() -> float:
        with scratch_dir("publish-") as scratch:
            return publish_offaug(
                transitions, scratch, f"bench/{label}-{next(counter)}-v0", data_format
            )

    def theirs(buffers: list[Any] = baseline_buffers) -> float:
        with scratch_dir("minari-") as scratch:
            return publish_minari(
                buffers, scratch, f"bench/{label}-{next(counter)}-v0", data_format
            )

    # Untimed: warm-up of both sides and the sanity check (both read back through Minari),
    # except for a slow baseline, whose single timed run is checked instead.
    with scratch_dir("sanity-") as scratch:
        publish_offaug(transitions, scratch, "bench/mine-v0", data_format)
        part_files = list((scratch / "bench" / "mine-v0" / "data").glob("*/part-0.arrow"))
        part_bytes = sum(f.stat().st_size for f in part_files) // max(1, len(part_files))
        ours = read_back(scratch / "bench" / "mine-v0")
        if baseline_once:
            mine_times = [mine() for _ in range(repeats // 2)]
            log(f"publish {label}: Minari's single timed run (quadratic in the episode count)")
            start = time.perf_counter()
            publish_minari(baseline_buffers, scratch, "bench/theirs-v0", data_format)
            theirs_times = [time.perf_counter() - start]
            mine_times += [mine() for _ in range(repeats - repeats // 2)]
        else:
            publish_minari(baseline_buffers, scratch, "bench/theirs-v0", data_format)
        ok = same_episodes(ours, read_back(scratch / "bench" / "theirs-v0"))
    if not ok:
        log(f"SANITY CHECK FAILED: {label} episodes differ between offaug and Minari")
    if not baseline_once:
        mine_times, theirs_times = interleave(mine, theirs, repeats)
    offaug_rate = len(transitions) / statistics.median(mine_times)
    absolute = (
        hdf5_absolute(transitions, offaug_rate, 3)
        if data_format == "hdf5"
        else arrow_absolute(transitions, offaug_rate, 3, part_bytes)
    )
    where = SCRATCH["dir"] or tempfile.gettempdir()
    notes = (
        ("sanity check passed" if ok else "SANITY CHECK FAILED")
        + ": both datasets read back with minari.MinariDataset.iterate_episodes give identical "
        "observations, actions, rewards, terminations and truncations (dtypes included). "
        f"Synthetic episodes in Hopper-v5's spaces, written under {where} (page cache, no "
        "fsync). offaug also checks observation continuity, hashes every file (xxh3-128), "
        "writes the dataset card and renames the dataset into place; Minari's inputs are "
        "prebuilt EpisodeBuffers already in the spaces' dtypes."
    )
    by_episodes = None
    if data_format == "arrow" and kind == "short":
        notes += (
            " Minari's Arrow writer is quadratic in the episode count (it rewrites "
            "metadata.json and walks the dataset directory after each episode), so its rate "
            "falls as the dataset grows; 'by_episodes' gives its rate on the first tenth of "
            "the episodes (one run) beside the measured full-size one."
        )
        if baseline_once:
            notes += " Minari's full-size run is timed once, between offaug's repeats."
        tenth = baseline_buffers[: max(1, len(baseline_buffers) // 10)]
        tenth_steps = sum(len(b.rewards) for b in tenth)
        by_episodes = {
            str(len(tenth)): tenth_steps / theirs(tenth),
            str(len(baseline_buffers)): len(transitions) / statistics.median(theirs_times),
        }
    record = throughput_record(
        benchmark=f"publish_{label}",
        unit="steps/s",
        work=len(transitions),
        offaug_times=mine_times,
        baseline_times=theirs_times,
        baseline_name="minari.create_dataset_from_buffers",
        goal=GOALS[label],
        size={
            "steps": len(transitions),
            "episodes": transitions.num_episodes,
            "env_spaces": ENV_ID,
            "format": data_format,
        },
        notes=notes,
        absolute=absolute,
    )
    record["baseline_repeats"] = len(theirs_times)
    if by_episodes is not None:
        record["by_episodes"] = {"unit": "Minari steps/s by episode count", **by_episodes}
    return record | {"sanity": ok}


def main(argv: list[str] | None = None) -> int:
    """Run every publishing benchmark; exit 1 when a sanity check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, about a minute")
    parser.add_argument(
        "--scratch", default=None, help="directory to write the datasets in (default: $TMPDIR)"
    )
    args = parser.parse_args(argv)
    SCRATCH["dir"] = args.scratch
    reporter = Reporter(protect_stdout())
    mode = "quick" if args.quick else "full"
    sizes = SIZES[mode]
    repeats = 5
    started = time.perf_counter()
    log(f"bench_publish ({mode}), writing under {args.scratch or tempfile.gettempdir()}")
    ok = True
    for kind in ("short", "long"):
        for data_format in ("hdf5", "arrow"):
            once = mode == "full" and (kind, data_format) == ("short", "arrow")
            record = bench(kind, data_format, sizes[kind], repeats, once)
            ok = ok and bool(record.pop("sanity"))
            reporter.emit(record)
    log(f"bench_publish done in {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
