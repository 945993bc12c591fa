"""Does augmentation make the learned policy better? Recipes against plain, over seeds.

For each dataset made by offaug's own generator (SAC trained online, D4RL's recipe, as in
``bench_learning.py``) and each learner, every recipe's final policies are compared with the same
learner trained on the original data alone ("plain"), at equal gradient steps, from the same
evaluation start seeds, over several training seeds: rliable's IQM, the 95 % stratified bootstrap
interval of the IQM difference and the probability of improvement
(:func:`offaug.pipeline.outcome.statistics.compare`). Every unit of work is one of the pipeline's
own stage functions (``prepare_source``, ``train_bc``, ``rollout_shard`` / ``model_rollout_task`` +
``merge_rollouts``, ``train_offline``) on a LocalCluster of single-threaded workers, so the
benchmark measures exactly what ``offaug run`` does.

Records: ``augmentation_<dataset>_<learner>`` (best recipe's IQM minus plain's, with its interval
and probability of improvement; every recipe's per-seed scores in ``absolute``), then
``augmentation_cql_datasets_won`` (datasets where a recipe beats plain for CQL with an interval
above 0 and P(improvement) >= 0.75; goal 3 of 4) and ``augmentation_default_never_loses``
(datasets and learners where the default recipe loses to plain by more than its interval,
i.e. the interval lies below 0; goal 0).

Usage: ``python benchmarks/bench_augmentation.py [--quick] [--datasets a,b] [--learners a,b]
[--recipes a,b] [--seeds 0,1,2,3,4] [--workers 2]``; JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DATA_DIR, Reporter, data_fingerprint, load_records, log, protect_stdout

from offaug.pipeline.contracts import AugmentedRef, DatasetRef, ModelRef
from offaug.pipeline.outcome.statistics import compare
from offaug.pipeline.schema.run_sections import EvaluationModel
from offaug.pipeline.schema.sections import BCConfigModel, RolloutModel, SourceConfig, TrainModel

HIDDEN = (64, 64)
CHEAP_CQL = {"n_action_samples": 4, "batch_size": 128}
"""CQL's conservative term scores 4 sampled actions per state on batches of 128 (d3rlpy's
defaults otherwise), as the quickstart does: every arm alike, affordable over many seeds."""
MUJOCO_CQL = {
    **CHEAP_CQL,
    "lagrange": False,
    "conservative_weight": 10.0,
    "initial_temperature": 0.1,
    "actor_learning_rate": 3e-4,
}
"""CQL(H) with a fixed penalty weight, and an entropy temperature and actor rate that let a run
of 10,000 steps move: at d3rlpy's defaults (Lagrange gap 10, temperature 1, actor rate 1e-4) CQL
on Hopper-v5 medium stays at the score of a policy that falls at once for 8,000 steps, and at the
paper's weight 5 it often falls back there by the last step (benchmarks/LOG.md)."""

MUJOCO_CQL_NORMALISED = {**MUJOCO_CQL, "normalise_observations": True}
"""The same with observations standardised by the data's mean and std (d3rlpy's
``observation_scaler="standard"``): on the expert-narrow set, whose 11 episodes cover little,
raw-observation CQL ends far below the data (benchmarks/LOG.md)."""


@dataclasses.dataclass(frozen=True)
class BenchDataset:
    """A dataset of the benchmark and the training budget its learners get."""

    env_id: str
    level: str
    sac_steps: int
    """SAC steps that make the level (bench_learning's generator)."""
    steps: int
    """Dataset transitions."""
    train_steps: int
    """Gradient steps of every learner on it (full size; --quick uses its own)."""
    configs: dict[str, dict[str, Any]]
    """Learner config overrides on it (the same for every arm)."""


DATASETS: dict[str, BenchDataset] = {
    "pendulum-medium": BenchDataset(
        "Pendulum-v1", "medium", 8000, 10_000, 3000, {"cql": CHEAP_CQL}
    ),
    "hopper-medium": BenchDataset(
        "Hopper-v5", "medium", 100_000, 50_000, 10_000, {"cql": MUJOCO_CQL}
    ),
    # 300,000 SAC steps: after 100,000 the current SAC's "expert" returned 638 (its data 675, a
    # third of Hopper's medium level in D4RL); after 300,000 it returns 990 (its data 1,197).
    # 30,000 gradient steps: at 10,000 plain CQL's Q on the data was still climbing steadily,
    # far below the data's returns, and its policies far below the data (benchmarks/LOG.md).
    "hopper-expert-narrow": BenchDataset(
        "Hopper-v5", "expert", 300_000, 10_000, 30_000, {"cql": MUJOCO_CQL_NORMALISED}
    ),
    "halfcheetah-medium": BenchDataset(
        "HalfCheetah-v5", "medium", 100_000, 50_000, 10_000, {"cql": MUJOCO_CQL}
    ),
}

COMBO: dict[str, Any] = {"configs": {"cql": {"conservative_rows": "original"}}}
"""Train overrides of the COMBO recipes: CQL pushes up the original data's actions only."""
# Recipe name -> (rollout overrides, train overrides). "plain" trains on the original data only.
RECIPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "reset-0.1": ({"start": "reset", "noise": "gaussian:0.1", "filter": "data"}, {}),
    "reset-0.3": ({"start": "reset", "noise": "gaussian:0.3", "filter": "data"}, {}),
    "reset-0.1-unfiltered": ({"start": "reset", "noise": "gaussian:0.1"}, {}),
    # The noise centred on TD3+BC's plain run of the same seed instead of the BC clone: a rollout
    # policy that can earn more than the data where the clone earns less.
    "td3bc-reset-0.1": (
        {"start": "reset", "noise": "gaussian:0.1", "filter": "data", "policy": "td3bc"},
        {},
    ),
    # The noise centred on IQL's or ReBRAC's plain run: on Pendulum-v1 medium both score about
    # twice what TD3+BC and CQL do (bench_learning, same generator settings).
    "iql-reset-0.1": (
        {"start": "reset", "noise": "gaussian:0.1", "filter": "data", "policy": "iql"},
        {},
    ),
    "rebrac-reset-0.1": (
        {"start": "reset", "noise": "gaussian:0.1", "filter": "data", "policy": "rebrac"},
        {},
    ),
    # The same with three times the rollout budget: on the expert set the filter kept 779-4,439
    # of TD3+BC's 10,000 rollout rows (a twelfth to under half the data's 10,034), so the
    # augmented half of every batch repeats few episodes (benchmarks/LOG.md).
    "td3bc-reset-0.1-30k": (
        {
            "start": "reset",
            "noise": "gaussian:0.1",
            "filter": "data",
            "policy": "td3bc",
            "rollout_transitions": 30_000,
        },
        {},
    ),
    # TD3+BC's rollouts under a third of the noise: at 30,000 steps its plain runs beat the
    # expert-narrow data (31-63 against 37.4) but under noise 0.1 fell before earning the
    # data's return, so the filter kept 0-2 of 84 episodes (benchmarks/LOG.md).
    "td3bc-reset-0.03-30k": (
        {
            "start": "reset",
            "noise": "gaussian:0.03",
            "filter": "data",
            "policy": "td3bc",
            "rollout_transitions": 30_000,
        },
        {},
    ),
    # Smaller still, with the augmented share capped at the kept rows' share of all rows: with
    # no noise TD3+BC's reset episodes on seed 2 returned 1,390-2,007 (all above the data's
    # 1,197), under 0.03 they fell at 990 (1 of 84 kept, and that one episode in half of every
    # batch took CQL from 32.3 to 11.5), under 0.01 10 of 16 passed and under 0.003 all 16
    # (one-off probe of 16 episodes, benchmarks/LOG.md).
    **{
        f"td3bc-reset-{sigma}-30k-rows": (
            {
                "start": "reset",
                "noise": f"gaussian:{sigma}",
                "filter": "data",
                "policy": "td3bc",
                "rollout_transitions": 30_000,
            },
            {"mixing_follows_rows": True},
        )
        for sigma in ("0.01", "0.003")
    },
    # The noise chosen per seed by probe episodes through the filter (rollout.noise_calibration)
    # instead of fixed: each seed's TD3+BC gets the largest noise of which it keeps half.
    "td3bc-reset-calibrated-30k-rows": (
        {
            "start": "reset",
            "filter": "data",
            "policy": "td3bc",
            "noise_calibration": {"scales": [0.1, 0.03, 0.01, 0.003], "episodes": 16},
            "rollout_transitions": 30_000,
        },
        {"mixing_follows_rows": True},
    ),
    # Both with the filter forgiving a fifth of the data's return: on seeds 3, 4 and 7 TD3+BC's
    # plain run earns 1,000-1,060 against the data's 1,197, so the strict filter kept none of
    # its episodes under 0.01, while the same episodes unfiltered took CQL from 12.9 to 31.8,
    # 35.1 to 46.1 and 11.1 to 30.1 (benchmarks/LOG.md).
    **{
        f"td3bc-reset-{name}-30k-rows-tol0.2": (
            {
                "start": "reset",
                "filter": "data",
                "filter_tolerance": 0.2,
                "policy": "td3bc",
                "rollout_transitions": 30_000,
                **noise,
            },
            {"mixing_follows_rows": True},
        )
        for name, noise in (
            ("0.01", {"noise": "gaussian:0.01"}),
            (
                "calibrated",
                {"noise_calibration": {"scales": [0.1, 0.03, 0.01, 0.003], "episodes": 16}},
            ),
        )
    },
    # The same rollouts unfiltered: on the seeds where TD3+BC's plain run scores below the
    # data (31-34 against 37.4) the filter kept nothing, yet those runs score two to three
    # times what plain CQL does on the same seeds (11-13), so their episodes are better than
    # what CQL learns from the data alone (benchmarks/LOG.md).
    "td3bc-reset-0.01-30k-unfiltered": (
        {
            "start": "reset",
            "noise": "gaussian:0.01",
            "policy": "td3bc",
            "rollout_transitions": 30_000,
        },
        {},
    ),
    # TD3+BC's rollouts with the policy trained three times the dataset's budget on the data
    # alone: on HalfCheetah-v5 medium TD3+BC earns 888-890 after 30,000 steps against the data's
    # 601, but 278-658 after the benchmark's 10,000 (probes on seeds 100-101,
    # benchmarks/LOG.md). Every learner trained on the rollouts keeps the dataset's budget.
    "td3bc30k-reset-calibrated-30k-rows": (
        {
            "start": "reset",
            "filter": "data",
            "policy": "td3bc",
            "policy_steps": 30_000,
            "noise_calibration": {"scales": [0.1, 0.03, 0.01, 0.003], "episodes": 16},
            "rollout_transitions": 30_000,
        },
        {"mixing_follows_rows": True},
    ),
    # Two rounds: TD3+BC retrained on the data and its own kept rollouts, then rolled out.
    "td3bc-reset-0.1-r2": (
        {
            "start": "reset",
            "noise": "gaussian:0.1",
            "filter": "data",
            "policy": "td3bc",
            "rounds": 2,
        },
        {},
    ),
    # COMBO's penalty (CQL's ``conservative_rows: original``): the rollouts train the critics by
    # TD while only the data's actions are pushed up, so they go unfiltered; other learners
    # train on the same rollouts as they are.
    "combo-reset-0.1": ({"start": "reset", "noise": "gaussian:0.1"}, COMBO),
    "combo-branch-h50": ({"start": "dataset", "horizon": 50, "noise": "gaussian:0.1"}, COMBO),
    "branch-h50": (
        {"start": "dataset", "horizon": 50, "noise": "gaussian:0.1", "filter": "data"},
        {},
    ),
    "model-h5": ({"backend": "model", "horizon": 5, "noise": "gaussian:0.1"}, {}),
    "state-noise": (
        {"backend": "none"},
        {"state_noise": {"kind": "gaussian", "scale": 0.003}},
    ),
}
CQL_DATASETS_GOAL = 3
"""Datasets (of the four) on which a recipe must beat plain for CQL."""
DEFAULT_RECIPE = "reset-0.1"
"""The recipe ``workflows/quickstart.yaml`` and the rollout defaults use."""
PLAIN = "plain"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each unit of work is."""

    train_steps: int | None
    """Gradient steps per learner; None: each dataset's own budget."""
    bc_steps: int
    eval_episodes: int
    rollout_transitions: int
    dynamics_steps: int


FULL = Sizes(
    train_steps=None,
    bc_steps=20_000,
    eval_episodes=10,
    rollout_transitions=10_000,
    dynamics_steps=3000,
)
QUICK = Sizes(
    train_steps=1000, bc_steps=5000, eval_episodes=10, rollout_transitions=4000, dynamics_steps=500
)


def _source(name: str) -> tuple[DatasetRef, str]:
    """The dataset, made (and cached) on first use, and its :func:`data_fingerprint`."""
    from bench_learning import _dataset

    from offaug.datasets.paths import resolve_dataset_dir
    from offaug.pipeline.stages.learning import prepare_source

    spec = DATASETS[name]
    transitions = _dataset(spec.env_id, spec.level, train_steps=spec.sac_steps, steps=spec.steps)
    dataset_id = f"bench/{spec.env_id.lower()}-{spec.level}-t{spec.sac_steps}-s{spec.steps}-v0"
    path = resolve_dataset_dir(dataset_id, DATA_DIR / "learning")
    return prepare_source(SourceConfig(dataset=str(path))), data_fingerprint(transitions)


def _rollout_model(overrides: dict[str, Any], data: DatasetRef, sizes: Sizes) -> RolloutModel:
    # A recipe's own rollout budget (benchmark-only: the workflow sets episodes directly).
    overrides = dict(overrides)
    transitions = int(overrides.pop("rollout_transitions", sizes.rollout_transitions))
    overrides.pop("policy_steps", None)  # the rollout policy's training budget, not a knob here
    horizon = overrides.get("horizon")
    mean_length = max(1, data.rows // max(1, data.episodes))
    episodes = max(2, transitions // (horizon or mean_length))
    dynamics = {"members": 5, "hidden": (200, 200), "steps": sizes.dynamics_steps}
    return RolloutModel.model_validate(
        {"episodes": episodes, "tasks": 1, "n_envs": 8, "dynamics": dynamics, **overrides}
    )


def _train_steps(name: str, sizes: Sizes) -> int:
    return sizes.train_steps or DATASETS[name].train_steps


def _train_model(
    algorithm: str, overrides: dict[str, Any], dataset: str, sizes: Sizes
) -> TrainModel:
    from offaug.algorithms import registry

    config: dict[str, Any] = {
        f.name: HIDDEN
        for f in dataclasses.fields(registry.config_type(algorithm))
        if f.name == "hidden" or f.name.endswith("_hidden")
    }
    config.update(DATASETS[dataset].configs.get(algorithm, {}))
    # A recipe's learner configs add to the dataset's; those of other learners do not apply.
    config.update(overrides.get("configs", {}).get(algorithm, {}))
    rest = {k: v for k, v in overrides.items() if k != "configs"}
    return TrainModel.model_validate(
        {
            "algorithms": [algorithm],
            "steps": _train_steps(dataset, sizes),
            "mixing": [0.5, 0.5],
            "weighting": "none",
            "configs": {algorithm: config},
            **rest,
        }
    )


def _submit_rollout(
    client: Any,
    data: DatasetRef,
    bc: Any,
    policy: Any,
    rollout: RolloutModel,
    out: Path,
    seed: int,
) -> Any:
    from offaug.pipeline.stages import rollouts as rollout_stages

    shard = str(out / "shard-00000.arrow")
    if rollout.backend == "model":
        dynamics = client.submit(
            rollout_stages.train_dynamics_stage,
            data,
            rollout,
            str(out.parent / f"{out.name}.dyn.pt"),
            seed,
        )
        part = client.submit(
            rollout_stages.model_rollout_task,
            data,
            bc,
            dynamics,
            rollout,
            shard,
            0,
            seed,
            pure=False,
        )
        return client.submit(rollout_stages.merge_rollouts, [part], str(out), rollout, pure=False)
    calibration = None
    if rollout.noise_calibration is not None:
        calibration = client.submit(
            rollout_stages.calibrate_noise_stage,
            data,
            bc,
            rollout,
            str(out),
            seed,
            policy,
            pure=False,
        )
    part = client.submit(
        rollout_stages.rollout_shard,
        data,
        bc,
        rollout,
        str(out),
        seed,
        0,
        policy,
        calibration,
        pure=False,
    )
    return client.submit(
        rollout_stages.merge_rollouts, [part], str(out), rollout, calibration, pure=False
    )


def _plain_if_empty(
    plain: ModelRef, augmented: AugmentedRef, learner: str, data: DatasetRef, *train_args: Any
) -> ModelRef:
    """Plain's run when the rollouts kept no row (training on the data alone again under the
    same config and seed would repeat it exactly), else the arm's own run."""
    from offaug.pipeline.stages import learning as stages

    if augmented.rows == 0:
        return plain
    return stages.train_offline(learner, data, augmented, *train_args)


def _changes_training(recipe: str) -> bool:
    """Whether a recipe's train overrides change a run on the data alone (learner configs or
    state noise do; mixing and weighting act only on augmented rows)."""
    train = RECIPES[recipe][1]
    return bool(train.get("configs")) or train.get("state_noise") is not None


def _score(model: ModelRef) -> float:
    evaluation = model.metrics.get("eval") or {}
    score = evaluation.get("normalised_score")
    if score is None:
        raise RuntimeError(
            f"{model.path}: no normalised score (the dataset has no reference scores)"
        )
    return float(score)


def _run_dataset(
    client: Any,
    name: str,
    learners: list[str],
    recipes: list[str],
    seeds: list[int],
    sizes: Sizes,
    root: Path,
) -> dict[str, Any]:
    """Every (recipe, learner, seed) of one dataset; scores and per-recipe diagnostics."""
    from offaug.pipeline.stages import learning as stages

    data, fingerprint = _source(name)
    evaluation = EvaluationModel(episodes=sizes.eval_episodes)
    bc_config = BCConfigModel(steps=sizes.bc_steps, hidden=HIDDEN)
    bcs = {
        seed: client.submit(
            stages.train_bc, data, bc_config, str(root / name / f"bc-s{seed}"), seed, pure=False
        )
        for seed in seeds
    }
    trained: dict[tuple[str, str, int], Any] = {}

    def submit_train(
        learner: str,
        recipe: str,
        seed: int,
        augmented: Any,
        label: str | None = None,
        steps: int | None = None,
    ) -> Any:
        # ``label`` names a rollout round's retrained policy, or a rollout policy trained for
        # ``steps`` instead of the dataset's budget, apart from the recipe's own runs.
        key = (learner, label or recipe, seed)
        if key in trained:
            return trained[key]
        overrides = {} if recipe == PLAIN else dict(RECIPES[recipe][1])
        if steps is not None:
            overrides["steps"] = steps
        args = (
            _train_model(learner, overrides, name, sizes),
            evaluation,
            str(root / name / f"{learner}-{label or recipe}-s{seed}"),
            seed,
            1,
        )
        if recipe == PLAIN or augmented is None or _changes_training(recipe):
            trained[key] = client.submit(
                stages.train_offline,
                learner,
                data,
                augmented,
                *args,
                plain=recipe == PLAIN,
                pure=False,
            )
        else:
            # Waits for plain's run of the seed, then repeats it only if rows were kept.
            plain = submit_train(learner, PLAIN, seed, None)
            trained[key] = client.submit(
                _plain_if_empty, plain, augmented, learner, data, *args, pure=False
            )
        return trained[key]

    rollouts: dict[tuple[str, int], Any] = {}
    policies: dict[tuple[str, int], tuple[str, str]] = {}
    """(recipe, seed) -> the (learner, label) of the policy its last round rolled out, where that
    is not the learner's plain run (a later round's retrained policy, or one trained for the
    recipe's own ``policy_steps``)."""
    for recipe in recipes:
        overrides, _ = RECIPES[recipe]
        rollout = _rollout_model(overrides, data, sizes)
        if rollout.backend == "none":
            continue
        single = rollout.model_copy(update={"rounds": 1})
        for seed in seeds:
            # A learner named as the rollout policy rolls out its plain run of this seed in
            # round 1, then (rollout.rounds) its run on the data and the previous round's.
            policy = None
            if rollout.policy != "bc":
                steps = overrides.get("policy_steps")
                label = None if steps is None else f"{PLAIN}-{steps}-steps"
                policy = submit_train(rollout.policy, PLAIN, seed, None, label, steps)
                if label is not None:
                    policies[recipe, seed] = (rollout.policy, label)
            augmented: Any = None
            for round_ in range(1, rollout.rounds + 1):
                suffix = "" if round_ == rollout.rounds else f".round{round_}"
                if round_ > 1:
                    label = f"{recipe}.round{round_ - 1}"
                    policy = submit_train(rollout.policy, recipe, seed, augmented, label)
                    policies[recipe, seed] = (rollout.policy, label)
                out = root / name / f"aug-{recipe}{suffix}-s{seed}"
                augmented = _submit_rollout(client, data, bcs[seed], policy, single, out, seed)
            rollouts[recipe, seed] = augmented
    for learner in learners:
        for recipe in [PLAIN, *recipes]:
            for seed in seeds:
                submit_train(learner, recipe, seed, rollouts.get((recipe, seed)))
    models = dict(zip(trained, client.gather(list(trained.values())), strict=True))
    augmented_refs: dict[tuple[str, int], AugmentedRef] = dict(
        zip(rollouts, client.gather(list(rollouts.values())), strict=True)
    )
    bc_refs: dict[int, ModelRef] = dict(zip(bcs, client.gather(list(bcs.values())), strict=True))
    diagnostics: dict[str, Any] = {}
    for recipe in recipes:
        refs = [augmented_refs[recipe, s] for s in seeds if (recipe, s) in augmented_refs]
        policy = str(RECIPES[recipe][0].get("policy", "bc"))
        diagnostics[recipe] = {
            "rows": [r.rows for r in refs],
            "ess_fraction": [r.weight_stats.get("ess_fraction") for r in refs],
            "episode_return": [(r.metrics or {}).get("episode_return") for r in refs],
            "filter": [(r.metrics or {}).get("filter") for r in refs],
            # The rollout policy's own greedy score, to set beside the data's.
            "rollout_policy": policy,
            "rollout_transitions": RECIPES[recipe][0].get(
                "rollout_transitions", sizes.rollout_transitions
            ),
            "rollout_policy_steps": RECIPES[recipe][0].get(
                "policy_steps", _train_steps(name, sizes)
            ),
            "rollout_policy_score": [
                (bc_refs[s].metrics.get("eval") or {}).get("normalised_score")
                if policy == "bc"
                else _score(models[(*policies.get((recipe, s), (policy, PLAIN)), s)])
                for s in seeds
            ],
        }
    first_bc = bc_refs[seeds[0]].metrics
    return {
        "scores": {key: _score(model) for key, model in models.items()},
        "diagnostics": diagnostics,
        "bc_scores": [
            (bc_refs[s].metrics.get("eval") or {}).get("normalised_score") for s in seeds
        ],
        "data": first_bc.get("data"),
        "transitions": data.rows,
        "data_fingerprint": fingerprint,
    }


def _records(
    name: str,
    learner: str,
    recipes: list[str],
    seeds: list[int],
    result: dict[str, Any],
    sizes: Sizes,
) -> dict[str, Any]:
    scores = result["scores"]
    arms = {recipe: [scores[learner, recipe, s] for s in seeds] for recipe in recipes}
    size = {
        "dataset": name,
        "transitions": result["transitions"],
        "data_fingerprint": result["data_fingerprint"],
        "gradient_steps": _train_steps(name, sizes),
        "hidden": list(HIDDEN),
        "learner_config": DATASETS[name].configs.get(learner, {}),
        "eval_episodes": sizes.eval_episodes,
        "bc_steps": sizes.bc_steps,
        "rollout_transitions": sizes.rollout_transitions,
    }
    absolute = {
        "plain": [scores[learner, PLAIN, s] for s in seeds],
        "bc_normalised_scores": result["bc_scores"],
        "data": result["data"],
        "rollout_diagnostics": result["diagnostics"],
    }
    return _record(name, learner, seeds, arms, absolute, size)


def _record(
    name: str,
    learner: str,
    seeds: list[int],
    arms: dict[str, list[float]],
    absolute: dict[str, Any],
    size: dict[str, Any],
) -> dict[str, Any]:
    """The record of one (dataset, learner): every recipe's per-seed scores against plain's."""
    plain = absolute["plain"]
    comparisons = {recipe: compare(plain, scores) for recipe, scores in arms.items()}
    best = max(comparisons, key=lambda r: comparisons[r].difference.value)
    chosen = comparisons[best]
    per_recipe = {
        recipe: {
            "per_seed": arms[recipe],
            "iqm": c.arm.value,
            "difference": c.difference.value,
            "interval": [c.difference.low, c.difference.high],
            "probability_of_improvement": c.probability_of_improvement,
        }
        for recipe, c in comparisons.items()
    }
    default = per_recipe.get(DEFAULT_RECIPE)
    return {
        "benchmark": f"augmentation_{name}_{learner}",
        "unit": "normalised score (points)",
        "offaug": chosen.arm.value,
        "baseline": chosen.baseline.value,
        "baseline_name": "the same learner on the original data alone (plain), same seeds",
        "ratio": chosen.difference.value,
        "interval": [chosen.difference.low, chosen.difference.high],
        "probability_of_improvement": chosen.probability_of_improvement,
        "goal": 0.0,
        "goal_met": chosen.difference.low > 0 and chosen.probability_of_improvement >= 0.75,
        "best_recipe": best,
        "default_recipe": DEFAULT_RECIPE,
        "default_loses": bool(default is not None and default["interval"][1] < 0),
        "repeats": len(seeds),
        "seeds": seeds,
        "size": size,
        "absolute": {**absolute, "recipes": per_recipe},
        "notes": (
            "ratio = IQM(best recipe) - IQM(plain) in normalised points, interval = 95% "
            "stratified bootstrap CI of that difference, P(improvement) Mann-Whitney over "
            "seeds; goal met when the interval is above 0 and P >= 0.75. Final policies, "
            "same evaluation start seeds for every arm."
        ),
    }


def _extended(record: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """``record`` with an earlier run's seeds of the same (dataset, learner) and sizes added:
    the recipes both measured, every comparison recomputed over all seeds.

    Raises:
        ValueError: the sizes differ, the seeds overlap, or no recipe is common.
    """
    name = record["benchmark"]
    if record["size"] != earlier["size"]:
        raise ValueError(f"--extend: {name} was measured at other sizes: {earlier['size']}")
    if set(record["seeds"]) & set(earlier["seeds"]):
        raise ValueError(f"--extend: {name} has seeds {earlier['seeds']} already")
    new, old = record["absolute"], earlier["absolute"]
    common = [r for r in old["recipes"] if r in new["recipes"]]
    if not common:
        raise ValueError(f"--extend: {name} shares no recipe with the earlier record")

    def joined(before: Any, after: Any) -> Any:
        # Per-seed lists are joined; anything else (the data's score, a policy's name) is kept.
        return before + after if isinstance(before, list) else before

    diagnostics = {
        r: {k: joined(v, new["rollout_diagnostics"][r][k]) for k, v in d.items()}
        for r, d in old["rollout_diagnostics"].items()
        if r in common
    }
    absolute = {
        "plain": old["plain"] + new["plain"],
        "bc_normalised_scores": old["bc_normalised_scores"] + new["bc_normalised_scores"],
        "data": old["data"],
        "rollout_diagnostics": diagnostics,
    }
    arms = {r: old["recipes"][r]["per_seed"] + new["recipes"][r]["per_seed"] for r in common}
    seeds = earlier["seeds"] + record["seeds"]
    return _record(
        record["size"]["dataset"], _learner(record), seeds, arms, absolute, record["size"]
    )


def _learner(record: dict[str, Any]) -> str:
    """The learner of a per-dataset record, from its name ``augmentation_DATASET_LEARNER``."""
    return str(record["benchmark"]).removeprefix(f"augmentation_{record['size']['dataset']}_")


def _join(record: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the recipes an earlier run measured on the same seeds and sizes that
    this run did not: the seeds train the same plain runs, so plain's per-seed scores must
    agree (a check that both runs trained alike), and every comparison is recomputed.

    Raises:
        ValueError: the sizes or seeds differ, or plain's scores do not agree.
    """
    name = record["benchmark"]
    if record["size"] != earlier["size"] or record["seeds"] != earlier["seeds"]:
        raise ValueError(
            f"--join: {name} was measured at other sizes or seeds:"
            f" {earlier['size']}, seeds {earlier['seeds']}"
        )
    new, old = record["absolute"], earlier["absolute"]
    mismatched = [
        seed
        for seed, a, b in zip(record["seeds"], new["plain"], old["plain"], strict=True)
        if abs(a - b) > 1e-6 * max(1.0, abs(b))
    ]
    if mismatched:
        raise ValueError(
            f"--join: {name}: plain scores differ from the earlier run's on seeds {mismatched}"
            f" ({new['plain']} against {old['plain']}); the runs did not train alike"
        )
    added = [r for r in old["recipes"] if r not in new["recipes"]]
    arms = {r: new["recipes"][r]["per_seed"] for r in new["recipes"]}
    arms.update({r: old["recipes"][r]["per_seed"] for r in added})
    diagnostics = dict(new["rollout_diagnostics"])
    diagnostics.update(
        {r: old["rollout_diagnostics"][r] for r in added if r in old["rollout_diagnostics"]}
    )
    absolute = {
        **{k: v for k, v in new.items() if k != "recipes"},
        "rollout_diagnostics": diagnostics,
    }
    dataset = record["size"]["dataset"]
    return _record(dataset, _learner(record), record["seeds"], arms, absolute, record["size"])


def _measure(
    workers: int,
    datasets: list[str],
    learners: list[str],
    recipes: list[str],
    seeds: list[int],
    sizes: Sizes,
    root: Path,
    reporter: Reporter,
    earlier: dict[str, dict[str, Any]],
    joining: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """Every dataset's grid on a LocalCluster of ``workers``; its records, emitted as they come
    (each joined with ``earlier``'s record of the same name, see :func:`_extended`, and with
    ``joining``'s, see :func:`_join`)."""
    from distributed import Client, LocalCluster

    from offaug.pipeline.engine.workers import WorkerSetup

    records = []
    with (
        LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(WorkerSetup(1))
        for name in datasets:
            started = time.perf_counter()
            log(f"{name}: {len(learners)} learners x {len(recipes) + 1} arms x {len(seeds)} seeds")
            result = _run_dataset(client, name, learners, recipes, seeds, sizes, root)
            log(f"{name}: {time.perf_counter() - started:.0f} s")
            for learner in learners:
                record = _records(name, learner, recipes, seeds, result, sizes)
                if record["benchmark"] in joining:
                    record = _join(record, joining[record["benchmark"]])
                if record["benchmark"] in earlier:
                    record = _extended(record, earlier[record["benchmark"]])
                record["absolute"]["seconds"] = time.perf_counter() - started
                reporter.emit(record)
                records.append(record)
    return records


def _per_dataset(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The per-(dataset, learner) records by name; the latest record of a name wins."""
    found: dict[str, dict[str, Any]] = {}
    for record in records:
        name = record.get("benchmark", "")
        if any(name.startswith(f"augmentation_{d}_") for d in DATASETS):
            found[name] = record
    return found


def _reusable(path: Path | None, measured: list[str], learners: list[str]) -> list[dict[str, Any]]:
    """The per-dataset records in ``path`` of (dataset, learner) pairs this run does not
    measure (any learner of a dataset not in ``measured``, the other learners of one that is);
    the latest record of a pair wins."""
    if path is None:
        return []
    now = {f"augmentation_{d}_{learner}" for d in measured for learner in learners}
    return [r for name, r in _per_dataset(load_records(path)).items() if name not in now]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Pendulum only, 3 seeds, small runs")
    parser.add_argument("--datasets", default="", help="comma-separated subset of datasets")
    parser.add_argument("--learners", default="", help="comma-separated learners")
    parser.add_argument("--recipes", default="", help="comma-separated recipes")
    parser.add_argument("--seeds", default="", help="comma-separated training seeds")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--reuse",
        type=Path,
        help=(
            "an earlier run's JSON lines (or benchmarks/results.json): its per-dataset records"
            " of (dataset, learner) pairs this run does not measure are emitted again and"
            " counted in the summary records, so a long run can be done in pieces"
        ),
    )
    parser.add_argument(
        "--extend",
        type=Path,
        help=(
            "an earlier run's JSON lines (or benchmarks/results.json): each record this run"
            " measures is joined with that file's record of the same dataset and learner"
            " (same sizes, other seeds), its comparisons recomputed over all the seeds"
        ),
    )
    parser.add_argument(
        "--join",
        type=Path,
        help=(
            "an earlier run's JSON lines (or benchmarks/results.json): each record this run"
            " measures takes that file's record of the same dataset, learner, sizes and seeds"
            " for the recipes this run does not measure (plain is rerun and must agree), so a"
            " new recipe joins a finished comparison without retraining the others"
        ),
    )
    args = parser.parse_args(argv)
    out = protect_stdout()
    reporter = Reporter(out)
    os.environ.setdefault("D4RL_SUPPRESS_IMPORT_ERROR", "1")
    sizes = QUICK if args.quick else FULL

    def pick(text: str, default: list[str]) -> list[str]:
        return [t.strip() for t in text.split(",") if t.strip()] or default

    # "none" measures nothing: with --reuse, only the summary of an earlier run's records.
    datasets = (
        []
        if args.datasets.strip() == "none"
        else pick(args.datasets, ["pendulum-medium"] if args.quick else list(DATASETS))
    )
    learners = pick(args.learners, ["cql", "td3bc"] if args.quick else ["cql", "iql", "td3bc"])
    recipes = pick(
        args.recipes,
        ["reset-0.1", "state-noise"]
        if args.quick
        else ["reset-0.1", "reset-0.3", "branch-h50", "model-h5", "state-noise"],
    )
    seeds = [
        int(s)
        for s in pick(args.seeds, ["0", "1", "2"] if args.quick else ["0", "1", "2", "3", "4"])
    ]
    unknown = [r for r in recipes if r not in RECIPES] + [d for d in datasets if d not in DATASETS]
    if unknown:
        parser.error(f"unknown recipe or dataset: {', '.join(unknown)}")

    root = (
        DATA_DIR
        / "augmentation"
        / ("quick" if args.quick else "full")
        / time.strftime("%Y%m%d-%H%M%S")
    )
    records = []
    if datasets:
        earlier = _per_dataset(load_records(args.extend)) if args.extend else {}
        joining = _per_dataset(load_records(args.join)) if args.join else {}
        records = _measure(
            args.workers,
            datasets,
            learners,
            recipes,
            seeds,
            sizes,
            root,
            reporter,
            earlier,
            joining,
        )
    for record in _reusable(args.reuse, datasets, learners):
        reporter.emit(record)
        records.append(record)
    cql = [r for r in records if r["benchmark"].endswith("_cql")]
    if cql:
        won = sum(bool(r["goal_met"]) for r in cql)
        reporter.emit(
            {
                "benchmark": "augmentation_cql_datasets_won",
                "unit": "datasets",
                "offaug": won,
                "baseline": len(cql),
                "baseline_name": "datasets measured",
                "ratio": won,
                "goal": CQL_DATASETS_GOAL,
                "goal_met": won >= CQL_DATASETS_GOAL,
                "repeats": len(seeds),
                "seeds": seeds,
                "size": {"datasets": [r["size"]["dataset"] for r in cql]},
                "notes": "datasets where a recipe beats plain for CQL (interval > 0, P >= 0.75)",
            }
        )
    losses = [r["benchmark"] for r in records if r["default_loses"]]
    reporter.emit(
        {
            "benchmark": "augmentation_default_never_loses",
            "unit": "dataset x learner pairs where the default recipe loses",
            "offaug": len(losses),
            "baseline": len(records),
            "baseline_name": "pairs measured",
            "ratio": len(losses),
            "goal": 0,
            "goal_direction": "at most",
            "goal_met": not losses,
            "repeats": len(seeds),
            "seeds": seeds,
            "size": {"default_recipe": DEFAULT_RECIPE, "losing": losses},
            "notes": "the default recipe loses when its IQM-difference interval lies below 0",
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
