"""Pipeline scaling and orchestration overhead.

* ``rollout_stage_2_vs_1_workers``: the rollout stage's tasks (real Hopper-v5 rollouts of a BC
  policy, one shard each) on a LocalCluster of two single-threaded worker processes against
  one, on this 2-core machine. Both clusters are up and warmed (modules imported) before
  timing, and the runs alternate between them (median of the repeats). The full run uses the
  rollout section of ``workflows/hopper_cql.yaml`` (the shipped real-size workflow: its
  episodes, tasks, parallel environments and noise); the policy is a BC model of a small
  random-action dataset, whose episodes are short, so each task is small and the dispatch
  overhead weighs more than in the real workflow. ``absolute`` holds the same clusters'
  scaling on a bare simulator loop (two ``env.step`` loops, no offaug code): the machine's
  own 2-vs-1 limit at that moment.
* ``orchestration_overhead``: ``workflows/quickstart.yaml`` (full size; a smaller workflow with
  ``--quick``) through ``run_workflow`` on a fresh LocalCluster, twice (the mean is reported).
  The overhead is the wall time minus the least time the stages' own compute needs on these
  workers, ``max(critical path, sum / workers)``, as a share of the wall time. The plainer
  literal figure, wall minus the *sum* of stage times, is reported beside it per run; with
  stages in parallel it is negative.

Usage: ``python benchmarks/bench_pipeline.py [--quick]``; JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Reporter, interleave_many, log, protect_stdout, scratch_dir


def _workflow(root: Path, quick: bool, tasks: int, episodes: int) -> Any:
    from offaug.pipeline.schema.workflow import Workflow

    return Workflow.model_validate(
        {
            "name": "bench-pipeline",
            "source": {
                "dataset": "bench/pipeline-hopper-v0",
                "make": {"env": "Hopper-v5", "steps": 3000, "seed": 0},
            },
            "bc": {"steps": 300 if quick else 1000, "hidden": [64, 64]},
            "rollout": {"episodes": episodes, "tasks": tasks, "n_envs": 8, "start": "dataset"},
            "train": {
                "algorithms": ["bc"],
                "steps": 500 if quick else 2000,
                "configs": {"bc": {"hidden": [64, 64]}},
            },
            "evaluation": {"episodes": 2},
            "diagnostics": {"enabled": False},
            "shards": str(root / "shards"),
        }
    )


def _critical_path(stages: dict[str, Any]) -> float:
    memo: dict[str, float] = {}

    def finish(name: str) -> float:
        if name not in memo:
            record = stages[name]
            before = max((finish(i) for i in record.get("inputs", []) if i in stages), default=0.0)
            memo[name] = before + float(record.get("seconds") or 0.0)
        return memo[name]

    return max((finish(n) for n in stages), default=0.0)


def _bare_steps(steps: int) -> float:
    """Seconds for ``steps`` Hopper-v5 steps with zero actions (resetting when done)."""
    import gymnasium as gym
    import numpy as np

    env = gym.make("Hopper-v5")
    env.reset(seed=0)
    action = np.zeros(env.action_space.shape, dtype=np.float32)
    start = time.perf_counter()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()
    seconds = time.perf_counter() - start
    env.close()  # type: ignore[no-untyped-call]
    return seconds


def _rollout_stage(client: Any, data: Any, bc: Any, config: Any, out: Path) -> float:
    from offaug.pipeline.stages import rollouts as rollout_stages

    start = time.perf_counter()
    futures = [
        client.submit(rollout_stages.rollout_shard, data, bc, config, str(out), 0, i, pure=False)
        for i in range(config.tasks)
    ]
    client.gather(futures)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="about a minute")
    args = parser.parse_args(argv)
    out = protect_stdout()
    reporter = Reporter(out)
    from distributed import Client, LocalCluster

    from offaug.pipeline.engine.graph import run_workflow
    from offaug.pipeline.engine.workers import WorkerSetup
    from offaug.pipeline.schema.workflow import load_workflow
    from offaug.pipeline.stages import learning as stages

    workflows = Path(__file__).resolve().parents[1] / "workflows"
    repeats = 3 if args.quick else 9
    with scratch_dir("pipeline-") as root:
        os.environ["MINARI_DATASETS_PATH"] = str(root / "minari")
        os.environ["OFFAUG_CACHE_DIR"] = str(root / "cache")
        workflow = _workflow(root, args.quick, 4, 80)
        if args.quick:
            measured = workflow
            rollout = workflow.rollout
        else:
            measured = load_workflow(workflows / "quickstart.yaml")
            measured = measured.model_copy(update={"publish": None})
            rollout = load_workflow(workflows / "hopper_cql.yaml").rollout
        # Two whole runs, each into a fresh run directory on a fresh LocalCluster (its start
        # and shutdown included); the first also makes the source dataset (stage compute).
        runs = []
        for index in range(1 if args.quick else 2):
            log(f"end-to-end workflow {measured.name} for the orchestration overhead ({index})")
            result = run_workflow(measured, root / f"run-{index}")
            records = json.loads((root / f"run-{index}" / "stages.json").read_text())["stages"]
            critical = _critical_path(records)
            total = sum(float(r.get("seconds") or 0.0) for r in records.values())
            workers = os.cpu_count() or 1
            needed = max(critical, total / workers)
            runs.append(
                {
                    "overhead": (result.wall_seconds - needed) / result.wall_seconds,
                    "wall_s": result.wall_seconds,
                    "critical_path_s": critical,
                    "least_compute_time_s": needed,
                    "sum_of_stage_compute_s": total,
                    "wall_minus_sum_share": (result.wall_seconds - total) / result.wall_seconds,
                }
            )
        overhead = statistics.mean(r["overhead"] for r in runs)
        reporter.emit(
            {
                "benchmark": "orchestration_overhead",
                "unit": "share of wall time",
                "offaug": overhead,
                "baseline": statistics.mean(r["wall_s"] for r in runs),
                "baseline_name": "wall time of the run (s)",
                "ratio": overhead,
                "goal": 0.10,
                "goal_direction": "at most",
                "repeats": len(runs),
                "size": {"workflow": measured.name, "stages": len(records), "workers": workers},
                "absolute": {"runs": runs},
                "notes": (
                    "overhead = (wall - max(critical path, stage compute / workers)) / wall, "
                    "mean of the runs; LocalCluster start, worker imports and shutdown "
                    "included; lower is better"
                ),
            }
        )
        if not args.quick:
            run_workflow(
                workflow.model_copy(
                    update={
                        "train": workflow.train.model_copy(
                            update={"algorithms": ("bc",), "baseline": False}
                        )
                    }
                ),
                root / "small",
            )
            records = json.loads((root / "small" / "stages.json").read_text())["stages"]
        data = stages.prepare_source(workflow.source)
        bc = json.loads(json.dumps(records["bc"]["result"]))
        from offaug.pipeline.contracts import ModelRef

        bc_ref = ModelRef(**{k: v for k, v in bc.items() if k != "__type__"})
        # Both clusters stay up and the stage runs alternate between them, so a change in the
        # machine's load during the measurement hits both sides alike (an idle cluster's
        # workers only heartbeat).
        with contextlib.ExitStack() as stack:
            clients = {}
            for count in (1, 2):
                cluster = stack.enter_context(
                    LocalCluster(
                        n_workers=count,
                        threads_per_worker=1,
                        processes=True,
                        dashboard_address=":0",
                    )
                )
                client = stack.enter_context(Client(cluster))
                client.register_plugin(WorkerSetup(1))
                _rollout_stage(client, data, bc_ref, rollout, root / f"warm{count}")
                clients[count] = client
            counter = iter(range(1_000_000))

            def run_on(workers: int) -> float:
                out = root / f"r{workers}-{next(counter)}"
                return _rollout_stage(clients[workers], data, bc_ref, rollout, out)

            def bare_on(workers: int) -> float:
                start = time.perf_counter()
                futures = [
                    clients[workers].submit(_bare_steps, 20_000, pure=False) for _ in range(2)
                ]
                clients[workers].gather(futures)
                return time.perf_counter() - start

            times = interleave_many(
                {
                    "2": lambda: run_on(2),
                    "1": lambda: run_on(1),
                    "bare2": lambda: bare_on(2),
                    "bare1": lambda: bare_on(1),
                },
                repeats,
            )
        for side in ("1", "2"):
            log(f"{side} worker(s): {sorted(times[side])}")
        one, two = statistics.median(times["1"]), statistics.median(times["2"])
        bare = statistics.median(times["bare1"]) / statistics.median(times["bare2"])
        reporter.emit(
            {
                "benchmark": "rollout_stage_2_vs_1_workers",
                "unit": "stage runs/s",
                "offaug": 1.0 / two,
                "baseline": 1.0 / one,
                "baseline_name": "the same stage on a 1-worker LocalCluster",
                "ratio": one / two,
                "goal": 1.7,
                "repeats": repeats,
                "size": {
                    "tasks": rollout.tasks,
                    "episodes": rollout.episodes,
                    "n_envs": rollout.n_envs,
                    "noise": rollout.noise,
                    "env": "Hopper-v5",
                    "from": "quick workflow" if args.quick else "workflows/hopper_cql.yaml",
                },
                "seconds": {"two_workers_median": two, "one_worker_median": one},
                "absolute": {
                    "bare_simulator_2_vs_1": bare,
                    "bare_simulator": (
                        "two 20,000-step Hopper-v5 env.step loops submitted to the same "
                        "clusters, interleaved with the stage runs: the machine's own 2-vs-1"
                    ),
                },
                "notes": (
                    "2-core machine; each worker one process, one torch/BLAS thread; "
                    "both clusters warmed up, then stage runs alternate between them"
                ),
            }
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
