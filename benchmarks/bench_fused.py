"""Many seeds in one process: per-seed gradient steps/s of a fused run of K members.

For each learner that trains fused (BC, TD3+BC, IQL, CQL, BCQ) at 64x64 and 256x256 and K = 1, 2, 5,
10: the per-seed step rate of :class:`offaug.algorithms.fused.trainer.FusedTrainer` (K samplers'
batches stacked, one fused update: ``K x steps / time``) against K sequential single-seed offaug
runs (one trainer's ``sample + update`` rate: K runs one after another give each seed that rate) and
against d3rlpy 2.8 on the same data in the same process. All sides are interleaved blocks on one CPU
thread, median of repeats. Each record carries the matmul floor of the K-member update (the update's
``mm/addmm/bmm/baddbmm`` shapes run back to back, ``_common.plain_matmuls``) as a per-seed rate, and
the fused rate's share of it. On the CPU CQL and BCQ loop their members' losses
(``FusedTrainer.looped``: K plain multiplies beat vmap's batched one at their sizes); BC, TD3+BC and
IQL run theirs once on the stacked parameters (``FusedTrainer.stacked``). Both kinds' K = 5 records
also carry the vmapped rate (``vmapped_steps_per_s_per_seed``).

Goals (ratio to single-seed offaug, per seed) at K = 5: 64x64 BC, TD3+BC, IQL 3x, CQL and BCQ
1.3x (they score thousands of sampled actions a step, so their single runs are closer to the
arithmetic limit already); 256x256 1.1x for all. BCQ trains on batches of 100 (its default, as
in ``bench_algorithms``), the others on 256.

``affine`` (in ``--only``) times the layer every stacked run and critic ensemble is built on,
:func:`offaug.algorithms.nn.kernels.batched_affine`, forward and backward, against
``torch.baddbmm`` (autograd's own backward) at the narrowing layers' shapes of those runs: a
critic head ``64 -> 1`` over the ``K x E = 10`` networks of a K = 5 TD3+BC or IQL run and over a
single run's two critics, a K = 5 BC actor's ``64 -> 3`` head (``nn.Linear`` layout), and the
``256 -> 1`` head at 256x256.

Usage: ``python benchmarks/bench_fused.py [--quick] [--only bc,td3bc,iql,cql,bcq,affine]
[--hidden 64,256]``; JSON lines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Reporter,
    calibrate,
    d3rlpy_update_block,
    interleave_many,
    learner_data,
    log,
    matmul_shapes,
    one_cpu_thread,
    plain_matmuls,
    protect_stdout,
    update_block,
)
from bench_algorithms import d3rlpy_algo, offaug_trainer

GOALS = {64: 3.0, 256: 1.1}
"""Per-seed rate of a fused run over single-seed offaug's, at K = 5."""
SAMPLING_GOALS = {64: 1.3, 256: 1.1}
"""The same for the learners that score sampled actions (:data:`SAMPLING`)."""
SAMPLING = {"cql", "bcq"}
GOAL_MEMBERS = 5


def _fused(
    name: str,
    hidden: int,
    batch: int,
    spaces: Any,
    data: Any,
    members: int,
    looped: bool | None = None,
    stacked: bool | None = None,
) -> Any:
    import torch

    from offaug.algorithms.fused.trainer import FusedTrainer, member_generator
    from offaug.algorithms.runtime import seed_everything
    from offaug.algorithms.training.batches import make_sampler

    trainers, samplers, generators = [], [], []
    for seed in range(members):
        seed_everything(seed)
        trainer = offaug_trainer(name, hidden, batch, spaces)
        samplers.append(make_sampler(trainer, [data], seed=seed))
        trainers.append(trainer)
        generators.append(member_generator(seed, torch.device("cpu")))
    fused = FusedTrainer(trainers, generators, list(range(members)), looped=looped, stacked=stacked)
    return fused, samplers


def _fused_block(fused: Any, samplers: list[Any], steps: int) -> float:
    from offaug.algorithms.batch import TorchBatch
    from offaug.datasets.sampler import sample_stacked

    start = time.perf_counter()
    for _ in range(steps):
        fused.update(TorchBatch.from_batch(sample_stacked(samplers)))
    return time.perf_counter() - start


def _floor(fused: Any, samplers: list[Any]) -> float:
    """Seconds per fused update of its matrix multiplies alone (over a ``policy_freq`` cycle)."""
    from offaug.algorithms.batch import TorchBatch
    from offaug.datasets.sampler import stack_numpy

    config = fused.trainers[0].config
    cycle = int(getattr(config, "policy_freq", getattr(config, "update_actor_interval", 1)))
    batch = TorchBatch.from_batch(stack_numpy([s.sample() for s in samplers]))
    seconds, _ = plain_matmuls(matmul_shapes(fused, batch, cycle), repeats=10)
    return seconds / cycle


def _measure(
    name: str,
    hidden: int,
    data: Any,
    dataset: Any,
    members: list[int],
    steps: int,
    repeats: int,
    reporter: Reporter,
) -> None:
    import torch

    from offaug.algorithms.base import spaces_from_transitions
    from offaug.algorithms.training.batches import make_sampler

    batch = 100 if name == "bcq" else 256
    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    torch.manual_seed(0)
    single = offaug_trainer(name, hidden, batch, spaces)
    single_sampler = make_sampler(single, [data], seed=0)
    algo = d3rlpy_algo(name, hidden, batch, dataset)
    fused = {k: _fused(name, hidden, batch, spaces, data, k) for k in members}
    goals = SAMPLING_GOALS if name in SAMPLING else GOALS

    sides = {
        "single": lambda: update_block(single, single_sampler, steps),
        "d3rlpy": lambda: d3rlpy_update_block(algo, dataset, batch, steps),
        **{f"fused_{k}": (lambda k=k: _fused_block(*fused[k], steps)) for k in members},
    }
    goal_run = fused.get(GOAL_MEMBERS, (None,))[0]
    if goal_run is not None and (goal_run.looped or goal_run.stacked):
        # The CPU loops CQL's and BCQ's member losses (FusedTrainer.looped) and runs BC's,
        # TD3+BC's and IQL's once on stacked parameters; vmap at the goal's K, for comparison.
        vmapped = _fused(
            name, hidden, batch, spaces, data, GOAL_MEMBERS, looped=False, stacked=False
        )
        sides["vmapped"] = lambda: _fused_block(*vmapped, steps)
    for side in sides.values():
        side()  # warm up
    times = interleave_many(sides, repeats)
    single_rate = steps / statistics.median(times["single"])
    d3rlpy_rate = steps / statistics.median(times["d3rlpy"])
    for k in members:
        rate = k * steps / statistics.median(times[f"fused_{k}"])
        floor = k / _floor(*fused[k])
        reporter.emit(
            {
                "benchmark": f"fused_{name}_{hidden}x{hidden}_k{k}",
                "unit": "gradient steps/s per seed",
                "offaug": rate,
                "baseline": single_rate,
                "baseline_name": "single-seed offaug sample + update (K runs one after another)",
                "ratio": rate / single_rate,
                "goal": goals[hidden] if k == GOAL_MEMBERS else None,
                "repeats": repeats,
                "size": {"hidden": [hidden, hidden], "batch_size": batch, "members": k},
                "notes": "one CPU thread; interleaved blocks; median of repeats",
                "absolute": {
                    "looped_member_losses": fused[k][0].looped,
                    "stacked_member_losses": fused[k][0].stacked,
                    **(
                        {
                            "vmapped_steps_per_s_per_seed": k
                            * steps
                            / statistics.median(times["vmapped"])
                        }
                        if "vmapped" in times and k == GOAL_MEMBERS
                        else {}
                    ),
                    "d3rlpy_steps_per_s": d3rlpy_rate,
                    "ratio_to_d3rlpy": rate / d3rlpy_rate,
                    "matmul_floor_steps_per_s_per_seed": floor,
                    "share_of_matmul_floor": rate / floor,
                    "steps_per_block": steps,
                },
            }
        )


AFFINE_SHAPES = {
    # name: (networks, rows, inputs, outputs, nn.Linear layout)
    "critic_head_k5_e2_64": (10, 256, 64, 1, False),
    "critic_head_single_e2_64": (2, 256, 64, 1, False),
    "bc_actor_head_k5_64": (5, 256, 64, 3, True),
    "critic_head_k5_e2_256": (10, 256, 256, 1, False),
}


def _affine_rates(
    networks: int, rows: int, inputs: int, outputs: int, linear_layout: bool, repeats: int
) -> dict[str, float]:
    """Forward + backward passes/s of ``batched_affine`` and of ``baddbmm`` at one shape."""
    import torch

    from offaug.algorithms.nn.kernels import batched_affine

    torch.manual_seed(0)
    x = torch.randn(networks, rows, inputs, requires_grad=True)
    shape = (networks, outputs, inputs) if linear_layout else (networks, inputs, outputs)
    stored = torch.randn(*shape, requires_grad=True)
    bias = torch.randn(networks, 1, outputs, requires_grad=True)
    grad = torch.randn(networks, rows, outputs)

    def passes(layer: Any) -> Any:
        def one() -> None:
            weight = stored.transpose(1, 2) if linear_layout else stored
            torch.autograd.grad(layer(x, weight, bias), (x, stored, bias), grad)

        return one

    sides = {
        "batched_affine": passes(batched_affine),
        "baddbmm": passes(lambda x, w, b: torch.baddbmm(b, x, w)),
    }
    count = calibrate(sides["baddbmm"], 0.2)

    def block(one: Any) -> Any:
        def run() -> float:
            start = time.perf_counter()
            for _ in range(count):
                one()
            return time.perf_counter() - start

        return run

    times = interleave_many({k: block(v) for k, v in sides.items()}, repeats)
    return {k: count / statistics.median(v) for k, v in times.items()}


def _affine_records(repeats: int, reporter: Reporter) -> None:
    for name, (networks, rows, inputs, outputs, linear_layout) in AFFINE_SHAPES.items():
        rate = _affine_rates(networks, rows, inputs, outputs, linear_layout, repeats)
        reporter.emit(
            {
                "benchmark": f"batched_affine_{name}",
                "unit": "forward + backward passes/s",
                "offaug": rate["batched_affine"],
                "baseline": rate["baddbmm"],
                "baseline_name": "torch.baddbmm, autograd's backward",
                "ratio": rate["batched_affine"] / rate["baddbmm"],
                "goal": None,
                "repeats": repeats,
                "size": {
                    "networks": networks,
                    "rows": rows,
                    "inputs": inputs,
                    "outputs": outputs,
                    "weight_layout": "(out, in)" if linear_layout else "(in, out)",
                },
                "notes": "one CPU thread; interleaved blocks; median of repeats",
            }
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few minutes")
    parser.add_argument(
        "--only", default="bc,td3bc,iql,cql,bcq,affine", help="learners (and affine) to measure"
    )
    parser.add_argument("--hidden", default="64,256", help="network widths to measure")
    args = parser.parse_args(argv)
    reporter = Reporter(protect_stdout())
    one_cpu_thread()
    repeats = 3 if args.quick else 5
    members = [1, 2, 5, 10]
    names = args.only.split(",")
    if "affine" in names:
        _affine_records(repeats, reporter)
    learners = [n for n in names if n != "affine"]
    if not learners:
        return 0
    data, dataset = learner_data(args.quick)
    for name in learners:
        for hidden in (int(h) for h in args.hidden.split(",")):
            steps = (5 if hidden == 256 else 20) if args.quick else (40 if hidden == 256 else 150)
            log(f"fused {name} {hidden}x{hidden}: K in {members}, {repeats} x {steps} steps")
            _measure(name, hidden, data, dataset, members, steps, repeats, reporter)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
