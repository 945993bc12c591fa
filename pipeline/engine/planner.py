"""How each kind of stage is planned: :class:`Planner` builds a :class:`Plan` one stage kind at a
time (source, BC, training, fused training, rollouts and their rounds, model and diffusion
generation, diagnostics) and keeps the run index and the equal-steps accounting
(:class:`~offaug.pipeline.engine.step_account.StepAccount`) as it goes.
:func:`offaug.pipeline.engine.plan.plan_workflow` calls it in dispatch order; the names, the
sharing of equal stages and the steps counted are described there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from offaug.pipeline.contracts import (
    PLAIN,
    RunEntry,
    RunIndex,
    baseline_recipe,
)
from offaug.pipeline.engine.stage_plan import Plan, Ref, RefList, StageSpec, path_name
from offaug.pipeline.engine.step_account import StepAccount
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.recipes import DEFAULT_RECIPE, Recipe
from offaug.pipeline.schema.rollout_section import RolloutModel
from offaug.pipeline.schema.sections import TrainModel
from offaug.pipeline.schema.workflow import Workflow
from offaug.pipeline.stages import learning as stages
from offaug.pipeline.stages import rollouts as rollout_stages


class Planner:
    """Builds a :class:`Plan`; one method per kind of stage."""

    def __init__(self, workflow: Workflow, layout: RunLayout, threads: int) -> None:
        self.workflow = workflow
        self.layout = layout
        self.threads = threads
        self.plan = Plan()
        self.policy_models: dict[tuple[str, int], str] = {}
        """(recipe, seed) -> the policy its last rollout round rolled out, where it is not the
        learner's plain run (a retrained one, or one trained for ``rollout.policy_steps``)."""
        self.step_account = StepAccount()
        """The equal-steps accounting, recorded as stages are added."""
        self.rollout_policies: dict[tuple[str, int], str] = {}
        """(recipe, seed) -> the stage of the policy its last rollout round rolled out (the BC
        stage for the clone): where ``train.init: policy`` starts its rollout learner."""
        self.plan.index = RunIndex(
            primary_seed=workflow.seed, seeds=list(workflow.seeds), runs=[], recipes={}
        )

    def suffix(self, seed: int) -> str:
        return "" if seed == self.workflow.seed else f"@s{seed}"

    def source(self) -> str:
        source = self.workflow.source
        return self.plan.add(StageSpec("source", stages.prepare_source, source, (source,)))

    def train(
        self,
        train: TrainModel,
        algorithm: str,
        recipe: str,
        seed: int,
        augmented: str | None,
        *,
        plain: bool = True,
        record: bool = True,
        start: str | None = None,
    ) -> str:
        """One (recipe, learner, seed) run on the original data (``augmented`` None) or on
        original + augmented data; recorded in the run index under its recipe unless ``record``
        is False (a rollout policy of a later round). A recipe without rollouts trains on the
        original data with its augmentation inside the loss (``plain=False``). ``start``: the
        stage whose model it starts from (``train.init: policy``)."""
        label = f"{algorithm}-{recipe}{self.suffix(seed)}"
        evaluation = self.workflow.evaluation
        config: dict[str, Any] = {
            "train": train,
            "evaluation": evaluation,
            "algorithm": algorithm,
            "seed": seed,
        }
        function: Callable[..., Any] = stages.train_offline
        if augmented is None and not plain:
            # Only a recipe of rollout backend 'none' gets here: the train stage's keyword that
            # turns on its train-level augmentation (state noise) without augmented data.
            config["plain"] = False
            function = functools.partial(function, plain=False)
        init: tuple[Ref, ...] = ()
        if start is not None:
            init = (Ref(start),)
        elif train.init == "plain" and not (augmented is None and plain):
            init = (Ref(self.plain(algorithm, seed)),)
        name = self.plan.add(
            StageSpec(
                f"train:{label}",
                function,
                config,
                (
                    algorithm,
                    Ref("source"),
                    None if augmented is None else Ref(augmented),
                    train,
                    evaluation,
                    str(self.layout.model(path_name(label))),
                    seed,
                    self.threads,
                    *init,
                ),
                dict(train.resources) or None,
            )
        )
        self.step_account.gradient_steps[name] = train.steps
        if record:
            self.record_run(algorithm, recipe, seed, name, label)
        return name

    def record_run(self, algorithm: str, recipe: str, seed: int, stage: str, label: str) -> None:
        entry = RunEntry(learner=algorithm, recipe=recipe, seed=seed, stage=stage, label=label)
        if entry not in self.plan.index["runs"]:
            self.plan.index["runs"].append(entry)

    def fused(
        self,
        train: TrainModel,
        algorithm: str,
        recipe: str,
        rollouts: dict[int, str | None],
        *,
        plain: bool = True,
    ) -> dict[int, str]:
        """The seeds of (``recipe``, ``algorithm``) as fused training stages, one per group of
        ``train.fuse_group`` seeds in the workflow's order, and one stage per seed that selects
        its model under the per-seed name; return those names by seed."""
        augmented = [r for r in rollouts.values() if r is not None]
        if augmented and len(augmented) != len(rollouts):
            raise ValueError(f"{recipe}: augmented data for some seeds only")
        seeds = list(rollouts)
        names: dict[int, str] = {}
        for start in range(0, len(seeds), train.fuse_group):
            group = {seed: rollouts[seed] for seed in seeds[start : start + train.fuse_group]}
            names.update(self.fused_group(train, algorithm, recipe, group, plain=plain))
        return names

    def fused_group(
        self,
        train: TrainModel,
        algorithm: str,
        recipe: str,
        rollouts: dict[int, str | None],
        *,
        plain: bool,
    ) -> dict[int, str]:
        """One group of :meth:`fused`: its fused stage, named after its first seed
        (``fused:LEARNER-RECIPE``, ``fused:LEARNER-RECIPE@s5``), and its members' stages."""
        seeds = list(rollouts)
        labels = {seed: f"{algorithm}-{recipe}{self.suffix(seed)}" for seed in seeds}
        augmented = [r for r in rollouts.values() if r is not None]
        evaluation = self.workflow.evaluation
        config: dict[str, Any] = {
            "train": train,
            "evaluation": evaluation,
            "algorithm": algorithm,
            "seeds": seeds,
        }
        function: Callable[..., Any] = stages.train_offline_fused
        if not augmented and not plain:
            # As in train(): state noise on the original data alone (a recipe of backend none).
            config["plain"] = False
            function = functools.partial(function, plain=False)
        outs = [str(self.layout.model(path_name(labels[seed]))) for seed in seeds]
        fused = self.plan.add(
            StageSpec(
                f"fused:{algorithm}-{recipe}{self.suffix(seeds[0])}",
                function,
                config,
                (
                    algorithm,
                    Ref("source"),
                    RefList(tuple(augmented)) if augmented else None,
                    train,
                    evaluation,
                    outs,
                    seeds,
                    self.threads,
                ),
                dict(train.resources) or None,
                aliases=tuple(f"train:{labels[seed]}" for seed in seeds),
            )
        )
        names = {}
        for index, seed in enumerate(seeds):
            names[seed] = self.plan.add(
                StageSpec(
                    f"train:{labels[seed]}",
                    stages.member_model,
                    {"seed": seed, "index": index},
                    (Ref(fused), index),
                )
            )
            self.step_account.gradient_steps[names[seed]] = train.steps
            rollout = rollouts[seed]
            self.step_account.depends[names[seed]] = (
                ("source",) if rollout is None else ("source", rollout)
            )
            self.record_run(algorithm, recipe, seed, names[seed], labels[seed])
        return names

    def plain(self, algorithm: str, seed: int, steps: int | None = None) -> str:
        """``algorithm``'s run on the original data alone, with ``train.steps`` or ``steps``
        gradient steps (another budget is recipe ``baseline[STEPS]``)."""
        train, recipe = self.workflow.plain_train, PLAIN
        if steps is not None and steps != train.steps:
            train, recipe = train.model_copy(update={"steps": steps}), baseline_recipe(steps)
        if train.fuses(algorithm, len(self.workflow.seeds), plain=True):
            nothing: dict[int, str | None] = dict.fromkeys(self.workflow.seeds)
            return self.fused(train, algorithm, recipe, nothing)[seed]
        return self.train(train, algorithm, recipe, seed, None)

    def baselines(self) -> None:
        """Every plain learner again at each total gradient steps an augmented arm spent (its
        rollout policy's included): the bar it is judged against at equal steps."""
        workflow = self.workflow
        if not workflow.train.baseline:
            return
        totals = self.step_account.augmented_totals(self.plan)
        for seed in workflow.seeds:
            for algorithm in workflow.train.algorithms:
                for steps in sorted(totals - {workflow.plain_train.steps}):
                    self.plain(algorithm, seed, steps)

    def trainings(self, recipe: Recipe, rollouts: dict[int, str | None]) -> None:
        """Every learner of ``recipe`` on every seed: one fused stage per learner that fuses its
        seeds, one stage per seed for the others."""
        train = recipe.train
        for algorithm in train.algorithms:
            continues = train.init == "policy" and algorithm == recipe.final_policy_learner
            if train.init == "policy" and not continues:
                train = train.model_copy(update={"init": "scratch"})
            if train.fuses(algorithm, len(self.workflow.seeds), plain=False):
                self.fused(train, algorithm, recipe.name, rollouts, plain=False)
                continue
            for seed, rollout in rollouts.items():
                start = self.rollout_policies.get((recipe.name, seed)) if continues else None
                self.train(train, algorithm, recipe.name, seed, rollout, plain=False, start=start)
            train = recipe.train

    def bc(self, recipe: Recipe, seed: int) -> str:
        own = recipe.bc == self.workflow.bc
        label = ("bc" if own else f"bc[{recipe.name}]") + self.suffix(seed)
        name = self.plan.add(
            StageSpec(
                label,
                stages.train_bc,
                {"bc": recipe.bc, "seed": seed},
                (Ref("source"), recipe.bc, str(self.layout.model(path_name(label))), seed),
            )
        )
        self.step_account.gradient_steps[name] = recipe.bc.steps
        self.step_account.bc_stages.add(name)
        return name

    def rollout(self, recipe: Recipe, seed: int, bc: str | None) -> str:
        """The rollout tasks and their merge, round after round; return the last merge's name.

        A learner named as the rollout policy rolls out its own plain run of this seed in round
        1 (trained for ``rollout.policy_steps`` when given), ``bc`` the BC clone; each later
        round retrains it (the clone as learner ``bc``), or ``rollout.rounds_learner`` where
        set, on the original data and the previous round's rollouts (with the recipe's train
        settings) and rolls that out. Earlier rounds
        carry ``.roundK`` in their tag; the last round has the recipe's own names. The
        diffusion backend rolls nothing out (``bc`` None):
        :meth:`generation`.
        """
        rollout = recipe.rollout
        if rollout.backend == "diffusion":
            return self.generation(
                rollout, seed, "" if recipe.name == DEFAULT_RECIPE else f"[{recipe.name}]"
            )
        assert bc is not None, "a policy's rollouts need the BC stage"
        policy_name = rollout.policy
        policy_steps = rollout.policy_steps
        policy = None if policy_name == "bc" else self.plain(policy_name, seed, policy_steps)
        if policy is not None and policy_steps not in (None, self.workflow.plain_train.steps):
            self.policy_models[recipe.name, seed] = policy
        rounds = rollout.rounds
        # Every round rolls out with rounds = 1: round 1 is then the same stage as a recipe
        # without rounds, and shared with it.
        single = (
            rollout.model_copy(update={"rounds": 1, "rounds_learner": None})
            if rounds > 1
            else rollout
        )
        merged = ""
        learner = recipe.final_policy_learner
        for round_ in range(1, rounds + 1):
            if round_ > 1:
                # train.init 'policy': each round continues from the policy it improves on,
                # where that is the same learner (rounds_learner starts from scratch after
                # round 1's other learner).
                previous = policy_name if round_ == 2 else learner
                continues = recipe.train.init == "policy" and previous == learner
                start = (policy or bc) if continues else None
                policy = self.train(
                    recipe.train,
                    learner,
                    f"{recipe.name}.round{round_ - 1}",
                    seed,
                    merged,
                    plain=False,
                    record=False,
                    start=start,
                )
                self.policy_models[recipe.name, seed] = policy
            tag = "" if recipe.name == DEFAULT_RECIPE else recipe.name
            if round_ < rounds:
                tag = f"{tag}.round{round_}".lstrip(".")
            merged = self.rollout_round(single, seed, bc, policy, f"[{tag}]" if tag else "")
        self.rollout_policies[recipe.name, seed] = bc if policy is None else policy
        return merged

    def rollout_round(
        self, rollout: RolloutModel, seed: int, bc: str, policy: str | None, tag: str
    ) -> str:
        """One round's rollout tasks and their merge (``policy`` None: the BC clone)."""
        sfx = self.suffix(seed)
        shards = "augmented" + ("" if not tag and not sfx else path_name(f"{tag}{sfx}"))
        out = str(self.layout.augmented.with_name(shards))
        extra = () if policy is None else (Ref(policy),)
        dynamics = None
        if rollout.backend == "model":
            # Keyed by what training reads: recipes that differ only in the penalty, projection,
            # horizon or starts share one ensemble (named after the first).
            trained = rollout.dynamics.model_dump(include={"members", "hidden", "steps"})
            dynamics = self.plan.add(
                StageSpec(
                    f"dynamics{tag}{sfx}",
                    rollout_stages.train_dynamics_stage,
                    {"dynamics": trained, "seed": seed},
                    (
                        Ref("source"),
                        rollout,
                        str(self.layout.models / path_name(f"dynamics{tag}{sfx}.pt")),
                        seed,
                    ),
                )
            )
            self.step_account.gradient_steps[dynamics] = rollout.dynamics.steps
        calibrated: tuple[Any, ...] = ()
        if rollout.noise_calibration is not None:
            # One probe for all tasks, so every shard rolls out with the same noise.
            calibrate = self.plan.add(
                StageSpec(
                    f"calibrate{tag}{sfx}",
                    rollout_stages.calibrate_noise_stage,
                    {"rollout": rollout, "seed": seed},
                    (Ref("source"), Ref(bc), rollout, out, seed, *extra),
                )
            )
            calibrated = (Ref(calibrate),)
        tasks = []
        for index in range(rollout.tasks):
            config = {"rollout": rollout, "index": index, "seed": seed}
            name = f"rollout{tag}:{index}{sfx}"
            if dynamics is None:
                policy_arg = extra or ((None,) if calibrated else ())
                spec = StageSpec(
                    name,
                    rollout_stages.rollout_shard,
                    config,
                    (Ref("source"), Ref(bc), rollout, out, seed, index, *policy_arg, *calibrated),
                )
            else:
                shard = str(self.layout.augmented.with_name(shards) / f"shard-{index:05d}.arrow")
                spec = StageSpec(
                    name,
                    rollout_stages.model_rollout_task,
                    config,
                    (Ref("source"), Ref(bc), Ref(dynamics), rollout, shard, index, seed, *extra),
                )
            tasks.append(self.plan.add(spec))
        merge = self.plan.add(
            StageSpec(
                f"rollout{tag}{sfx}",
                rollout_stages.merge_rollouts,
                {"rollout": rollout, "seed": seed},
                (RefList(tuple(tasks)), out, rollout, *calibrated),
            )
        )
        self.step_account.rollout_merges.add(merge)
        return merge

    def generation(self, rollout: RolloutModel, seed: int, tag: str) -> str:
        """The diffusion backend: train the denoiser, sample in tasks (one shard each), merge."""
        sfx = self.suffix(seed)
        shards = "augmented" + ("" if not tag and not sfx else path_name(f"{tag}{sfx}"))
        out = self.layout.augmented.with_name(shards)
        config = {"diffusion": rollout.diffusion, "seed": seed}
        denoiser = self.plan.add(
            StageSpec(
                f"denoiser{tag}{sfx}",
                rollout_stages.train_denoiser_stage,
                config,
                (
                    Ref("source"),
                    rollout,
                    str(self.layout.models / path_name(f"denoiser{tag}{sfx}.pt")),
                    seed,
                ),
            )
        )
        self.step_account.gradient_steps[denoiser] = rollout.diffusion.steps
        tasks = [
            self.plan.add(
                StageSpec(
                    f"rollout{tag}:{index}{sfx}",
                    rollout_stages.diffusion_sample_task,
                    {"rollout": rollout, "index": index, "seed": seed},
                    (
                        Ref("source"),
                        Ref(denoiser),
                        rollout,
                        str(out / f"shard-{index:05d}.arrow"),
                        index,
                        seed,
                    ),
                )
            )
            for index in range(rollout.tasks)
        ]
        merge = self.plan.add(
            StageSpec(
                f"rollout{tag}{sfx}",
                rollout_stages.merge_rollouts,
                {"rollout": rollout, "seed": seed},
                (RefList(tuple(tasks)), str(out), rollout),
            )
        )
        self.step_account.rollout_merges.add(merge)
        return merge

    def diagnose(self, recipe: Recipe, seed: int, bc: str, rollout: str | None) -> str:
        """Each policy's checks (the plain runs' and the recipe's), then their merge."""
        workflow = self.workflow
        config = workflow.diagnostics
        sfx = self.suffix(seed)
        runs = [r for r in self.plan.index["runs"] if r["seed"] == seed]
        models = [r["stage"] for r in runs if r["recipe"] == PLAIN]
        models += [r["stage"] for r in runs if r["recipe"] == recipe.name]
        tag = "" if recipe.bc == workflow.bc else f"[{recipe.name}]"
        parts = [
            self.plan.add(
                StageSpec(
                    f"diagnose{tag}:{model.removeprefix('train:')}",
                    stages.diagnose_policy_stage,
                    {"diagnostics": config, "index": index, "seed": seed},
                    (Ref("source"), Ref(bc), Ref(model), config, seed, index),
                )
            )
            for index, model in enumerate(models)
        ]
        name = "diagnose" + ("" if recipe.name == DEFAULT_RECIPE else f"[{recipe.name}]") + sfx
        out = self.layout.diagnostics
        if name != "diagnose":
            out = self.layout.diagnostics_of(path_name(name))
        return self.plan.add(
            StageSpec(
                name,
                stages.diagnose_stage,
                {"diagnostics": config, "seed": seed},
                (
                    Ref("source"),
                    None if rollout is None else Ref(rollout),
                    Ref(bc),
                    RefList(tuple(models)),
                    config,
                    str(out),
                    seed,
                    RefList(tuple(parts)),
                ),
            )
        )
