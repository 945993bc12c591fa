"""Seeds, recipes and grids: the stage plan a workflow expands into, and its validation.

The plan is built without running anything; tests/pipeline/test_graph.py runs one on Dask.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from offaug.pipeline.engine.plan import plan_workflow
from offaug.pipeline.engine.stage_plan import Plan, Ref, RefList, StageSpec
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.validation import WorkflowError
from offaug.pipeline.schema.workflow import Workflow, load_workflow


def _workflow(**sections: Any) -> Workflow:
    data: dict[str, Any] = {
        "name": "plan-test",
        "source": {"dataset": "plan/none-v0"},
        "rollout": {"episodes": 4, "tasks": 2, "noise": "gaussian:0.1"},
        "train": {"algorithms": ["cql", "bcq"]},
        **sections,
    }
    return Workflow.model_validate(data)


def _plan(workflow: Workflow, tmp_path: Path) -> Plan:
    return plan_workflow(workflow, RunLayout(tmp_path / "run"), 1)


def test_one_seed_and_the_default_recipe_keep_the_plain_names(tmp_path: Path) -> None:
    plan = _plan(_workflow(), tmp_path)
    assert plan.names == [
        "source",
        "train:cql-plain",
        "train:bcq-plain",
        "bc",
        "rollout:0",
        "rollout:1",
        "rollout",
        "train:cql-augmented",
        "train:bcq-augmented",
        # The plain learners again at the augmented arms' total: BC's 20,000 + 10,000 steps.
        "train:cql-baseline[30000]",
        "train:bcq-baseline[30000]",
        "diagnose:cql-plain",
        "diagnose:bcq-plain",
        "diagnose:cql-augmented",
        "diagnose:bcq-augmented",
        "diagnose",
        # The study's best policy, filmed for the report's top: it reads every run.
        "video:best",
        "doctor",
        "report",
    ]
    runs_in_order = [n for n in plan.names if n.startswith("train:")]
    assert plan.stages["video:best"].inputs == ("source", *runs_in_order)
    spec = plan.stages["train:cql-augmented"]
    assert spec.inputs == ("source", "rollout")
    assert spec.args[5] == str(tmp_path / "run" / "models" / "cql-augmented")
    assert plan.stages["rollout"].args[1] == str(tmp_path / "run" / "shards" / "augmented")
    runs = {(r["learner"], r["recipe"], r["seed"]): r["stage"] for r in plan.index["runs"]}
    assert runs[("cql", "plain", 0)] == "train:cql-plain"
    assert runs[("bcq", "augmented", 0)] == "train:bcq-augmented"


def test_seeds_times_a_grid_shares_what_is_equal(tmp_path: Path) -> None:
    # One stage per seed, so each seed's inputs show (fused stages: the test below).
    workflow = _workflow(
        seeds=[0, 1],
        train={"algorithms": ["cql", "bcq"], "fuse_seeds": False},
        grid={
            "rollout.noise": ["gaussian:0.1", "gaussian:0.3"],
            "train.mixing": [[0.5, 0.5], [0.7, 0.3]],
        },
        diagnostics={"enabled": False},
    )
    assert list(workflow.arms()) == [
        "noise=gaussian:0.1,mixing=[0.5,0.5]",
        "noise=gaussian:0.1,mixing=[0.7,0.3]",
        "noise=gaussian:0.3,mixing=[0.5,0.5]",
        "noise=gaussian:0.3,mixing=[0.7,0.3]",
    ]
    plan = _plan(workflow, tmp_path)
    names = plan.names
    # One BC per seed (the workflow's own seed keeps the plain name).
    assert [n for n in names if n.startswith("bc")] == ["bc", "bc@s1"]
    # One rollout per (noise, seed): the mixing values share them.
    merges = [n for n in names if n.startswith("rollout") and ":" not in n.split("]")[-1]]
    assert merges == [
        "rollout[noise=gaussian:0.1,mixing=[0.5,0.5]]",
        "rollout[noise=gaussian:0.3,mixing=[0.5,0.5]]",
        "rollout[noise=gaussian:0.1,mixing=[0.5,0.5]]@s1",
        "rollout[noise=gaussian:0.3,mixing=[0.5,0.5]]@s1",
    ]
    assert len([n for n in names if n.startswith("rollout[") and "]:" in n]) == 2 * 2 * 2
    # Every (recipe, learner, seed) is a training run: 4 recipes x 2 learners x 2 seeds, plus
    # the plain baselines of each learner and seed, with train.steps and with the recipes' total
    # gradient steps (one total: they share BC and train.steps).
    trains = [n for n in names if n.startswith("train:")]
    assert len(trains) == 4 * 2 * 2 + 2 * 2 + 2 * 2
    assert "train:cql-plain@s1" in trains
    assert "train:bcq-noise=gaussian:0.3,mixing=[0.7,0.3]@s1" in trains
    mixed = plan.stages["train:cql-noise=gaussian:0.1,mixing=[0.7,0.3]@s1"]
    assert mixed.inputs == ("source", "rollout[noise=gaussian:0.1,mixing=[0.5,0.5]]@s1")
    assert mixed.args[6] == 1  # the seed
    # Seeds differ in what they compute, not only in their names.
    assert plan.keys["bc"] != plan.keys["bc@s1"]
    runs = plan.index["runs"]
    assert len(runs) == len(trains) and {r["seed"] for r in runs} == {0, 1}
    rollouts = plan.index["recipes"]["noise=gaussian:0.1,mixing=[0.7,0.3]"]["rollout"]
    assert rollouts == {
        "0": "rollout[noise=gaussian:0.1,mixing=[0.5,0.5]]",
        "1": "rollout[noise=gaussian:0.1,mixing=[0.5,0.5]]@s1",
    }


def test_recipes_share_bc_and_rollouts_unless_they_change_them(tmp_path: Path) -> None:
    workflow = _workflow(
        recipes={
            "augmented": {},
            "longer": {"train": {"steps": 20_000}},
            "clone-more": {"bc": {"steps": 9000}},
            "wide": {"rollout": {"episodes": 8}},
        }
    )
    plan = _plan(workflow, tmp_path)
    index = plan.index["recipes"]
    assert index["longer"]["rollout"] == {"0": "rollout"} and index["longer"]["bc"] == {"0": "bc"}
    assert index["clone-more"]["bc"] == {"0": "bc[clone-more]"}
    assert index["clone-more"]["rollout"] == {"0": "rollout[clone-more]"}
    assert index["wide"]["bc"] == {"0": "bc"}
    assert index["wide"]["rollout"] == {"0": "rollout[wide]"}
    assert plan.stages["rollout[clone-more]:0"].inputs == ("source", "bc[clone-more]")
    assert plan.stages["train:cql-longer"].args[3].steps == 20_000
    # The plain baselines are trained once, with the workflow's own train section.
    assert [n for n in plan.names if n.endswith("-plain")] == [
        "train:cql-plain",
        "train:bcq-plain",
        "diagnose:cql-plain",
        "diagnose:bcq-plain",
        "diagnose[clone-more]:cql-plain",  # judged against that recipe's own beta_hat
        "diagnose[clone-more]:bcq-plain",
    ]
    assert {"diagnose", "diagnose[longer]", "diagnose[clone-more]", "diagnose[wide]"} <= set(
        plan.names
    )


def test_diagnostics_cover_the_first_seed_unless_asked_for_all(tmp_path: Path) -> None:
    first = _plan(_workflow(seeds=[3, 4], seed=3), tmp_path)
    assert [n for n in first.names if n.startswith("diagnose")][-1] == "diagnose"
    assert not any(n.startswith("diagnose") and n.endswith("@s4") for n in first.names)
    every = _plan(_workflow(seeds=[3, 4], seed=3, diagnostics={"seeds": "all"}), tmp_path)
    assert {"diagnose@s4", "diagnose:cql-augmented@s4"} <= set(every.names)


def test_recipe_and_grid_problems_name_the_field_and_line(tmp_path: Path) -> None:
    path = tmp_path / "study.yaml"
    path.write_text(
        "name: study\n"
        "source: {dataset: a/b-v0}\n"
        "recipes:\n"
        "  narrow:\n"
        "    rollout:\n"
        "      episods: 10\n"
        "  plain: {}\n"
        "  cautious:\n"
        "    train:\n"
        "      configs: {cql: {hiden: [8]}}\n"
        "grid:\n"
        "  rollout.nosie: [gaussian:0.1]\n"
        "  rollout.start:\n"
        "    - reset\n"
        "    - sideways\n"
    )
    with pytest.raises(WorkflowError) as info:
        load_workflow(path)
    lines = str(info.value).splitlines()
    assert any(
        line.startswith(f"{path}:6: recipes.narrow.rollout.episods: unknown key; allowed here:")
        and "episodes" in line
        for line in lines
    ), lines
    assert any(line.startswith(f"{path}:7: recipes.plain: ") for line in lines), lines
    assert any(
        line.startswith(f"{path}:10: recipes.cautious.train.configs.cql.hiden: unknown CQLConfig")
        for line in lines
    ), lines
    assert any(
        line.startswith(f"{path}:12: grid.rollout.nosie: rollout has no field 'nosie'")
        for line in lines
    ), lines
    assert any(line.startswith(f"{path}:15: grid.rollout.start.1: ") for line in lines), lines


def test_seeds_default_to_seed_and_must_be_distinct() -> None:
    assert _workflow(seed=7).seeds == (7,)
    assert _workflow(seeds=[1, 2]).seeds == (1, 2)
    with pytest.raises(ValueError, match="distinct"):
        _workflow(seeds=[1, 1])


def test_every_workflow_file_plans(tmp_path: Path) -> None:
    for path in sorted(Path("workflows").glob("*.yaml")):
        plan = _plan(load_workflow(path), tmp_path)
        assert plan.index["runs"], path


def test_fusable_learners_train_their_seeds_as_one_stage(tmp_path: Path) -> None:
    """td3bc's seeds train in one fused stage per recipe, each seed's model then its own stage
    under the per-seed name; bcq (fused only where it pays: not on a CPU) and arms the fused
    trainer refuses keep one training stage per seed."""
    sections: dict[str, Any] = dict(
        seeds=[0, 1],
        recipes={
            "augmented": {},
            "noisy": {"train": {"state_noise": {"kind": "gaussian", "scale": 0.01}}},
        },
        diagnostics={"enabled": False},
    )
    cpu = {"algorithms": ["td3bc", "bcq"], "device": "cpu"}  # fuse_seeds: auto
    plan = _plan(_workflow(train=cpu, **sections), tmp_path)
    fused = [n for n in plan.names if n.startswith("fused:")]
    assert fused == [
        "fused:td3bc-plain",
        "fused:td3bc-augmented",
        "fused:td3bc-baseline[30000]",
    ]
    spec = plan.stages["fused:td3bc-augmented"]
    assert spec.inputs == ("source", "rollout", "rollout@s1")
    models = tmp_path / "run" / "models"
    assert spec.args[5] == [str(models / "td3bc-augmented"), str(models / "td3bc-augmented@s1")]
    assert spec.args[6] == [0, 1]
    assert spec.aliases == ("train:td3bc-augmented", "train:td3bc-augmented@s1")
    assert plan.stages["train:td3bc-augmented@s1"].inputs == ("fused:td3bc-augmented",)
    assert plan.stages["train:td3bc-augmented@s1"].args[1] == 1
    # Not fused on a CPU, or state noise: one training stage per seed, on that seed's rollout.
    for name in ("train:bcq-augmented@s1", "train:td3bc-noisy@s1", "train:bcq-noisy@s1"):
        assert plan.stages[name].inputs == ("source", "rollout@s1"), name
    runs = {(r["learner"], r["recipe"], r["seed"]): r["stage"] for r in plan.index["runs"]}
    assert len(runs) == 2 * 4 * 2  # (plain, equal-steps plain, 2 recipes) x learners x seeds
    assert runs[("td3bc", "augmented", 1)] == "train:td3bc-augmented@s1"
    assert runs[("td3bc", "plain", 0)] == "train:td3bc-plain"

    for device, fuse_seeds in (("cpu", True), ("cuda", "auto")):
        train = {"algorithms": ["td3bc", "bcq"], "device": device, "fuse_seeds": fuse_seeds}
        forced = _plan(_workflow(train=train, **sections), tmp_path)
        assert "fused:bcq-augmented" in forced.names, (device, fuse_seeds)
    train = {"algorithms": ["td3bc", "bcq"], "fuse_seeds": False}
    apart = _plan(_workflow(train=train, **sections), tmp_path)
    assert not any(n.startswith("fused:") for n in apart.names)
    assert apart.stages["train:td3bc-augmented@s1"].inputs == ("source", "rollout@s1")
    one_seed = _plan(_workflow(train={"algorithms": ["td3bc"]}), tmp_path)
    assert not any(n.startswith("fused:") for n in one_seed.names)


def test_fused_seeds_train_in_groups_so_a_study_grows_without_retraining(tmp_path: Path) -> None:
    """Seven seeds in groups of three: three fused stages per arm, named after their first
    seed; adding seeds keeps the full groups' keys (their finished stages are reused), and the
    grouping itself is in no stage's key."""
    train = {"algorithms": ["td3bc"], "device": "cpu", "fuse_group": 3}
    sections: dict[str, Any] = dict(recipes={"augmented": {}}, diagnostics={"enabled": False})
    plan = _plan(_workflow(seeds=list(range(7)), train=train, **sections), tmp_path)
    groups = [n for n in plan.names if n.startswith("fused:td3bc-augmented")]
    assert groups == [
        "fused:td3bc-augmented",
        "fused:td3bc-augmented@s3",
        "fused:td3bc-augmented@s6",
    ]
    assert [plan.stages[n].args[6] for n in groups] == [[0, 1, 2], [3, 4, 5], [6]]
    assert plan.stages["train:td3bc-augmented@s4"].inputs == ("fused:td3bc-augmented@s3",)
    assert plan.stages["train:td3bc-augmented@s4"].args[1] == 1  # its place in the group
    runs = {(r["recipe"], r["seed"]) for r in plan.index["runs"] if r["learner"] == "td3bc"}
    assert {seed for recipe, seed in runs if recipe == "augmented"} == set(range(7))

    # A study that grows from 6 to 7 seeds: the two full groups keep their keys; the 7th
    # seed's group is new. Every other stage (BC, rollouts, reports of old seeds) is unchanged.
    six = _plan(_workflow(seeds=list(range(6)), train=train, **sections), tmp_path)
    for name in ("fused:td3bc-augmented", "fused:td3bc-augmented@s3", "rollout@s5", "bc@s2"):
        assert six.keys[name] == plan.keys[name], name
    assert "fused:td3bc-augmented@s6" not in six.names

    # Groups as large as the seeds: the same stages and keys as a workflow that never set the
    # field (whose default groups of 5 hold these 3 seeds), so a run's finished stages stay;
    # only the report, which shows the workflow, is made again.
    whole = _plan(_workflow(seeds=[0, 1, 2], train=train, **sections), tmp_path)
    default = _plan(
        _workflow(seeds=[0, 1, 2], train={"algorithms": ["td3bc"], "device": "cpu"}, **sections),
        tmp_path,
    )
    differ = {n for n in whole.keys if whole.keys[n] != default.keys.get(n)}
    assert differ == {"report"}
    assert [n for n in whole.names if n.startswith("fused:")] == [
        "fused:td3bc-plain",
        "fused:td3bc-augmented",
        "fused:td3bc-baseline[30000]",
    ]
    # Groups of one are no fusing: one training stage per seed.
    single = {**train, "fuse_group": 1}
    apart = _plan(_workflow(seeds=[0, 1], train=single, **sections), tmp_path)
    assert not any(n.startswith("fused:") for n in apart.names)


def test_rollout_rounds_retrain_the_policy_on_the_previous_rounds_rollouts(
    tmp_path: Path,
) -> None:
    workflow = _workflow(
        train={"algorithms": ["cql"], "fuse_seeds": False},
        recipes={
            "once": {"rollout": {"policy": "td3bc"}},
            "twice": {"rollout": {"policy": "td3bc", "rounds": 3}},
        },
        diagnostics={"enabled": False},
    )
    plan = _plan(workflow, tmp_path)
    stages = plan.stages
    # Round 1 rolls out td3bc's plain run, the same stages as the recipe without rounds.
    assert stages["rollout[once]:0"].inputs == ("source", "bc", "train:td3bc-plain")
    assert "rollout[twice.round1]" not in plan.names
    # Round 2 rolls out td3bc retrained on the original data and round 1's rollouts, with the
    # recipe's train settings; round 3 (the last) keeps the recipe's own names.
    assert stages["train:td3bc-twice.round1"].inputs == ("source", "rollout[once]")
    assert stages["rollout[twice.round2]:0"].inputs == ("source", "bc", "train:td3bc-twice.round1")
    assert stages["train:td3bc-twice.round2"].inputs == ("source", "rollout[twice.round2]")
    assert stages["rollout[twice]:0"].inputs == ("source", "bc", "train:td3bc-twice.round2")
    assert stages["train:cql-twice"].inputs == ("source", "rollout[twice]")
    index = plan.index["recipes"]["twice"]
    assert index["rollout"] == {"0": "rollout[twice]"}
    assert index.get("policy_models") == {"0": "train:td3bc-twice.round2"}
    assert "policy_models" not in plan.index["recipes"]["once"]
    # The retrained policies are not runs of the recipe: the verdict compares cql's only. The
    # plain cql again for each recipe's total: BC, td3bc's plain run, the retrained policies of
    # the earlier rounds and cql's own, 10,000 steps each but BC's 20,000.
    assert {(r["learner"], r["recipe"]) for r in plan.index["runs"]} == {
        ("cql", "plain"),
        ("td3bc", "plain"),
        ("cql", "once"),
        ("cql", "twice"),
        ("cql", "baseline[40000]"),
        ("cql", "baseline[60000]"),
    }


def test_rollout_rounds_of_the_bc_clone_retrain_it_as_learner_bc(tmp_path: Path) -> None:
    """ReST-style rounds of the clone: round 1 rolls out the BC stage's clone, round 2 the BC
    learner retrained on the data and round 1's kept episodes; every BC model counts."""
    workflow = _workflow(
        train={"algorithms": ["bc"], "fuse_seeds": False},
        recipes={"self": {"rollout": {"policy": "bc", "filter": "policy", "rounds": 2}}},
        diagnostics={"enabled": False},
    )
    plan = _plan(workflow, tmp_path)
    stages = plan.stages
    assert stages["rollout[self.round1]:0"].inputs == ("source", "bc")
    assert stages["train:bc-self.round1"].inputs == ("source", "rollout[self.round1]")
    assert stages["rollout[self]:0"].inputs == ("source", "bc", "train:bc-self.round1")
    assert stages["train:bc-self"].inputs == ("source", "rollout[self]")
    assert plan.index["recipes"]["self"].get("policy_models") == {"0": "train:bc-self.round1"}
    # The clone's 20,000 steps, the retrained clone's 10,000 and the arm's own 10,000.
    (run,) = [r for r in plan.index["runs"] if r["recipe"] == "self"]
    assert run["steps"] == 40_000
    assert ("bc", "baseline[40000]") in {(r["learner"], r["recipe"]) for r in plan.index["runs"]}


def test_init_policy_continues_the_learner_that_rolled_out_from_that_policy(
    tmp_path: Path,
) -> None:
    """The BC arm continues from the clone whose rollouts it trains on (each round from the
    previous round's policy); the other learners start from scratch; steps count once."""
    workflow = _workflow(
        train={"algorithms": ["bc", "cql"], "fuse_seeds": False},
        recipes={
            "self": {
                "rollout": {"policy": "bc", "filter": "policy", "rounds": 2},
                "train": {"init": "policy"},
            }
        },
        diagnostics={"enabled": False},
    )
    plan = _plan(workflow, tmp_path)
    stages = plan.stages
    assert stages["train:bc-self.round1"].inputs == ("source", "rollout[self.round1]", "bc")
    assert stages["train:bc-self"].inputs == ("source", "rollout[self]", "train:bc-self.round1")
    assert stages["train:cql-self"].inputs == ("source", "rollout[self]")
    runs = {(r["learner"], r["recipe"]): r for r in plan.index["runs"]}
    # The clone's 20,000, round 1's 10,000 and the arm's own 10,000: each counted once.
    assert runs["bc", "self"]["steps"] == 40_000
    assert runs["cql", "self"]["steps"] == 40_000
    with pytest.raises(ValueError, match=r"init 'policy' continues the learner that rolls out"):
        _workflow(
            train={"algorithms": ["cql"]},
            recipes={"r": {"rollout": {"policy": "iql"}, "train": {"init": "policy"}}},
        )


def test_rounds_learner_bc_learns_from_a_learners_rollouts_then_improves_on_itself(
    tmp_path: Path,
) -> None:
    """policy iql, rounds_learner bc, rounds 3, init policy: IQL's plain run rolls out in round
    1; round 2's BC starts from scratch on its episodes (no IQL weights fit BC), round 3's BC
    continues from round 2's, and the BC arm from round 3's; every model of the chain counts."""
    recipe = {
        "rollout": {"policy": "iql", "filter": "policy", "rounds": 3, "rounds_learner": "bc"},
        "train": {"init": "policy", "weighting": "none"},
    }
    workflow = _workflow(
        train={"algorithms": ["bc", "iql"], "fuse_seeds": False},
        recipes={"chain": recipe},
        diagnostics={"enabled": False},
    )
    plan = _plan(workflow, tmp_path)
    stages = plan.stages
    assert stages["rollout[chain.round1]:0"].inputs == ("source", "bc", "train:iql-plain")
    assert stages["train:bc-chain.round1"].inputs == ("source", "rollout[chain.round1]")
    assert stages["train:bc-chain.round2"].inputs == (
        "source",
        "rollout[chain.round2]",
        "train:bc-chain.round1",
    )
    assert stages["rollout[chain]:0"].inputs == ("source", "bc", "train:bc-chain.round2")
    assert stages["train:bc-chain"].inputs == ("source", "rollout[chain]", "train:bc-chain.round2")
    assert stages["train:iql-chain"].inputs == ("source", "rollout[chain]")  # from scratch
    runs = {(r["learner"], r["recipe"]): r for r in plan.index["runs"]}
    # IQL's plain 10,000, BC's two rounds of 10,000 and the arm's own 10,000 (the clone, whose
    # density unweighted training never reads, not counted).
    assert runs["bc", "chain"]["steps"] == 40_000
    with pytest.raises(ValueError, match=r"rounds_learner .* needs rounds > 1"):
        _workflow(recipes={"r": {"rollout": {"policy": "iql", "rounds_learner": "bc"}}})
    with pytest.raises(ValueError, match=r"the last round's learner \(bc\)"):
        _workflow(
            train={"algorithms": ["iql"]},
            recipes={"r": recipe},
        )


def test_model_recipes_that_differ_only_in_the_penalty_share_one_ensemble(
    tmp_path: Path,
) -> None:
    """The dynamics stage is keyed by what training reads (members, hidden, steps, seed): MOPO
    and MOBILE recipes train one ensemble per seed; other sizes train their own."""
    model = {"backend": "model", "policy": "iql"}
    workflow = _workflow(
        train={"algorithms": ["iql"], "fuse_seeds": False},
        recipes={
            "mopo": {"rollout": model},
            "mobile": {"rollout": {**model, "dynamics": {"penalty": "mobile", "horizon": 3}}},
            "small": {"rollout": {**model, "dynamics": {"steps": 100}}},
        },
        diagnostics={"enabled": False},
    )
    stages = _plan(workflow, tmp_path).stages
    assert stages["rollout[mopo]:0"].inputs == stages["rollout[mobile]:0"].inputs
    assert "dynamics[mopo]" in stages["rollout[mobile]:0"].inputs
    assert "dynamics[small]" in stages["rollout[small]:0"].inputs
    assert [name for name in stages if name.startswith("dynamics")] == [
        "dynamics[mopo]",
        "dynamics[small]",
    ]


def test_noise_calibration_is_one_stage_before_every_rollout_task(tmp_path: Path) -> None:
    workflow = _workflow(
        rollout={
            "episodes": 4,
            "tasks": 2,
            "filter": "data",
            "noise_calibration": {"scales": [0.01, 0.1], "episodes": 4},
        },
        train={"algorithms": ["cql"]},
        diagnostics={"enabled": False},
    )
    plan = _plan(workflow, tmp_path)
    stages = plan.stages
    assert stages["calibrate"].inputs == ("source", "bc")
    for index in range(2):
        task = stages[f"rollout:{index}"]
        assert task.inputs == ("source", "bc", "calibrate")
        assert task.args[-2:] == (None, Ref("calibrate"))  # no learner; the calibration
    assert stages["rollout"].inputs == ("rollout:0", "rollout:1", "calibrate")
    assert stages["rollout"].args[-1] == Ref("calibrate")
    assert workflow.rollout.noise_calibration is not None
    assert workflow.rollout.noise_calibration.scales == (0.1, 0.01)  # largest first
    with pytest.raises(ValueError, match="noise_calibration needs filter 'data'"):
        _workflow(rollout={"noise_calibration": {"scales": [0.1]}})
    with pytest.raises(ValueError, match="must all be positive"):
        _workflow(rollout={"filter": "data", "noise_calibration": {"scales": [0.1, 0]}})


def _runs(plan: Plan) -> dict[tuple[str, str, int], Any]:
    return {(r["learner"], r["recipe"], r["seed"]): r for r in plan.index["runs"]}


def test_the_equal_steps_plain_arm_trains_for_a_bc_rolled_out_arms_total(tmp_path: Path) -> None:
    """An arm on BC's rollouts spent BC's steps and its own; every plain learner is planned
    again for that many steps (a plain run, with the workflow's plain train section)."""
    workflow = _workflow(
        seeds=[0, 1],
        bc={"steps": 3000},
        train={"algorithms": ["cql", "bcq"], "steps": 500, "fuse_seeds": False},
        recipes={"augmented": {}, "longer": {"train": {"steps": 700}}},
        diagnostics={"enabled": False},
    )
    plan = _plan(workflow, tmp_path)
    runs = _runs(plan)
    augmented = runs["bcq", "augmented", 1]
    assert (augmented["steps"], augmented["own_steps"]) == (3000 + 500, 500)
    assert augmented["rollouts"] == ["rollout@s1"]
    assert runs["cql", "longer", 0]["steps"] == 3000 + 700
    for learner in ("cql", "bcq"):
        for seed in (0, 1):
            assert runs[learner, "plain", seed]["steps"] == 500
            for total in (3500, 3700):
                plain = runs[learner, f"baseline[{total}]", seed]
                assert plain["steps"] == plain["own_steps"] == total
                spec = plan.stages[plain["stage"]]
                assert spec.inputs == ("source",)  # the original data alone
                assert spec.args[3] == workflow.plain_train.model_copy(update={"steps": total})
    assert runs["cql", "baseline[3500]", 1]["stage"] == "train:cql-baseline[3500]@s1"
    off = _plan(_workflow(train={"algorithms": ["cql"], "baseline": False}), tmp_path)
    assert not any("baseline[" in name for name in off.names)


def test_a_learner_rolled_out_for_policy_steps_counts_them(tmp_path: Path) -> None:
    """rollout.policy_steps trains the rolling-out learner for its own budget (a plain run of
    that many steps); the arm's total counts it (and BC, whose density weighs the rows), and
    train.init plain adds the plain run the arm continues from, counted once."""
    workflow = _workflow(
        bc={"steps": 3000},
        train={"algorithms": ["cql"], "steps": 500},
        rollout={"episodes": 4, "tasks": 2, "policy": "td3bc", "policy_steps": 2000},
        recipes={"scratch": {}, "continued": {"train": {"init": "plain"}}},
        diagnostics={"enabled": False},
    )
    plan = _plan(workflow, tmp_path)
    runs = _runs(plan)
    policy = runs["td3bc", "baseline[2000]", 0]
    assert plan.stages["rollout[scratch]:0"].inputs == ("source", "bc", policy["stage"])
    assert plan.stages[policy["stage"]].args[3].steps == 2000
    assert plan.index["recipes"]["scratch"]["policy_models"] == {"0": policy["stage"]}
    assert runs["cql", "scratch", 0]["steps"] == 3000 + 2000 + 500
    continued = runs["cql", "continued", 0]
    assert plan.stages[continued["stage"]].inputs == (
        "source",
        "rollout[scratch]",
        "train:cql-plain",
    )
    assert plan.stages[continued["stage"]].args[-1] == Ref("train:cql-plain")
    assert continued["steps"] == 3000 + 2000 + 500 + 500
    assert runs["cql", "baseline[5500]", 0]["steps"] == 5500
    assert runs["cql", "baseline[6000]", 0]["steps"] == 6000
    # The plain run keeps train.init at scratch; a BC rollout has no policy_steps.
    assert plan.stages["train:cql-plain"].args[3].init == "scratch"
    with pytest.raises(ValueError, match="policy_steps is the budget of a learner"):
        _workflow(rollout={"policy_steps": 100})


def test_simulator_steps_is_the_simulator_backends_budget(tmp_path: Path) -> None:
    workflow = _workflow(rollout={"simulator_steps": 3000, "tasks": 3})
    plan = _plan(workflow, tmp_path)
    assert plan.stages["rollout:2"].args[2].simulator_steps == 3000  # split by the task
    with pytest.raises(ValueError, match="simulator_steps is the simulator backend's budget"):
        _workflow(rollout={"simulator_steps": 3000, "backend": "model"})
    with pytest.raises(ValueError, match=r"tasks \(4\) must not exceed simulator_steps \(2\)"):
        _workflow(rollout={"simulator_steps": 2, "tasks": 4})


def test_a_learners_unweighted_rollouts_leave_the_bc_clones_steps_out(tmp_path: Path) -> None:
    """BC counts where its clone shapes the data (it rolls out, or its density weights the
    rows); a learner's unweighted rollouts carry it only for the diagnostics."""
    workflow = _workflow(
        bc={"steps": 3000},
        rollout={"policy": "td3bc"},
        train={"algorithms": ["td3bc"], "steps": 500, "fuse_seeds": False},
        recipes={
            "unweighted": {"train": {"weighting": "none"}},
            "weighted": {"train": {"weighting": "behaviour"}},
        },
        diagnostics={"enabled": False},
    )
    runs = _runs(_plan(workflow, tmp_path))
    assert runs["td3bc", "unweighted", 0]["steps"] == 500 + 500
    assert runs["td3bc", "weighted", 0]["steps"] == 3000 + 500 + 500
    assert {r for (_, r, _) in runs if r.startswith("baseline[")} == {
        "baseline[1000]",
        "baseline[4000]",
    }


def test_media_doctor_and_report_are_planned_after_what_they_read(tmp_path: Path) -> None:
    """The planner plans every stage, the report's too: videos of the primary seed's policies and
    of its first augmented set, the doctor on that set, and the report on every other stage."""
    plan = _plan(_workflow(seeds=[0, 1], report={"videos": True}), tmp_path)
    # The equal-steps plain arms are planned last, and filmed too.
    assert plan.names[-7:] == [
        "video:bcq-augmented",
        "video:cql-baseline[30000]",
        "video:bcq-baseline[30000]",
        "video:data",
        "video:best",
        "doctor",
        "report",
    ]
    # Every seed's runs choose the best arm; the primary seed's run of it is filmed.
    best = plan.stages["video:best"]
    assert len(best.inputs) == 1 + 2 * 6 and best.args[-1] == 0
    off = _plan(_workflow(report={"best_video": False}), tmp_path / "off")
    assert "video:best" not in off.names
    assert plan.stages["video:cql-plain"].inputs == ("source", "train:cql-plain")
    assert "video:cql-plain@s1" not in plan.names
    assert plan.stages["video:data"].inputs == ("source", "rollout")
    assert plan.stages["doctor"].inputs == ("source", "rollout")
    assert plan.stages["report"].inputs == tuple(plan.names[:-1])
    assert tmp_path / "run" / "videos" in plan.stages["video:data"].args


def test_a_stage_s_inputs_are_the_stages_its_arguments_name() -> None:
    plan = Plan()
    plan.add(StageSpec("a", print, {}, ()))
    plan.add(StageSpec("b", print, {"b": 1}, ()))
    both = StageSpec("both", print, {}, (Ref("b"), 1, RefList(("a", "b"))))
    assert both.inputs == ("b", "a")
    plan.add(both)
    # Equal function, config and inputs: the same stage, under the first name; other inputs (or
    # the same in another order) make another stage.
    assert plan.add(StageSpec("twice", print, {}, (Ref("b"), RefList(("a",))))) == "both"
    assert plan.add(StageSpec("swapped", print, {}, (RefList(("a", "b")),))) == "swapped"
    with pytest.raises(KeyError, match="not planned before it"):
        plan.add(StageSpec("early", print, {}, (Ref("later"),)))
