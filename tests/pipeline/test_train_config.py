"""The workflow's train section (weighting, state noise) and the train stage that applies it."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from offaug.algorithms import registry
from offaug.algorithms.names import LEARNERS, OFFLINE_LEARNERS, WEIGHTINGS
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.cli import app
from offaug.datasets.shards import file_checksum
from offaug.pipeline.contracts import AugmentedRef
from offaug.pipeline.rollouts.config import RolloutConfig
from offaug.pipeline.rollouts.noise import parse_noise
from offaug.pipeline.rollouts.tasks import rollout_to_shard_set
from offaug.pipeline.schema.run_sections import EvaluationModel
from offaug.pipeline.schema.sections import BCConfigModel, SourceConfig, TrainModel
from offaug.pipeline.schema.validation import WorkflowError
from offaug.pipeline.schema.workflow import load_workflow
from offaug.pipeline.stages import learning as stages


def _write(tmp_path: Path, train_section: dict[str, Any]) -> Path:
    path = tmp_path / "workflow.yaml"
    document = {"name": "w", "source": {"dataset": "a/b-v0"}, "train": train_section}
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_the_schema_the_registry_and_the_cli_read_one_list_of_names() -> None:
    assert set(registry.ALGORITHMS) == set(LEARNERS)
    train = TrainModel.model_fields
    assert typing.get_args(train["weighting"].annotation) == WEIGHTINGS
    assert typing.get_args(typing.get_args(train["algorithms"].annotation)[0]) == OFFLINE_LEARNERS
    help_text = CliRunner().invoke(app, ["train", "--help"], terminal_width=200).output
    assert all(name in help_text for name in (*LEARNERS, *WEIGHTINGS))


@pytest.mark.parametrize(
    ("value", "meaning"),
    [(True, "behaviour"), (False, "none"), ("none", "none"), ("policy", "policy")],
)
def test_weighting_takes_a_choice_or_the_old_booleans(
    value: object, meaning: str, tmp_path: Path
) -> None:
    section = {"algorithms": ["cql"], "weighting": value}
    assert load_workflow(_write(tmp_path, section)).train.weighting == meaning


def test_an_unknown_weighting_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(WorkflowError) as info:
        load_workflow(_write(tmp_path, {"weighting": "importance"}))
    message = str(info.value)
    assert "train.weighting" in message and "'behaviour'" in message and "'policy'" in message


def test_policy_weighting_is_refused_for_learners_without_a_density(tmp_path: Path) -> None:
    section = {"algorithms": ["cql", "bcq"], "weighting": "policy"}
    with pytest.raises(WorkflowError) as info:
        load_workflow(_write(tmp_path, section))
    message = str(info.value)
    assert "workflow.yaml:" in message and "train.weighting" in message
    assert "bcq's policy has no density" in message
    assert "cql's" not in message
    deterministic = {
        "algorithms": ["bc"],
        "weighting": "policy",
        "configs": {"bc": {"policy": "deterministic"}},
    }
    with pytest.raises(WorkflowError, match="bc's policy has no density with this config"):
        load_workflow(_write(tmp_path, deterministic))
    gaussian = {**deterministic, "configs": {"bc": {"policy": "gaussian"}}}
    assert load_workflow(_write(tmp_path, gaussian)).train.weighting == "policy"


def test_state_noise_is_a_kind_and_a_positive_scale(tmp_path: Path) -> None:
    section = {"state_noise": {"kind": "uniform", "scale": 0.01}}
    noise = load_workflow(_write(tmp_path, section)).train.state_noise
    assert noise is not None and (noise.kind, noise.scale) == ("uniform", 0.01)
    assert load_workflow(_write(tmp_path, {})).train.state_noise is None
    for bad, field in [
        ({"kind": "laplace", "scale": 0.1}, "train.state_noise.kind"),
        ({"kind": "gaussian", "scale": 0}, "train.state_noise.scale"),
        ({"kind": "gaussian"}, "train.state_noise.scale"),
    ]:
        with pytest.raises(WorkflowError, match=field):
            load_workflow(_write(tmp_path, {"state_noise": bad}))


@pytest.fixture(scope="module")
def augmented(make_test_dataset, tmp_path_factory) -> AugmentedRef:
    made = make_test_dataset("hopper", "hdf5")
    root = tmp_path_factory.mktemp("augmented")
    bc = train(
        "bc",
        [made.dataset_id],
        root / "bc",
        config={"hidden": (32, 32)},
        options=TrainOptions(steps=20, eval_every=0, log_every=10, checkpoint_every=20),
    )
    config = RolloutConfig(episodes=4, n_envs=2, noise=parse_noise("gaussian:0.2"), seed=0)
    shard_set = rollout_to_shard_set(made.dataset_id, bc.checkpoint, config, root / "aug").shard_set
    return AugmentedRef(
        directory=str(shard_set.directory),
        rows=shard_set.rows,
        episodes=shard_set.episodes,
        shards=len(shard_set.shards),
        manifest_checksum=file_checksum(shard_set.manifest_path),
        weight_stats=dict(shard_set.params["weight_stats"]),
        faults=0,
    )


def test_the_train_stage_passes_weighting_and_state_noise_through(
    make_test_dataset, augmented: AugmentedRef, tmp_path: Path
) -> None:
    data = stages.prepare_source(SourceConfig(dataset=make_test_dataset("hopper").dataset_id))
    config = TrainModel(
        algorithms=("cql",),
        steps=10,
        weighting="policy",
        state_noise={"kind": "gaussian", "scale": 0.01},  # type: ignore[arg-type]
        configs={"cql": {"hidden": [32, 32], "batch_size": 32}},
    )
    evaluation = EvaluationModel(episodes=1)
    model = stages.train_offline(
        "cql", data, augmented, config, evaluation, str(tmp_path / "aug"), seed=0
    )
    options = json.loads((tmp_path / "aug" / "config.json").read_text())["options"]
    assert options["weighting"] == "policy"
    assert options["state_noise"] == {"kind": "gaussian", "scale": 0.01}
    assert model.metrics["weighting"] == "policy"
    assert 0 < model.metrics["weight_ess_fraction"] <= 1
    assert model.metrics["state_noise"] == {"kind": "gaussian", "scale": 0.01}
    # The baseline on the original data stays plain: no weights, no noise.
    baseline = stages.train_offline(
        "cql", data, None, config, evaluation, str(tmp_path / "plain"), seed=0
    )
    options = json.loads((tmp_path / "plain" / "config.json").read_text())["options"]
    assert options["weighting"] == "none" and options["state_noise"] is None
    assert baseline.metrics["weight_ess_fraction"] is None
    # An S4RL arm without rollouts: the original data with state noise.
    stages.train_offline(
        "cql", data, None, config, evaluation, str(tmp_path / "s4rl"), seed=0, plain=False
    )
    options = json.loads((tmp_path / "s4rl" / "config.json").read_text())["options"]
    assert options["state_noise"] == {"kind": "gaussian", "scale": 0.01}
    assert options["weighting"] == "none"


def test_mixing_follows_rows_caps_the_augmented_share_at_its_rows(
    make_test_dataset, augmented: AugmentedRef, tmp_path: Path
) -> None:
    data = stages.prepare_source(SourceConfig(dataset=make_test_dataset("hopper").dataset_id))
    pooled = augmented.rows / (data.rows + augmented.rows)
    assert pooled < 0.5  # the fixture's rollouts are fewer rows than the data
    evaluation = EvaluationModel(episodes=1)
    shares = {}
    for follows in (False, True):
        config = TrainModel(
            algorithms=("bc",),
            steps=5,
            weighting="none",
            mixing=(0.5, 0.5),
            mixing_follows_rows=follows,
            configs={"bc": {"hidden": [16, 16], "batch_size": 16}},
        )
        out = tmp_path / str(follows)
        model = stages.train_offline("bc", data, augmented, config, evaluation, str(out), seed=0)
        options = json.loads((out / "config.json").read_text())["options"]
        assert model.metrics["mixing"] == pytest.approx(options["mixing"])
        shares[follows] = options["mixing"]
    assert shares[False] == pytest.approx([0.5, 0.5])
    assert shares[True] == pytest.approx([1 - pooled, pooled])


def test_init_plain_continues_from_the_plain_checkpoint(
    make_test_dataset, augmented: AugmentedRef, tmp_path: Path
) -> None:
    """``train.init: plain``'s stage starts from the plain run's checkpoint: its learner has
    the plain run's steps behind it, and it trains its own on the mix."""
    from offaug.algorithms.base import load_checkpoint  # torch, as in the stages

    data = stages.prepare_source(SourceConfig(dataset=make_test_dataset("hopper").dataset_id))
    config = TrainModel(
        algorithms=("bc",),
        steps=6,
        init="plain",
        weighting="none",
        configs={"bc": {"hidden": [16, 16], "batch_size": 16}},
    )
    evaluation = EvaluationModel(episodes=1)
    plain = stages.train_offline(
        "bc", data, None, config, evaluation, str(tmp_path / "plain"), seed=0
    )
    continued = stages.train_offline(
        "bc", data, augmented, config, evaluation, str(tmp_path / "continued"), 0, None, plain
    )
    scratch = stages.train_offline(
        "bc", data, augmented, config, evaluation, str(tmp_path / "scratch"), seed=0
    )
    options = json.loads((tmp_path / "continued" / "config.json").read_text())["options"]
    assert options["init_checkpoint"] == plain.path
    states = {
        name: load_checkpoint(model.path).state
        for name, model in (("plain", plain), ("continued", continued), ("scratch", scratch))
    }
    assert states["plain"]["steps"] == 6 and states["scratch"]["steps"] == 6
    assert states["continued"]["steps"] == 6 + 6
    lines = (tmp_path / "continued" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if '"train"' in line][-1] == 6
    policy = {n: s["policy"] for n, s in states.items()}
    assert any(
        not torch.equal(policy["continued"][k], policy["scratch"][k]) for k in policy["plain"]
    )
    with pytest.raises(ValueError, match="a bc checkpoint cannot start cql"):
        train(
            "cql",
            [data.source],
            tmp_path / "wrong",
            options=TrainOptions(steps=1, eval_every=0, init_checkpoint=plain.path),
        )
    # train.init 'policy' starts BC from the clone: other sizes are named, not a torch error.
    clone = stages.train_bc(data, BCConfigModel(steps=2, hidden=(8, 8)), str(tmp_path / "bc"), 0)
    with pytest.raises(ValueError, match=r"checkpoint\.pt: its bc weights do not fit"):
        stages.train_offline(
            "bc", data, augmented, config, evaluation, str(tmp_path / "c"), 0, None, clone
        )
