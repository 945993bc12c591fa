"""A workflow's stages as a plan: what runs, on which inputs, under which names, before Dask.

:func:`plan_workflow` expands a workflow over its training seeds and recipes
(:meth:`~offaug.pipeline.schema.workflow.Workflow.arms`) into :class:`StageSpec` records, in the
order they are dispatched; :mod:`offaug.pipeline.engine.graph` hands them to the scheduler. Every
stage is planned here, the report's media, the dataset doctor and the report included; a test reads
the plan without running anything.

**Sharing** of equal stages is :class:`~offaug.pipeline.engine.stage_plan.Plan`'s: one BC per (bc
config, seed), one rollout (tasks and merge) per (rollout config, BC, rollout policy, seed),
and recipes that differ only in how they train (``train.mixing``) share their rollouts.

**Names.** A stage of the workflow's own ``seed`` and of the default recipe (``augmented``)
keeps the plain name (``bc``, ``rollout:0``, ``rollout``, ``train:cql-plain``,
``train:cql-augmented``, ``diagnose:cql-augmented``, ``diagnose``). Another seed appends
``@sSEED``; another recipe's rollout, merged diagnostics and recipe-specific BC carry
``[RECIPE]``: ``bc@s1``, ``bc[RECIPE]``, ``rollout[RECIPE]:0@s1``, ``rollout[RECIPE]@s1``,
``train:cql-RECIPE@s1``, ``diagnose:cql-RECIPE@s1``, ``diagnose[RECIPE]@s1``. A shared stage
has the name of the first recipe that asked for it.

**Equal steps.** Each run's total gradient steps are those of every model its training depends
on, found by walking the plan's inputs (each model counted once): its own, the BC clone (where it
rolls out or its density weights the rows), the learners whose rollouts it trains on (every round;
``rollout.policy_steps``), a dynamics ensemble or a denoiser, and the plain run it starts from
(``train.init: plain``). With ``train.baseline`` every plain learner is trained again for each total
an augmented arm spent (``train:LEARNER-baseline[STEPS]``), the bar
:func:`~offaug.pipeline.outcome.verdict.judge_best` judges the best augmented arm against. The run
index records each run's ``steps``, ``own_steps`` and ``rollouts``.

**Fused seeds.** With ``train.fuse_seeds`` and several seeds, a learner that trains fused
(:func:`offaug.algorithms.training.fused_loop.fusable`; with ``auto`` and ``train.device`` set, one
for which fusing pays on that device, :func:`~offaug.algorithms.training.fused_loop.fusing_pays`;
with ``auto`` and no device named, the fused stage asks on its worker and trains the seeds one after
another where fusing does not pay) trains the seeds of a (recipe, learner) in groups of
``train.fuse_group``, one stage per group named after its first seed, ``fused:LEARNER-RECIPE``,
``fused:LEARNER-RECIPE@s5`` (:func:`~offaug.pipeline.stages.learning.train_offline_fused`), followed
by one small stage per seed under the per-seed name (``train:LEARNER-RECIPE@sSEED``,
:func:`~offaug.pipeline.stages.learning.member_model`) whose result is that seed's model: every
later stage, the run index and ``stages.json`` see each seed's model as they see a per-seed
training's. A group's key covers its seeds, never the group size, so seeds added later train
only the groups they fill. Forcing a seed's ``train:`` stage reruns its group's fused stage.
Policy weights, state noise and ``train.compile`` keep one stage per seed, as do learners that
do not train fused.
"""

from __future__ import annotations

from collections.abc import Sequence

from offaug.pipeline.contracts import (
    BEST_VIDEO_STAGE,
    DATA_VIDEO_STAGE,
    DOCTOR_STAGE,
    REPORT_STAGE,
    VIDEO_STAGE_PREFIX,
    RecipeStages,
)
from offaug.pipeline.engine.planner import Planner
from offaug.pipeline.engine.stage_plan import Plan, Ref, RefList, StageSpec
from offaug.pipeline.outcome.summary import weighting_of
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.recipes import Recipe
from offaug.pipeline.schema.workflow import Workflow
from offaug.pipeline.stages import learning as stages
from offaug.pipeline.stages import media as media_stages
from offaug.pipeline.stages.doctor import doctor_stage
from offaug.pipeline.stages.publishing import publish_stage


def plan_workflow(workflow: Workflow, layout: RunLayout, threads: int) -> Plan:
    """Every stage of ``workflow``, in dispatch order (see the module docstring): the source,
    trainings, rollouts and diagnostics, then publishing, the report's media and the doctor,
    and the report last."""
    planner = Planner(workflow, layout, threads)
    planner.source()
    arms = workflow.arms()
    seeds = list(workflow.seeds)
    diagnosed = seeds if workflow.diagnostics.seeds == "all" else seeds[:1]
    rollouts: dict[str, dict[int, str | None]] = {name: {} for name in arms}
    bcs: dict[tuple[str, int], str] = {}
    for seed in seeds:
        # Baselines on the original data need neither BC nor rollouts: they start at once.
        if workflow.train.baseline:
            for algorithm in workflow.train.algorithms:
                planner.plain(algorithm, seed)
        for recipe in arms.values():
            needs_bc = recipe.rolls_out_a_policy or (
                workflow.diagnostics.enabled and seed in diagnosed
            )
            if needs_bc:
                bcs[recipe.name, seed] = planner.bc(recipe, seed)
            rollouts[recipe.name][seed] = (
                planner.rollout(recipe, seed, bcs.get((recipe.name, seed)))
                if recipe.has_rollouts
                else None
            )
    for recipe in arms.values():
        planner.step_account.bc_shapes_data[recipe.name] = (
            recipe.rollout.policy == "bc" or recipe.train.weighting == "behaviour"
        )
        planner.trainings(recipe, rollouts[recipe.name])
    planner.baselines()
    planner.step_account.account(planner.plan)
    diagnoses: dict[tuple[str, int], str] = {}
    if workflow.diagnostics.enabled:
        for seed in diagnosed:
            for recipe in arms.values():
                diagnoses[recipe.name, seed] = planner.diagnose(
                    recipe, seed, bcs[recipe.name, seed], rollouts[recipe.name][seed]
                )
    for recipe in arms.values():
        stages_of = planner.plan.index["recipes"][recipe.name] = RecipeStages(
            weighting=weighting_of(recipe.train),
            policy="none" if recipe.rollout.backend == "diffusion" else recipe.rollout.policy,
            bc={str(s): bcs[recipe.name, s] for s in seeds if (recipe.name, s) in bcs},
            rollout={str(s): r for s, r in rollouts[recipe.name].items() if r is not None},
            diagnose={
                str(s): diagnoses[recipe.name, s]
                for s in diagnosed
                if (recipe.name, s) in diagnoses
            },
        )
        retrained = {
            str(s): planner.policy_models[recipe.name, s]
            for s in seeds
            if (recipe.name, s) in planner.policy_models
        }
        if retrained:
            stages_of["policy_models"] = retrained
    _publish(planner, arms, rollouts, seeds)
    _media(planner)
    _report(planner)
    return planner.plan


def _publish(
    planner: Planner,
    arms: dict[str, Recipe],
    rollouts: dict[str, dict[int, str | None]],
    seeds: Sequence[int],
) -> None:
    """Publish the first recipe's augmented data of the first seed (the original alone if none)."""
    workflow = planner.workflow
    if workflow.publish is None:
        return
    rollout = next((rollouts[name][seeds[0]] for name in arms if rollouts[name][seeds[0]]), None)
    provenance = {"workflow": workflow.name, "workflow_hash": workflow.digest()}
    planner.plan.add(
        StageSpec(
            "publish",
            publish_stage,
            workflow.publish,
            (
                Ref("source"),
                None if rollout is None else Ref(rollout),
                workflow.publish,
                provenance,
            ),
        )
    )


def _media(planner: Planner) -> None:
    """The report's videos (one stage per trained policy of the primary seed, one for the data)
    and the dataset doctor, on the primary seed's first augmented set."""
    workflow, plan = planner.workflow, planner.plan
    report = workflow.report
    primary = str(plan.index["primary_seed"])
    models = dict.fromkeys(r["stage"] for r in plan.index["runs"] if str(r["seed"]) == primary)
    rollout = next(
        (
            by_seed[primary]
            for by_seed in (r["rollout"] for r in plan.index["recipes"].values())
            if primary in by_seed
        ),
        None,
    )
    augmented = None if rollout is None else Ref(rollout)
    if report.videos:
        videos = planner.layout.videos
        config = {"report": report, "seed": workflow.seed}
        for model in models:
            plan.add(
                StageSpec(
                    f"{VIDEO_STAGE_PREFIX}{model.removeprefix('train:')}",
                    media_stages.render_policy_stage,
                    config,
                    (Ref("source"), Ref(model), report, videos, workflow.seed),
                )
            )
        plan.add(
            StageSpec(
                DATA_VIDEO_STAGE,
                media_stages.render_data_stage,
                config,
                (Ref("source"), augmented, report, videos, workflow.seed),
            )
        )
    runs = plan.index["runs"]
    if report.best_video and runs and workflow.evaluation.episodes > 0:
        plan.add(
            StageSpec(
                BEST_VIDEO_STAGE,
                media_stages.render_best_policy_stage,
                {"report": report, "seed": workflow.seed},
                (
                    Ref("source"),
                    RefList(tuple(r["stage"] for r in runs)),
                    tuple((r["learner"], r["recipe"], int(r["seed"])) for r in runs),
                    report,
                    planner.layout.videos / "best",
                    workflow.seed,
                ),
            )
        )
    if report.doctor:
        gamma = workflow.diagnostics.gamma
        plan.add(
            StageSpec(
                DOCTOR_STAGE,
                doctor_stage,
                {"gamma": gamma, "rollout": workflow.rollout},
                (Ref("source"), augmented, gamma, workflow),
            )
        )


def _report(planner: Planner) -> None:
    """metrics.json and report.html from every other stage's result: a stage like the others (a
    worker renders the plots while the client only waits), rerun when any result or the
    workflow changes."""
    plan, layout = planner.plan, planner.layout
    names = tuple(plan.names)
    plan.add(
        StageSpec(
            REPORT_STAGE,
            stages.report_stage,
            planner.workflow.digest(),
            (
                planner.workflow,
                names,
                RefList(names),
                layout,
                plan.index,
            ),
        )
    )
