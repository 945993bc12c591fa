"""Does augmentation beat the best plain learner? Workflow files through ``offaug run``.

For each dataset made by offaug's own generator (SAC trained online, D4RL's recipe, as in
``bench_learning.py``) and its thin version (its first tenth of episodes, written as a Minari
dataset of its own), the benchmark writes one workflow: ``benchmarks/augmentation.yaml`` (the
learners, recipes and sizes every dataset shares) with the dataset's source, seeds, gradient steps
and learner configs filled in (:data:`DATASETS`). It runs that file with ``offaug run`` — the
product's planner, stages and verdict, nothing wired here — and reads the run's
``metrics.json``: the best augmented arm against the best plain learner at its total gradient
steps or fewer (``comparison``), and every arm's per-seed scores (``training``).

Records: ``augmentation_<dataset>`` (the best augmented arm's IQM minus the best plain
learner's, its 95 % stratified bootstrap interval and P(improvement), the arms, their step
accounting and the simulator steps spent), ``augmentation_default_<dataset>`` (the default recipe
against the same best plain learner), then ``augmentation_datasets_won`` and
``augmentation_thin_datasets_won`` (datasets where the best augmented arm helps: interval above
0 and P(improvement) >= 0.75; goal 3 of 4 each) and ``augmentation_default_never_loses``
(datasets where the default recipe's interval lies below 0; goal 0).

The recipes that need no simulator (``rollout.backend`` ``model``, ``diffusion`` or ``none``
with ``train.state_noise``) are judged on their own as well (issue 34):
``augmentation_simfree_<dataset>`` (the best of them against the same best plain learner) and
``augmentation_simfree_thin_datasets_won`` (goal 2 of the 4 thin versions).

A rerun into the same ``--out`` directory skips every finished stage, so a study can be extended
by more recipes (``--recipes``, or edit the template) without retraining the rest; and by more
seeds (``--seeds``) five at a time: fused learners train in groups of ``train.fuse_group`` seeds,
and a new group leaves the finished ones as they are (a group that grows trains again).

Usage: ``python benchmarks/bench_augmentation.py [--quick] [--datasets a,b] [--seeds 0,1,2]
[--recipes a,b] [--workers 2] [--out DIR]``; JSON lines on stdout. ``--recipes`` runs a subset of
the template's recipes (the plain arms are always trained); ``--quick`` runs
:data:`QUICK_RECIPES` unless it is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DATA_DIR, Reporter, data_fingerprint, load_records, log, protect_stdout

TEMPLATE = Path(__file__).resolve().parent / "augmentation.yaml"
CHEAP_CQL = {"n_action_samples": 4, "batch_size": 128}
MUJOCO_CQL = {
    **CHEAP_CQL,
    "lagrange": False,
    "conservative_weight": 10.0,
    "initial_temperature": 0.1,
    "actor_learning_rate": 3e-4,
}
"""CQL(H) with a fixed penalty weight and a temperature and actor rate that let a run of 10,000
steps move on Hopper-v5 (benchmarks/LOG.md)."""
THIN_SHARE = 0.1
"""The thin version of a dataset keeps this share of its episodes (the first ones)."""
DATASETS_GOAL = 3
"""Datasets (of four, and of their four thin versions) on which augmentation must win."""
SIMULATOR_FREE_GOAL = 2
"""Thin versions (of four) on which the best simulator-free recipe must win (issue 34)."""
HELPS_PROBABILITY = 0.75
"""P(improvement) a win also needs, beside an interval above 0."""
QUICK_RECIPES = ("default", "bc-best8-r3", "bc-look8w5-r3", "bc-modellook8w5-r3")
"""What --quick runs unless --recipes says otherwise: every kind of record (the default
recipe, the quickstart's, the best measured with a simulator and without one) in under five
minutes on two cores; the template's every recipe takes over ten."""


@dataclasses.dataclass(frozen=True)
class BenchDataset:
    """A dataset of the benchmark and what its workflow sets."""

    env_id: str
    level: str
    sac_steps: int
    """SAC steps that make the level (bench_learning's generator)."""
    steps: int
    """Dataset transitions."""
    train_steps: int
    """Gradient steps of every arm's learner (full size; --quick uses its own)."""
    configs: dict[str, dict[str, Any]]
    """Learner config overrides on it (every arm alike), on top of the template's."""


DATASETS: dict[str, BenchDataset] = {
    "pendulum-medium": BenchDataset("Pendulum-v1", "medium", 8000, 10_000, 3000, {}),
    "hopper-medium": BenchDataset(
        "Hopper-v5", "medium", 100_000, 50_000, 10_000, {"cql": MUJOCO_CQL}
    ),
    "hopper-expert-narrow": BenchDataset(
        "Hopper-v5",
        "expert",
        300_000,
        10_000,
        30_000,
        {"cql": {**MUJOCO_CQL, "normalise_observations": True}},
    ),
    "halfcheetah-medium": BenchDataset(
        "HalfCheetah-v5", "medium", 100_000, 50_000, 10_000, {"cql": MUJOCO_CQL}
    ),
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each run is."""

    train_steps: int | None
    """Gradient steps per learner; None: each dataset's own budget."""
    bc_steps: int
    eval_episodes: int
    rollout_episodes: int
    model_steps: int | None = None
    """Training steps of the dynamics ensemble and of the denoiser; None: the schema's."""
    generated_samples: int | None = None
    """The denoiser's samples; None: the schema's."""
    recipe_starts: int | None = None
    """At most this many starts (episodes / tries) in a recipe that sets its own episodes."""


FULL = Sizes(train_steps=None, bc_steps=5000, eval_episodes=10, rollout_episodes=50)
QUICK = Sizes(
    train_steps=500,
    bc_steps=1000,
    eval_episodes=3,
    rollout_episodes=8,
    model_steps=300,
    generated_samples=4096,
    recipe_starts=4,
)


def simulator_free(document: dict[str, Any]) -> list[str]:
    """The workflow's recipes that need no simulator: model rollouts, generated samples, or
    state noise alone (``backend: none`` with ``train.state_noise``)."""
    from offaug.pipeline.schema.recipes import merged

    names = []
    for name, overrides in (document.get("recipes") or {}).items():
        recipe = merged(
            {"rollout": document.get("rollout", {}), "train": document.get("train", {})},
            overrides or {},
        )
        backend = recipe["rollout"].get("backend", "simulator")
        if backend in ("model", "diffusion") or (
            backend == "none" and recipe["train"].get("state_noise")
        ):
            names.append(name)
    return names


def _dataset_path(name: str, thin: bool) -> tuple[Path, str]:
    """The dataset's Minari directory (made and cached on first use) and its fingerprint; the
    thin version is the first :data:`THIN_SHARE` of its episodes, published as its own dataset."""
    from bench_learning import _dataset

    from offaug.datasets.paths import resolve_dataset_dir
    from offaug.datasets.publish import publish_dataset
    from offaug.pipeline.rollouts.env_state import load_with_states

    spec = DATASETS[name]
    data = _dataset(spec.env_id, spec.level, train_steps=spec.sac_steps, steps=spec.steps)
    root = DATA_DIR / "learning"
    dataset_id = f"bench/{spec.env_id.lower()}-{spec.level}-t{spec.sac_steps}-s{spec.steps}-v0"
    path = resolve_dataset_dir(dataset_id, root)
    if not thin:
        return path, data_fingerprint(data)
    thin_id = dataset_id.replace("-v0", f"-thin{round(THIN_SHARE * 100)}pc-v0")
    thin_path = resolve_dataset_dir(thin_id, root)
    # With the simulator states it records, so the thin version branches as the full one does.
    full, _ = load_with_states(str(path))
    episodes = max(2, round(full.num_episodes * THIN_SHARE))
    subset = full.slice(0, int(full.episode_bounds()[episodes]))
    if not (thin_path / "data" / "metadata.json").is_file():
        log(f"making {thin_id}: the first {episodes} of {full.num_episodes} episodes")
        publish_dataset([subset], thin_id, root=root, overwrite=True)
    return thin_path, data_fingerprint(subset)


def workflow_document(
    name: str,
    source: Path,
    seeds: list[int],
    sizes: Sizes,
    workers: int,
    recipes: list[str] | None = None,
) -> dict[str, Any]:
    """The template with one dataset's source, seeds, sizes and learner configs filled in
    (``recipes``: only these of the template's; None: all)."""
    document: dict[str, Any] = yaml.safe_load(TEMPLATE.read_text())
    spec = DATASETS[name.removesuffix("-thin")]
    document["name"] = f"augmentation-{name}"
    document["source"] = {"dataset": str(source)}
    document["seeds"] = seeds
    document["seed"] = seeds[0]
    document["bc"]["steps"] = sizes.bc_steps
    document["rollout"]["episodes"] = sizes.rollout_episodes
    # A recipe's own train.steps is a multiple of the template's: scaled with the dataset's
    # budget (and --quick's), so a recipe that trains three rounds' worth stays three.
    steps, template_steps = sizes.train_steps or spec.train_steps, document["train"]["steps"]
    document["train"]["steps"] = steps
    for overrides in document["recipes"].values():
        train = (overrides or {}).get("train", {})
        if "steps" in train:
            train["steps"] = round(train["steps"] * steps / template_steps)
    for learner, overrides in spec.configs.items():
        document["train"]["configs"].setdefault(learner, {}).update(overrides)
    document["evaluation"]["episodes"] = sizes.eval_episodes
    if sizes.model_steps is not None:
        document["rollout"]["dynamics"] = {"steps": sizes.model_steps}
        document["rollout"]["diffusion"] = {"steps": sizes.model_steps}
    if sizes.generated_samples is not None:
        document["rollout"].setdefault("diffusion", {})["samples"] = sizes.generated_samples
    for overrides in document["recipes"].values():
        rollout = (overrides or {}).get("rollout", {})
        if sizes.recipe_starts is not None and "episodes" in rollout:
            tries = rollout.get("tries", 1)
            rollout["episodes"] = min(rollout["episodes"], sizes.recipe_starts * tries)
    if recipes is not None:
        unknown = sorted(set(recipes) - set(document["recipes"]))
        if unknown:
            raise ValueError(
                f"{TEMPLATE}: no recipe {', '.join(unknown)} (it has"
                f" {', '.join(document['recipes'])})"
            )
        document["recipes"] = {k: v for k, v in document["recipes"].items() if k in recipes}
    document["cluster"] = {"kind": "local", "workers": workers}
    return document


def run_workflow_file(document: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write ``document`` as ``out/../NAME.yaml``, run it with ``offaug run``, return its
    ``metrics.json``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    command = [sys.executable, "-m", "offaug", "run", str(path), "--out", str(out)]
    log(" ".join(command))
    completed = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"offaug run {path} failed with exit code {completed.returncode}")
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    return metrics


def _per_seed(metrics: dict[str, Any], learner: str, recipe: str) -> list[float | None]:
    """An arm's final normalised scores, in the run's seed order."""
    runs = {
        entry["seed"]: entry.get("normalised_score")
        for entry in metrics["training"].values()
        if entry["learner"] == learner and entry["recipe"] == recipe
    }
    return [runs.get(seed) for seed in metrics["seeds"]]


def dataset_records(
    name: str,
    metrics: dict[str, Any],
    size: dict[str, Any],
    default_recipe: str = "default",
    simulator_free_recipes: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """The records of one dataset's run, read from its ``metrics.json``: its ``comparison``
    (the best augmented arm against the best plain learner at its total gradient steps or
    fewer), and the default recipe and the simulator-free ones judged the same way
    (:func:`~offaug.pipeline.outcome.verdict.judge_best` over those recipes' runs and the plain
    ones)."""
    from offaug.pipeline.contracts import is_plain
    from offaug.pipeline.outcome.summary import run_scores
    from offaug.pipeline.outcome.verdict import judge_best

    arms: dict[str, list[float | None]] = {}
    for entry in metrics["training"].values():
        arm = f"{entry['learner']}-{entry['recipe']}"
        arms.setdefault(arm, _per_seed(metrics, entry["learner"], entry["recipe"]))
    records = [_record(f"augmentation_{name}", metrics["comparison"], metrics, size, arms)]
    runs, _ = run_scores(metrics["training"])
    for prefix, recipes in (
        ("augmentation_default", (default_recipe,)),
        ("augmentation_simfree", simulator_free_recipes),
    ):
        subset = [r for r in runs if r.recipe in recipes or is_plain(r.recipe)]
        if any(r.recipe in recipes for r in subset):
            judged = dict(judge_best(subset))
            records.append(_record(f"{prefix}_{name}", judged, metrics, size, arms))
    return records


def _record(
    benchmark: str,
    judged: dict[str, Any],
    metrics: dict[str, Any],
    size: dict[str, Any],
    arms: dict[str, list[float | None]],
) -> dict[str, Any]:
    """A best-against-best comparison (metrics.json's ``comparison`` layout) as a record."""
    augmented, plain = judged["augmented"], judged["plain"]
    if augmented is None or plain is None:
        raise RuntimeError(f"{benchmark}: no comparison: {judged['sentence']}")
    interval = judged["interval"]
    helps = interval[0] > 0 and judged["probability_of_improvement"] >= HELPS_PROBABILITY
    return {
        "benchmark": benchmark,
        "unit": "normalised score (points)",
        "offaug": augmented["iqm"],
        "baseline": plain["iqm"],
        "baseline_name": (
            f"the best plain learner ({plain['learner']}, {plain['steps']} gradient steps),"
            " same seeds"
        ),
        "ratio": judged["difference"],
        "interval": interval,
        "probability_of_improvement": judged["probability_of_improvement"],
        "goal": 0.0,
        "goal_met": helps,
        "outcome": judged["outcome"],
        "loses": interval[1] < 0,
        "repeats": len(judged["seeds"]),
        "seeds": judged["seeds"],
        "size": size,
        "absolute": {
            "augmented": augmented,
            "plain": plain,
            "sentence": judged["sentence"],
            "arms": arms,
        },
        "notes": (
            "ratio = IQM(best augmented arm) - IQM(best plain learner at its total gradient"
            " steps or fewer) in normalised points, interval = 95% stratified bootstrap CI of that"
            " difference, P(improvement) over seeds; read from the run's metrics.json"
            " (offaug run); goal met when the interval is above 0 and P >= 0.75. Final"
            " policies, the same evaluation start seeds for every arm."
        ),
    }


def _summary(
    benchmark: str,
    won: list[str],
    group: list[dict[str, Any]],
    goal: int,
    note: str,
    joined: dict[str, str],
) -> dict[str, Any]:
    measured = [r["size"]["dataset"] for r in group]
    # The seeds every dataset counted was measured with.
    seeds = sorted(set.intersection(*(set(r["seeds"]) for r in group)))
    from_earlier = {name: joined[name] for name in measured if name in joined}
    if from_earlier:
        note += "; from earlier records: " + ", ".join(
            f"{name} ({when})" for name, when in from_earlier.items()
        )
    return {
        "benchmark": benchmark,
        "unit": "datasets",
        "offaug": len(won),
        "baseline": len(measured),
        "baseline_name": "datasets measured",
        "ratio": len(won),
        "goal": goal,
        "goal_met": len(won) >= goal if goal else not won,
        "repeats": len(seeds),
        "seeds": seeds,
        "size": {"datasets": measured, "counted": won, "earlier": from_earlier},
        "notes": note,
    }


def earlier_records(path: Path, measured: set[str]) -> list[dict[str, Any]]:
    """The per-dataset records in ``path`` (JSON lines or ``results.json``) of datasets that
    ``measured`` does not hold, for :func:`summary_records` to count beside this run's: a study
    spread over several runs (each with its own ``--datasets``) is summarised as one."""
    kept = []
    for record in load_records(path):
        size = record.get("size")
        name = size.get("dataset") if isinstance(size, dict) else None
        if (
            str(record.get("benchmark", "")).startswith("augmentation_")
            and isinstance(name, str)
            and name not in measured
        ):
            kept.append(record)
    return kept


def summary_records(
    records: list[dict[str, Any]], joined: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Datasets won (full and thin) and datasets where the default recipe loses; ``joined``:
    the datasets whose records came from an earlier run (:func:`earlier_records`), and when."""
    joined = joined or {}

    def kind(record: dict[str, Any]) -> str:
        for prefix in ("augmentation_default_", "augmentation_simfree_"):
            if record["benchmark"].startswith(prefix):
                return prefix
        return "best"

    def thin(record: dict[str, Any]) -> bool:
        return bool(record["size"]["dataset"].endswith("-thin"))

    best = [r for r in records if kind(r) == "best"]
    defaults = [r for r in records if kind(r) == "augmentation_default_"]
    simfree = [r for r in records if kind(r) == "augmentation_simfree_" and thin(r)]
    out = []
    for benchmark, group, goal, what in (
        ("augmentation_datasets_won", [r for r in best if not thin(r)], DATASETS_GOAL, "best"),
        ("augmentation_thin_datasets_won", [r for r in best if thin(r)], DATASETS_GOAL, "best"),
        (
            "augmentation_simfree_thin_datasets_won",
            simfree,
            SIMULATOR_FREE_GOAL,
            "best simulator-free",
        ),
    ):
        if group:
            out.append(
                _summary(
                    benchmark,
                    [r["size"]["dataset"] for r in group if r["goal_met"]],
                    group,
                    goal,
                    f"datasets where the {what} augmented arm beats the best plain learner at"
                    " its total gradient steps or fewer (interval > 0, P >= 0.75)",
                    joined,
                )
            )
    if defaults:
        out.append(
            _summary(
                "augmentation_default_never_loses",
                [r["size"]["dataset"] for r in defaults if r["loses"]],
                defaults,
                0,
                "datasets where the default recipe loses to the best plain learner (the"
                " interval of the difference lies below 0); goal: none",
                joined,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Pendulum only, 3 seeds, small runs")
    parser.add_argument(
        "--datasets",
        default="",
        help="comma-separated datasets; NAME-thin for a thin version (default: all and their"
        " thin versions; --quick: pendulum-medium)",
    )
    parser.add_argument("--seeds", default="", help="comma-separated training seeds")
    parser.add_argument(
        "--recipes",
        default="",
        help="comma-separated recipes of the template (default: all; --quick: four)",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--out",
        type=Path,
        help="where the runs go (default: a new folder under the benchmark data directory);"
        " a rerun into the same folder skips every finished stage",
    )
    parser.add_argument(
        "--with-records",
        type=Path,
        help="an earlier run's output or results.json: its records of datasets this run does"
        " not measure count in the datasets-won summaries (a study run dataset by dataset)",
    )
    args = parser.parse_args(argv)
    out = protect_stdout()
    reporter = Reporter(out)
    os.environ.setdefault("D4RL_SUPPRESS_IMPORT_ERROR", "1")
    sizes = QUICK if args.quick else FULL

    def pick(text: str, default: list[str]) -> list[str]:
        return [t.strip() for t in text.split(",") if t.strip()] or default

    everything = [n for d in DATASETS for n in (d, f"{d}-thin")]
    datasets = pick(args.datasets, ["pendulum-medium"] if args.quick else everything)
    unknown = [d for d in datasets if d.removesuffix("-thin") not in DATASETS]
    if unknown:
        parser.error(f"unknown dataset: {', '.join(unknown)} (known: {', '.join(DATASETS)})")
    seeds = [
        int(s)
        for s in pick(args.seeds, ["0", "1", "2"] if args.quick else ["0", "1", "2", "3", "4"])
    ]
    root = args.out or (
        DATA_DIR
        / "augmentation"
        / ("quick" if args.quick else "full")
        / time.strftime("%Y%m%d-%H%M%S")
    )
    records: list[dict[str, Any]] = []
    for name in datasets:
        started = time.perf_counter()
        source, fingerprint = _dataset_path(name.removesuffix("-thin"), name.endswith("-thin"))
        document = workflow_document(
            name,
            source,
            seeds,
            sizes,
            args.workers,
            pick(args.recipes, list(QUICK_RECIPES) if args.quick else []) or None,
        )
        metrics = run_workflow_file(document, root / name)
        size = {
            "dataset": name,
            "data_fingerprint": fingerprint,
            "transitions": metrics["source"].get("rows"),
            "gradient_steps": document["train"]["steps"],
            "learners": document["train"]["algorithms"],
            "recipes": sorted(document.get("recipes", {})),
            "workflow": str(root / f"{name}.yaml"),
        }
        simfree = tuple(simulator_free(document))
        for record in dataset_records(name, metrics, size, simulator_free_recipes=simfree):
            record["absolute"]["seconds"] = time.perf_counter() - started
            reporter.emit(record)
            records.append(record)
    joined: dict[str, str] = {}
    if args.with_records is not None:
        earlier = earlier_records(args.with_records, {r["size"]["dataset"] for r in records})
        joined = {r["size"]["dataset"]: str(r.get("measured", args.with_records)) for r in earlier}
        records += earlier
    for record in summary_records(records, joined):
        reporter.emit(record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
