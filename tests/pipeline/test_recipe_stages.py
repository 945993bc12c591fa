"""The BC and rollout stages with the recipe options, and their workflow fields."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from offaug.datasets import load_transitions
from offaug.datasets.shards import read_shard
from offaug.pipeline.contracts import ModelRef
from offaug.pipeline.rundir.keys import from_json, to_json
from offaug.pipeline.schema.rollout_section import RolloutModel
from offaug.pipeline.schema.run_sections import EvaluationModel
from offaug.pipeline.schema.sections import BCConfigModel, SourceConfig, TrainModel
from offaug.pipeline.stages import learning as stages
from offaug.pipeline.stages import rollouts as rollout_stages


def test_rollout_fields_validate() -> None:
    assert RolloutModel().policy == "bc" and RolloutModel().backend == "simulator"
    assert RolloutModel(backend="none").backend == "none"
    assert RolloutModel(policy="bcq", horizon=10, starts="sparse", filter="data").horizon == 10
    with pytest.raises(ValidationError, match="policy"):
        RolloutModel(policy="nope")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="disagreement"):
        RolloutModel(starts="disagreement")
    assert RolloutModel(backend="model", starts="disagreement").starts == "disagreement"
    with pytest.raises(ValidationError, match="horizon"):
        RolloutModel(horizon=0)
    assert BCConfigModel().evaluation_episodes > 0


def test_the_source_stage_sees_classic_control_states(make_test_dataset) -> None:
    made = make_test_dataset("pendulum", "hdf5")
    assert stages.prepare_source(SourceConfig(dataset=made.dataset_id)).has_simulator_state
    point = make_test_dataset("point", "hdf5")
    assert not stages.prepare_source(SourceConfig(dataset=point.dataset_id)).has_simulator_state


@pytest.fixture(scope="module")
def pendulum_bc(make_test_dataset, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    made = make_test_dataset("pendulum", "hdf5")
    data = stages.prepare_source(SourceConfig(dataset=made.dataset_id))
    out = tmp_path_factory.mktemp("stages") / "bc"
    bc = stages.train_bc(
        data, BCConfigModel(steps=40, hidden=(32, 32), evaluation_episodes=2), str(out), 0
    )
    return data, bc


def test_bc_reports_its_own_score_and_the_datas(pendulum_bc) -> None:
    data, bc = pendulum_bc
    evaluation = bc.metrics["eval"]
    assert len(evaluation["returns"]) == 2 and np.isfinite(evaluation["return"])
    transitions = load_transitions(data.source)
    returns = transitions.episode_returns()
    assert bc.metrics["data"]["return"] == pytest.approx(float(returns.mean()))
    assert bc.metrics["data"]["episodes"] == data.episodes
    assert "normalised_score" in bc.metrics["data"]


def test_the_rollout_stage_takes_a_learner_and_reports_the_filter(
    pendulum_bc, tmp_path: Path
) -> None:
    data, bc = pendulum_bc
    config = RolloutModel(
        episodes=4, tasks=2, n_envs=2, start="dataset", horizon=5, filter="data", starts="sparse"
    )
    learner = ModelRef("bc-original", bc.path, bc.checksum, {})
    out = str(tmp_path / "aug")
    tasks = rollout_stages.rollout_tasks(data, bc, config, out, 3, policy_model=learner)
    assert all(t.learner == bc.path and t.config.starts == "sparse" for t in tasks)
    shards = [rollout_stages.rollout_shard(data, bc, config, out, 3, i, learner) for i in range(2)]
    augmented = rollout_stages.merge_rollouts(shards, out, config)
    counts = augmented.metrics["filter"]
    assert counts["kept"] + counts["dropped"] == 4 and counts["kept"] == augmented.episodes
    assert augmented.metrics["policy"] == "bc"


def test_model_rollouts_start_where_the_ensemble_disagrees(
    make_test_dataset, tmp_path: Path
) -> None:
    from offaug.pipeline.models.dynamics import DynamicsConfig, save_dynamics, train_dynamics

    made = make_test_dataset("hopper", "hdf5")
    data = stages.prepare_source(SourceConfig(dataset=made.dataset_id))
    bc = stages.train_bc(
        data,
        BCConfigModel(steps=30, hidden=(32, 32), evaluation_episodes=0),
        str(tmp_path / "bc"),
        0,
    )
    model, _ = train_dynamics(
        load_transitions(made.dataset_id), DynamicsConfig(members=3, hidden=(32,), steps=50)
    )
    dynamics = ModelRef("dynamics", str(save_dynamics(model, tmp_path / "dyn.pt")), "", {})
    config = RolloutModel(
        backend="model", starts="disagreement", filter="data", filter_margin=100.0, horizon=3
    )
    shard = rollout_stages.model_rollout_task(
        data, bc, dynamics, config, str(tmp_path / "aug" / "shard-00000.arrow"), 0, 0
    )
    lengths = np.diff(read_shard(shard.shard.path).episode_bounds())
    assert lengths.max() <= 3
    # A lenient margin keeps every rollout that has a step.
    assert shard.episodes_dropped == 0 and len(shard.episode_returns) == len(lengths)


def test_noise_calibration_keeps_the_largest_noise_the_filter_lets_through(
    pendulum_bc, tmp_path: Path
) -> None:
    data, bc = pendulum_bc
    out = tmp_path / "aug"
    # Short branches from dataset states, so a probe of 8 episodes is quick; keep 1.0 asks for
    # every probe episode to pass, which the largest noise (3.0, the box's width and more)
    # cannot give a clone of 40 steps.
    config = RolloutModel(
        episodes=4,
        tasks=2,
        n_envs=4,
        start="dataset",
        horizon=5,
        filter="data",
        noise_calibration={"scales": [3.0, 0.3, 0.03], "episodes": 8, "keep": 1.0},  # type: ignore[arg-type]
    )
    calibration = rollout_stages.calibrate_noise_stage(data, bc, config, str(out), 3)
    trials = list(calibration.trials)
    assert [t["noise"] for t in trials] == ["gaussian:3", "gaussian:0.3", "gaussian:0.03"][
        : len(trials)
    ]
    assert trials[0]["kept"] < 8
    # It stops at the first noise every probe passed, else tries them all and takes the last.
    passed = [t["kept"] == 8 for t in trials]
    assert passed[:-1] == [False] * (len(trials) - 1)
    assert passed[-1] or len(trials) == 3
    assert calibration.noise.text == trials[-1]["noise"]
    # A stage result: it survives stages.json's codec as it is.
    assert from_json(json.loads(json.dumps(to_json(calibration)))) == calibration
    assert not list(tmp_path.glob(".calibrate-*"))  # the probes leave nothing behind
    # Asking for no more kept episodes than the first noise kept stops there: the same probe.
    assert config.noise_calibration is not None and trials[0]["kept"] > 0
    keep = trials[0]["kept"] / 8
    lenient = config.model_copy(
        update={"noise_calibration": config.noise_calibration.model_copy(update={"keep": keep})}
    )
    first = rollout_stages.calibrate_noise_stage(data, bc, lenient, str(out), 3)
    assert list(first.trials) == trials[:1] and first.noise.text == "gaussian:3"
    # Every task rolls out with the chosen noise, and the manifest says which and why.
    tasks = rollout_stages.rollout_tasks(data, bc, config, str(out), 3, calibration=calibration)
    assert {t.config.noise for t in tasks} == {calibration.noise}
    shards = [
        rollout_stages.rollout_shard(data, bc, config, str(out), 3, i, None, calibration)
        for i in (0, 1)
    ]
    augmented = rollout_stages.merge_rollouts(shards, str(out), config, calibration)
    assert augmented.metrics["noise"] == calibration.noise.text
    assert augmented.metrics["noise_calibration"] == calibration.to_json()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["params"]["noise"] == calibration.noise.text
    assert manifest["params"]["noise_calibration"]["trials"] == trials


def test_mobile_model_rollouts_take_v_from_the_rollout_learner(
    make_test_dataset, tmp_path: Path
) -> None:
    from offaug.pipeline.models.dynamics import DynamicsConfig, save_dynamics, train_dynamics
    from offaug.pipeline.rollouts.policies import load_rollout_policy

    made = make_test_dataset("hopper", "hdf5")
    data = stages.prepare_source(SourceConfig(dataset=made.dataset_id))
    small = BCConfigModel(steps=30, hidden=(32, 32), evaluation_episodes=0)
    bc = stages.train_bc(data, small, str(tmp_path / "bc"), 0)
    train = TrainModel(
        algorithms=("td3bc",), steps=20, configs={"td3bc": {"hidden": [32, 32], "batch_size": 32}}
    )
    learner = stages.train_offline(
        "td3bc", data, None, train, EvaluationModel(episodes=1), str(tmp_path / "td3bc"), 0
    )
    config = RolloutModel(
        backend="model", policy="td3bc", horizon=2, dynamics={"penalty": "mobile", "starts": 20}
    )
    model, _ = train_dynamics(
        load_transitions(made.dataset_id),
        DynamicsConfig(members=3, hidden=(32,), steps=50, penalty="mobile", mobile_samples=2),
    )
    dynamics = ModelRef("dynamics", str(save_dynamics(model, tmp_path / "dyn.pt")), "", {})
    shard = rollout_stages.model_rollout_task(
        data, bc, dynamics, config, str(tmp_path / "aug" / "shard-00000.arrow"), 0, 0, learner
    )
    out = read_shard(shard.shard.path)
    assert out.meta["penalty"] == "mobile" and len(out) > 0
    np.testing.assert_allclose(
        out.rewards,
        out.extras["raw_reward"] - out.extras["model_uncertainty"],
        rtol=1e-5,
        atol=1e-5,
    )
    # V(s) is TD3+BC's min over its critics at its own action, with its discount.
    policy = load_rollout_policy(bc.path, learner.path)
    value = policy.discounted_value()
    states = np.asarray(out.observations[:4])
    expected = policy.learner.q_values(states, policy.learner.act(states))
    np.testing.assert_allclose(value.value(states), expected, rtol=1e-5, atol=1e-5)
    assert value.gamma == policy.learner.config.gamma
    # Without a learner the stage refuses, as the schema does.
    with pytest.raises(ValueError, match="needs a learner"):
        rollout_stages.model_rollout_task(
            data, bc, dynamics, config, str(tmp_path / "x" / "shard-00000.arrow"), 0, 0
        )
