"""Rollout backend 'diffusion' (SynthER): the denoiser, its generated rows, its stages and plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from offaug.datasets import load_transitions
from offaug.datasets.shards import ShardSet
from offaug.datasets.transitions import Source
from offaug.pipeline.contracts import AugmentedRef, DatasetRef, ModelRef
from offaug.pipeline.engine.plan import plan_workflow
from offaug.pipeline.models.diffusion import (
    Diffusion,
    DiffusionConfig,
    TransitionLayout,
    generate,
    load_diffusion,
    save_diffusion,
    train_diffusion,
)
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.rollout_section import RolloutModel
from offaug.pipeline.schema.run_sections import EvaluationModel
from offaug.pipeline.schema.sections import TrainModel
from offaug.pipeline.schema.workflow import Workflow
from offaug.pipeline.stages import rollouts as rollout_stages
from offaug.pipeline.stages.learning import train_offline

TINY = {"width": 32, "blocks": 1, "steps": 60, "batch_size": 64, "sampler_steps": 8}
"""A denoiser that trains in a second: for the stages' plumbing, not for its samples."""


def test_the_denoiser_learns_a_correlated_gaussian() -> None:
    rng = np.random.default_rng(0)
    mean = np.array([1.0, -0.5])
    covariance = np.array([[1.0, 0.6], [0.6, 0.5]])
    data = rng.multivariate_normal(mean, covariance, size=4000).astype(np.float32)
    config = DiffusionConfig(
        width=64, blocks=2, time_dim=64, steps=1500, learning_rate=1e-3, sampler_steps=24
    )
    model = Diffusion(2, config)
    model.fit(data)
    samples = model.sample(4000, seed=1)
    assert np.isfinite(samples).all()
    np.testing.assert_allclose(samples.mean(0), mean, atol=0.1)
    np.testing.assert_allclose(np.cov(samples.T), covariance, atol=0.15)


@pytest.fixture(scope="module")
def hopper(make_test_dataset) -> tuple[str, Any]:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    data = load_transitions(dataset)
    return dataset, data


def test_generated_rows_are_one_step_episodes_inside_the_action_box(hopper, tmp_path: Path) -> None:
    _, data = hopper
    model, metrics = train_diffusion(data, DiffusionConfig(**TINY))
    assert np.isfinite(metrics["train_loss"]) and metrics["train_seconds"] > 0
    out = generate(model, 300, seed=5, meta=data.meta)
    assert len(out) == out.num_episodes == 300
    assert out.observations.shape == (300, data.observations.shape[1])
    assert out.actions.shape == (300, data.actions.shape[1])
    low, high = np.asarray(model.spaces.action_low), np.asarray(model.spaces.action_high)
    assert (out.actions >= low).all() and (out.actions <= high).all()
    # Every row ends its episode: terminal as sampled, else truncated.
    assert out.terminals.dtype == np.bool_ and (out.timeouts == ~out.terminals).all()
    assert set(out.source.tolist()) == {int(Source.GENERATED)}
    assert (out.importance_weight == 1).all()
    assert out.rollout_log_prob is None and out.behaviour_log_prob is None
    assert out.meta["action_space"] == data.meta["action_space"]
    # The checkpoint gives back the same model: the same seed samples the same rows.
    loaded = load_diffusion(save_diffusion(model, tmp_path / "denoiser.pt"))
    again = generate(loaded, 300, seed=5, meta=data.meta)
    np.testing.assert_allclose(again.observations, out.observations, rtol=1e-5, atol=1e-5)
    assert (again.terminals == out.terminals).all()


def test_next_state_delta_models_the_change_and_gives_back_the_state(
    hopper, tmp_path: Path
) -> None:
    """``next_state: delta``: the s' block of a vector is s' - s, standardised on its own; the
    data's own vectors split back to its transitions, and a saved model keeps the layout."""
    _, data = hopper
    absolute = TransitionLayout.of(data)
    delta = TransitionLayout.of(data, delta=True)
    o, a = delta.observation_dim, delta.action_dim
    vectors = delta.standardise(data)
    change = data.next_observations - data.observations
    np.testing.assert_allclose(vectors[:, o + a + 1 : -1].std(0), 1.0, atol=1e-3)
    # The change spreads less than the state itself: its unit is the smaller one.
    assert (delta.std[o + a + 1 : -1] < absolute.std[o + a + 1 : -1]).mean() > 0.5
    spread = np.where(change.std(0) > 1e-6, change.std(0), 1.0)
    np.testing.assert_allclose(delta.std[o + a + 1 : -1], spread, rtol=1e-3)
    observations, actions, rewards, next_observations, _ = delta.split(vectors)
    np.testing.assert_allclose(observations, data.observations, atol=1e-4)
    np.testing.assert_allclose(actions, data.actions, atol=1e-4)
    np.testing.assert_allclose(rewards, data.rewards, atol=1e-4)
    np.testing.assert_allclose(next_observations, data.next_observations, atol=1e-3)
    model, _ = train_diffusion(data, DiffusionConfig(**TINY, next_state="delta"))
    assert model.layout.delta
    loaded = load_diffusion(save_diffusion(model, tmp_path / "denoiser.pt"))
    assert loaded.layout.delta
    out, again = generate(model, 50, seed=2), generate(loaded, 50, seed=2)
    np.testing.assert_allclose(again.next_observations, out.next_observations, atol=1e-5)
    with pytest.raises(ValidationError, match="next_state"):
        RolloutModel(backend="diffusion", diffusion={"next_state": "relative"})


def test_terminals_are_the_sampled_coordinate_thresholded(hopper) -> None:
    _, data = hopper
    model, _ = train_diffusion(data, DiffusionConfig(**TINY))
    vectors = model.diffusion.sample(200, seed=3)
    terminal = vectors[:, -1] * model.layout.std[-1] + model.layout.mean[-1]
    out = generate(model, 200, seed=3)
    assert (out.terminals == (terminal >= 0.5)).all()


def _source(dataset: str, data: Any) -> DatasetRef:
    return DatasetRef(dataset, len(data), data.num_episodes, "", False, dict(data.meta))


@pytest.fixture(scope="module")
def generated(hopper, tmp_path_factory: pytest.TempPathFactory) -> tuple[DatasetRef, AugmentedRef]:
    """The diffusion backend's stages, called as the graph calls them: 3 tasks of 700 rows."""
    dataset, data = hopper
    tmp = tmp_path_factory.mktemp("diffusion")
    source = _source(dataset, data)
    config = RolloutModel(backend="diffusion", tasks=3, diffusion={**TINY, "samples": 700})
    denoiser = rollout_stages.train_denoiser_stage(source, config, str(tmp / "denoiser.pt"), 0)
    out = tmp / "augmented"
    shards = [
        rollout_stages.diffusion_sample_task(
            source, denoiser, config, str(out / f"shard-{i:05d}.arrow"), i, 0
        )
        for i in range(config.tasks)
    ]
    return source, rollout_stages.merge_rollouts(shards, str(out), config)


def test_the_stages_write_a_shard_set_with_their_costs(hopper, generated) -> None:
    _, augmented = generated
    assert augmented.rows == 700 and augmented.shards == 3
    loaded = load_transitions(augmented.directory)
    assert len(loaded) == 700 and set(loaded.source.tolist()) == {int(Source.GENERATED)}
    assert augmented.weight_stats["n"] == 700 and augmented.weight_stats["ess_fraction"] == 1.0
    assert augmented.weight_stats["clipped_fraction"] == 0.0
    costs = augmented.metrics["diffusion"]
    assert costs["samples"] == 700 and costs["sample_seconds"] > 0
    assert costs["sample_seconds_per_100k_samples"] == pytest.approx(
        costs["sample_seconds"] * 100_000 / 700
    )
    params = ShardSet.open(augmented.directory).params
    assert params["backend"] == "diffusion" and params["diffusion"]["samples"] == 700


def test_the_denoiser_stage_records_its_cost_per_100k_samples(hopper, tmp_path: Path) -> None:
    dataset, data = hopper
    config = RolloutModel(backend="diffusion", diffusion={**TINY, "samples": 50_000})
    ref = rollout_stages.train_denoiser_stage(
        _source(dataset, data), config, str(tmp_path / "d.pt"), 0
    )
    assert isinstance(ref, ModelRef) and Path(ref.path).is_file()
    assert ref.metrics["train_seconds_per_100k_samples"] == pytest.approx(
        2 * ref.metrics["train_seconds"]
    )


LEARNERS: dict[str, dict[str, Any]] = {
    "bc": {"hidden": (32, 32), "batch_size": 32},
    "cql": {"hidden": (32, 32), "batch_size": 32, "n_action_samples": 2},
    "iql": {"hidden": (32, 32), "batch_size": 32},
    "td3bc": {"hidden": (32, 32), "batch_size": 32},
    "rebrac": {"hidden": (32, 32), "batch_size": 32},
    "bcq": {
        "actor_hidden": (32, 32),
        "critic_hidden": (32, 32),
        "vae_hidden": (32, 32),
        "batch_size": 32,
    },
}


@pytest.mark.parametrize("algorithm", sorted(LEARNERS))
def test_every_learner_trains_on_generated_rows(algorithm: str, generated, tmp_path: Path) -> None:
    source, augmented = generated
    train = TrainModel(algorithms=(algorithm,), steps=10, configs={algorithm: LEARNERS[algorithm]})
    model = train_offline(
        algorithm, source, augmented, train, EvaluationModel(episodes=1), str(tmp_path), 0
    )
    assert Path(model.path).is_file()
    assert np.isfinite(model.metrics["eval"]["return"])


def test_policy_weighting_gives_generated_rows_weight_one(generated, tmp_path: Path) -> None:
    """A set without rollout_log_prob weighs 1 under pi/mu weights, as the original data does."""
    source, augmented = generated
    train = TrainModel(
        algorithms=("iql",), steps=10, configs={"iql": LEARNERS["iql"]}, weighting="policy"
    )
    model = train_offline(
        "iql", source, augmented, train, EvaluationModel(episodes=1), str(tmp_path), 0
    )
    assert Path(model.path).is_file()


def test_the_diffusion_section_is_validated() -> None:
    config = RolloutModel.model_validate(
        {"backend": "diffusion", "diffusion": {"width": 2048, "blocks": 6, "steps": 100_000}}
    )
    assert (config.diffusion.width, config.diffusion.blocks) == (2048, 6)
    assert config.diffusion.seed is None and config.diffusion.samples == 100_000
    for bad in ({"width": 0}, {"sampler_steps": 0}, {"learning_rate": -1.0}, {"widht": 3}):
        with pytest.raises(ValidationError):
            RolloutModel.model_validate({"backend": "diffusion", "diffusion": bad})
    with pytest.raises(ValidationError, match=r"tasks \(4\) must not exceed diffusion.samples"):
        RolloutModel.model_validate({"backend": "diffusion", "diffusion": {"samples": 3}})


def test_a_workflow_file_with_the_diffusion_section_validates(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from offaug.cli import app

    path = tmp_path / "synther.yaml"
    path.write_text(
        "name: synther\nsource: {dataset: a/b-v0}\nrollout:\n  backend: diffusion\n"
        "  diffusion: {width: 2048, blocks: 6, steps: 100000, batch_size: 1024,"
        " sampler_steps: 128, samples: 1000000, seed: 3}\n"
    )
    assert CliRunner().invoke(app, ["validate", str(path)]).exit_code == 0
    path.write_text(path.read_text().replace("blocks: 6", "blocks: 0"))
    refused = CliRunner().invoke(app, ["validate", str(path)])
    assert refused.exit_code == 2 and "rollout.diffusion.blocks" in refused.output


def _workflow(**sections: Any) -> Workflow:
    data: dict[str, Any] = {
        "name": "diffusion-test",
        "source": {"dataset": "plan/none-v0"},
        "rollout": {"backend": "diffusion", "tasks": 2, "diffusion": {"samples": 1000}},
        "train": {"algorithms": ["td3bc"]},
        "diagnostics": {"enabled": False},
        **sections,
    }
    return Workflow.model_validate(data)


def test_the_plan_trains_a_denoiser_samples_in_tasks_and_merges(tmp_path: Path) -> None:
    plan = plan_workflow(_workflow(), RunLayout(tmp_path / "run"), 1)
    # No BC: nothing rolls a policy out, and diagnostics (which read one) are off.
    assert plan.names == [
        "source",
        "train:td3bc-plain",
        "denoiser",
        "rollout:0",
        "rollout:1",
        "rollout",
        "train:td3bc-augmented",
        # td3bc on the original data for the denoiser's 30,000 steps and the arm's 10,000.
        "train:td3bc-baseline[40000]",
        "video:best",
        "doctor",
        "report",
    ]
    assert plan.stages["denoiser"].function is rollout_stages.train_denoiser_stage
    assert plan.stages["denoiser"].args[2] == str(tmp_path / "run" / "models" / "denoiser.pt")
    assert plan.stages["rollout:1"].function is rollout_stages.diffusion_sample_task
    assert plan.stages["rollout:1"].inputs == ("source", "denoiser")
    assert plan.stages["rollout"].function is rollout_stages.merge_rollouts
    assert plan.stages["train:td3bc-augmented"].inputs == ("source", "rollout")
    assert plan.index["recipes"]["augmented"]["policy"] == "none"


def test_a_recipe_of_the_diffusion_backend_beside_the_simulator(tmp_path: Path) -> None:
    """A study that compares backends: the diffusion recipe inherits the simulator's rollout
    settings (which do not apply to it) and gets its own denoiser; only the simulator's
    rollout needs the BC clone."""
    workflow = _workflow(
        rollout={"episodes": 4, "tasks": 2, "start": "dataset", "noise": "gaussian:0.1"},
        recipes={
            "simulated": {},
            "generated": {"rollout": {"backend": "diffusion", "diffusion": {"samples": 100}}},
        },
    )
    plan = plan_workflow(workflow, RunLayout(tmp_path / "run"), 1)
    names = plan.names
    assert "denoiser[generated]" in names and "rollout[generated]" in names
    assert plan.stages["rollout[generated]:0"].inputs == ("source", "denoiser[generated]")
    assert [n for n in names if n.startswith("bc")] == ["bc"]
    assert plan.stages["rollout[simulated]:0"].inputs == ("source", "bc")


def test_a_tiny_run_on_dask_runs_the_planned_stages(make_test_dataset, tmp_path: Path) -> None:
    """Through the graph on real Dask, with diagnostics (their BC, checks and the report read
    the generated rows as they read rollouts)."""
    from distributed import Client

    from offaug.pipeline.engine.graph import run_workflow

    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    workflow = _workflow(
        source={"dataset": dataset},
        bc={"steps": 30, "hidden": [16, 16], "batch_size": 32, "evaluation_episodes": 1},
        rollout={"backend": "diffusion", "tasks": 2, "diffusion": {**TINY, "samples": 300}},
        train={"algorithms": ["bc"], "steps": 20, "configs": {"bc": LEARNERS["bc"]}},
        evaluation={"episodes": 1},
        diagnostics={"enabled": True, "max_states": 200, "k": 3},
    )
    run_dir = tmp_path / "run"
    with Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0") as c:
        run_workflow(workflow, run_dir, client=c)
    stages = json.loads((run_dir / "stages.json").read_text())["stages"]
    assert {"denoiser", "rollout:0", "rollout:1", "rollout", "train:bc-augmented"} <= set(stages)
    assert {"bc", "diagnose", "report"} <= set(stages)  # the BC is the diagnostics'
    assert stages["rollout:0"]["inputs"] == ["source", "denoiser"]
    assert stages["train:bc-augmented"]["inputs"] == ["source", "rollout"]
    assert ShardSet.open(run_dir / "shards" / "augmented").rows == 300
    metrics = json.loads((run_dir / "metrics.json").read_text())
    recipe = metrics["recipes"]["augmented"]
    assert recipe["policy"] == "none" and recipe["noise"] == []
    assert recipe["rollout_policy_score"] is None and recipe["augmented_rows"] == 300
    assert metrics["weights"]["ess_fraction"] == 1.0
