"""Fused training: K seeds in one batched network agree with K single-seed runs.

A member's batches and initial parameters are those of the single-seed run of its seed, exactly;
after training they agree to the tolerances of :mod:`tests.algorithms.fused_runs`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.fused.trainer import FusedTrainer, stack_batches
from offaug.algorithms.learners.cql import CQL
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.algorithms.training.fused_loop import build_members, member_configs, train_fused
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.cli import app
from offaug.datasets import Transitions, load_transitions, write_shard_set
from offaug.datasets.sampler import stack_numpy
from offaug.pipeline.contracts import AugmentedRef, DatasetRef
from offaug.pipeline.schema.run_sections import EvaluationModel
from offaug.pipeline.schema.sections import TrainModel
from offaug.pipeline.stages.learning import train_offline, train_offline_fused
from tests.algorithms.fused_runs import (
    SMALL,
    TOLERANCE,
    assert_members_match,
    assert_states_close,
    fused_and_single_runs,
    parameters,
)

DISCRETE = ("discrete_cql", "discrete_bcq")
SEEDS = (0, 1, 2)


@pytest.fixture
def data(make_test_dataset, algorithm: str) -> Transitions:
    """The data of a test parametrised by ``algorithm``: CartPole for discrete learners."""
    kind = "cartpole" if algorithm in DISCRETE else "hopper"
    return load_transitions(make_test_dataset(kind, "hdf5").dataset_id)


@pytest.mark.parametrize("algorithm", list(SMALL))
def test_members_start_and_sample_as_single_runs(data: Transitions, algorithm: str) -> None:
    options = TrainOptions(steps=3)
    configs = member_configs(algorithm, SMALL[algorithm], len(SEEDS))
    fused = build_members(algorithm, [data], SEEDS, configs, options)
    for k, seed in enumerate(SEEDS):
        single = build_members(algorithm, [data], [seed], configs[:1], options)
        first, other = parameters(fused.trainers[k]), parameters(single.trainers[0])
        assert first.keys() == other.keys()
        assert all(torch.equal(first[n], other[n]) for n in first)
        for _ in range(3):
            mine, theirs = fused.samplers[k].sample(), single.samplers[0].sample()
            np.testing.assert_array_equal(mine.observations, theirs.observations)
            np.testing.assert_array_equal(mine.actions, theirs.actions)
        draws = torch.randn(5, generator=fused.generators[k])
        assert torch.equal(draws, torch.randn(5, generator=single.generators[0]))


def test_members_sample_their_own_sources_as_single_runs(hopper: Transitions) -> None:
    """Each member mixes the original data with its own second set (a workflow's seeds each
    have their own rollouts), drawing the batches its single-seed run on that pair draws."""
    bounds = hopper.episode_bounds()
    halves = [hopper.slice(0, int(bounds[2])), hopper.slice(int(bounds[2]), int(bounds[4]))]
    options = TrainOptions(mixing=(0.5, 0.5), weighting="behaviour")
    own = [[hopper, half] for half in halves]
    configs = member_configs("td3bc", SMALL["td3bc"], 2)
    fused = build_members("td3bc", own, (0, 1), configs, options)
    for k, seed in enumerate((0, 1)):
        single = build_members("td3bc", own[k], [seed], configs[:1], options)
        for _ in range(3):
            mine, theirs = fused.samplers[k].sample(), single.samplers[0].sample()
            np.testing.assert_array_equal(mine.observations, theirs.observations)
            np.testing.assert_array_equal(mine.set_index, theirs.set_index)
    with pytest.raises(ValueError, match="one list per seed"):
        build_members("td3bc", own[:1], (0, 1), configs, options)


@pytest.mark.parametrize("algorithm", list(SMALL))
def test_fused_run_matches_single_seed_runs(
    data: Transitions, algorithm: str, tmp_path: Path
) -> None:
    options = TrainOptions(steps=20, log_every=10, eval_every=20, eval_episodes=2)
    fused = train_fused(
        algorithm,
        [data],
        tmp_path / "fused",
        config=SMALL[algorithm],
        options=dataclasses.replace(options, seeds=SEEDS),
    )
    assert fused.frozen == []
    for seed, run in zip(SEEDS, fused.runs, strict=True):
        assert run.out == tmp_path / "fused" / f"seed_{seed}"
        single = train(
            algorithm,
            [data],
            tmp_path / f"single_{seed}",
            config=SMALL[algorithm],
            options=dataclasses.replace(options, seed=seed),
        )
        mine, theirs = load_trainer(run.checkpoint), load_trainer(single.checkpoint)
        assert_states_close(mine.state_dict(), theirs.state_dict())
        assert run.last_evaluation is not None and single.last_evaluation is not None
        np.testing.assert_allclose(
            run.last_evaluation.returns, single.last_evaluation.returns, rtol=TOLERANCE
        )
        # The same files, in the same format, as the single-seed run.
        names = {p.relative_to(run.out) for p in run.out.rglob("*")}
        assert names == {p.relative_to(single.out) for p in single.out.rglob("*")}
        lines = [json.loads(x) for x in (run.out / "metrics.jsonl").read_text().splitlines()]
        reference = [json.loads(x) for x in (single.out / "metrics.jsonl").read_text().splitlines()]
        assert [(x["step"], x["kind"], list(x)) for x in lines] == [
            (x["step"], x["kind"], list(x)) for x in reference
        ]
        recorded = json.loads((run.out / "config.json").read_text())
        assert recorded["options"]["seed"] == seed and recorded["fused_seeds"] == list(SEEDS)


def test_per_member_hyperparameters_reach_their_member(hopper: Transitions) -> None:
    config = {**SMALL["td3bc"], "actor_learning_rate": [3e-4, 0.0], "alpha": [2.5, 10.0]}
    configs = member_configs("td3bc", config, 2)
    assert [c["actor_learning_rate"] for c in configs] == [3e-4, 0.0]
    built = build_members("td3bc", [hopper], (0, 1), configs, TrainOptions())
    still = parameters(built.trainers[1])
    fused = FusedTrainer(built.trainers, built.generators, (0, 1))
    pairs = [[s.sample() for s in built.samplers] for _ in range(4)]
    metrics = [fused.update(TorchBatch.from_batch(stack_numpy(pair))) for pair in pairs]
    assert fused.member(1).config.alpha == 10.0
    # A zero learning rate leaves member 1's actor where it started; its critics learn.
    after = parameters(fused.member(1))
    assert all(torch.equal(after[n], still[n]) for n in after if n.startswith("actor."))
    assert not torch.equal(after["critic.net.layers.0.weight"], still["critic.net.layers.0.weight"])
    # Member 0 is its single-seed run with the first values.
    single = build_members("td3bc", [hopper], (0,), configs[:1], TrainOptions())
    for pair in pairs:
        single.trainers[0].update(TorchBatch.from_batch(pair[0]))
    assert_states_close(fused.member_state_dict(0), single.trainers[0].state_dict())
    assert metrics[-1]["critic_loss"].shape == (2,)


@pytest.mark.parametrize(
    "overrides",
    [
        {"lagrange": False},
        {"soft_q_backup": True},
        {"max_q_backup": True},
        {"n_critics": 3},
        {"bc_steps": 10},  # 20 updates: the warm start ends half-way
        {"normalise_observations": True},
    ],
    ids=[
        "fixed-alpha",
        "soft-backup",
        "max-backup",
        "three-critics",
        "bc-warm-start",
        "normalised-observations",
    ],
)
def test_cql_variants_fuse_as_single_runs(hopper: Transitions, overrides: dict[str, Any]) -> None:
    configs = member_configs("cql", {**SMALL["cql"], **overrides}, 2)
    fused, singles, _ = fused_and_single_runs("cql", [[hopper]] * 2, configs, 20)
    assert fused.frozen == []
    if overrides.get("normalise_observations"):  # the members were prepared on their data
        std = cast(CQL, singles[0]).observation_normaliser.std
        assert not torch.equal(std, torch.ones_like(std))
    for k, single in enumerate(singles):
        assert_states_close(fused.member_state_dict(k), single.state_dict())


@pytest.mark.parametrize("looped", [False, True], ids=["vmap", "looped"])
@pytest.mark.parametrize("algorithm", ["td3bc", "cql", "bcq"])
def test_looped_and_vmapped_losses_both_match_single_runs(
    hopper: Transitions, algorithm: str, looped: bool
) -> None:
    """The CPU's looped member losses (CQL's and BCQ's default there) and vmap's (the default
    elsewhere) train each member as its single-seed run, with one fused backward and Adam."""
    configs = member_configs(algorithm, SMALL[algorithm], 2)
    fused, singles, metrics = fused_and_single_runs(
        algorithm, [[hopper]] * 2, configs, 20, looped=looped
    )
    assert fused.looped is looped
    assert_members_match(fused, singles, metrics)


def test_cql_per_member_hyperparameters_reach_their_member(hopper: Transitions) -> None:
    """Member 1 keeps its temperature and alpha (zero rates) from its own initial values, and
    differs in every other per-member float; each member is the single run of its config."""
    config = {
        **SMALL["cql"],
        "temp_learning_rate": [1e-4, 0.0],
        "alpha_learning_rate": [1e-4, 0.0],
        "initial_alpha": [1.0, 2.0],
        "initial_temperature": [1.0, 0.5],
        "conservative_weight": [5.0, 1.0],
        "alpha_threshold": [10.0, 0.5],
        "critic_learning_rate": [3e-4, 1e-3],
        "actor_learning_rate": [1e-4, 3e-4],
        "gamma": [0.99, 0.9],
        "tau": [0.005, 0.05],
    }
    configs = member_configs("cql", config, 2)
    fused, singles, _ = fused_and_single_runs("cql", [[hopper]] * 2, configs, 20)
    first, second = fused.member(0), fused.member(1)
    assert second.config.conservative_weight == 1.0 and second.config.gamma == 0.9
    assert float(second.log_alpha.detach()) == pytest.approx(np.log(2.0), abs=1e-7)
    assert float(second.log_temperature.detach()) == pytest.approx(np.log(0.5), abs=1e-7)
    assert float(first.log_alpha.detach()) != 0.0 != float(first.log_temperature.detach())
    for k, single in enumerate(singles):
        assert_states_close(fused.member_state_dict(k), single.state_dict())


@pytest.mark.parametrize(
    "overrides",
    [{"rl_start_step": 5, "update_actor_interval": 3}, {"n_critics": 3, "lam": 1.0}],
    ids=["late-start-actor-interval", "three-critics"],
)
def test_bcq_variants_fuse_as_single_runs(hopper: Transitions, overrides: dict[str, Any]) -> None:
    """Phases that start late and skip steps draw (and step) only when their single run does."""
    configs = member_configs("bcq", {**SMALL["bcq"], **overrides}, 2)
    fused, singles, metrics = fused_and_single_runs("bcq", [[hopper]] * 2, configs, 20)
    assert fused.frozen == []
    assert torch.isfinite(metrics["actor_loss"]).all()
    for k, single in enumerate(singles):
        assert_states_close(fused.member_state_dict(k), single.state_dict())


def test_bcq_per_member_hyperparameters_reach_their_member(hopper: Transitions) -> None:
    """Member 1's VAE and actor (zero rates) stay where they started, its targets follow; it
    differs in every other per-member float; each member is the single run of its config."""
    config = {
        **SMALL["bcq"],
        "imitator_learning_rate": [1e-3, 0.0],
        "actor_learning_rate": [1e-3, 0.0],
        "critic_learning_rate": [1e-3, 3e-4],
        "gamma": [0.99, 0.9],
        "tau": [0.005, 0.05],
        "lam": [0.75, 0.5],
        "action_flexibility": [0.05, 0.2],
        "beta": [0.5, 2.0],
    }
    configs = member_configs("bcq", config, 2)
    start = parameters(
        build_members("bcq", [hopper], (1,), configs[1:], TrainOptions()).trainers[0]
    )
    fused, singles, _ = fused_and_single_runs("bcq", [[hopper]] * 2, configs, 20)
    second = fused.member(1)
    assert second.config.action_flexibility == 0.2 and second.config.beta == 2.0
    after = parameters(second)
    still = [n for n in after if n.split(".")[0] in ("vae", "actor", "actor_target")]
    assert still and all(torch.equal(after[n], start[n]) for n in still)
    assert not torch.equal(after["critic.net.layers.0.weight"], start["critic.net.layers.0.weight"])
    for k, single in enumerate(singles):
        assert_states_close(fused.member_state_dict(k), single.state_dict())


@pytest.mark.parametrize("algorithm", DISCRETE)
def test_discrete_per_member_hyperparameters_reach_their_member(
    data: Transitions, algorithm: str
) -> None:
    """Member 1 (a zero learning rate) keeps its start, and its target, copied from it at
    every interval, stays equal to it; each member is the single run of its config."""
    other = {"discrete_cql": "alpha", "discrete_bcq": "beta"}[algorithm]
    config = {
        **SMALL[algorithm],
        "learning_rate": [1e-3, 0.0],
        "gamma": [0.99, 0.9],
        other: [1.0, 0.25],
    }
    configs = member_configs(algorithm, config, 2)
    built = build_members(algorithm, [data], (0, 1), configs, TrainOptions())
    starts = [parameters(trainer) for trainer in built.trainers]
    fused, singles, _ = fused_and_single_runs(algorithm, [[data]] * 2, configs, 12)
    second = fused.member(1)
    assert getattr(second.config, other) == 0.25 and second.config.gamma == 0.9
    after = parameters(second)
    assert all(torch.equal(after[n], starts[1][n]) for n in after)
    moved = parameters(fused.member(0))
    assert all(not torch.equal(moved[n], starts[0][n]) for n in moved if "weight" in n)
    for k, single in enumerate(singles):
        assert_states_close(fused.member_state_dict(k), single.state_dict())


@pytest.mark.parametrize("algorithm", ["td3bc", "cql", "bcq", "discrete_bcq"])
def test_a_nan_member_stops_alone(data: Transitions, algorithm: str) -> None:
    broken = dataclasses.replace(data, rewards=np.full_like(data.rewards, np.nan))
    if algorithm == "bcq":
        # Its VAE steps before its critics: NaN actions break the first phase too.
        broken = dataclasses.replace(broken, actions=np.full_like(data.actions, np.nan))
    configs = member_configs(algorithm, SMALL[algorithm], 2)
    start = parameters(
        build_members(algorithm, [broken], (1,), configs[:1], TrainOptions()).trainers[0]
    )
    fused, singles, metrics = fused_and_single_runs(algorithm, [[data], [broken]], configs, 6)
    assert fused.frozen == [1]
    loss = metrics["loss" if algorithm in DISCRETE else "critic_loss"]
    assert torch.isnan(loss[1]) and torch.isfinite(loss[0])
    frozen = parameters(fused.member(1))
    assert all(torch.equal(frozen[n], start[n]) for n in frozen)
    assert_states_close(fused.member_state_dict(0), singles[0].state_dict())


def test_member_configs_refuse_lists_that_change_shapes() -> None:
    with pytest.raises(ValueError, match=r"batch_size.*one value for all seeds"):
        member_configs("bc", {"batch_size": [32, 64]}, 2)
    with pytest.raises(ValueError, match=r"3 values for 2 seeds"):
        member_configs("bc", {"learning_rate": [1e-3, 1e-4, 1e-5]}, 2)
    # A tuple field given as a list is that tuple, for every member.
    assert member_configs("bc", {"hidden": [8, 8]}, 2) == [{"hidden": [8, 8]}] * 2


def test_stack_batches_matches_stacking_numpy(hopper: Transitions) -> None:
    built = build_members("bc", [hopper], (0, 1), [SMALL["bc"]] * 2, TrainOptions())
    raw = [s.sample() for s in built.samplers]
    stacked = stack_batches([TorchBatch.from_batch(b) for b in raw])
    assert torch.equal(stacked.observations, TorchBatch.from_batch(stack_numpy(raw)).observations)


@pytest.mark.parametrize("algorithm", ["td3bc", "cql", "bcq", "discrete_cql"])
def test_resume_continues_every_member(data: Transitions, tmp_path: Path, algorithm: str) -> None:
    options = TrainOptions(steps=12, log_every=6, eval_every=0, checkpoint_every=6, seeds=(0, 1))
    whole = train_fused(
        algorithm, [data], tmp_path / "whole", config=SMALL[algorithm], options=options
    )
    half = dataclasses.replace(options, steps=6)
    train_fused(algorithm, [data], tmp_path / "parts", config=SMALL[algorithm], options=half)
    resumed = train_fused(
        algorithm,
        [data],
        tmp_path / "parts",
        config=SMALL[algorithm],
        options=options,
        resume=True,
    )
    for mine, theirs in zip(resumed.runs, whole.runs, strict=True):
        a, b = load_trainer(mine.checkpoint), load_trainer(theirs.checkpoint)
        assert_states_close(a.state_dict(), b.state_dict())
        steps = [
            json.loads(x)["step"] for x in (mine.out / "metrics.jsonl").read_text().splitlines()
        ]
        assert steps == [6, 12]


def test_fused_refuses_learners_and_options_it_cannot_train(hopper: Transitions) -> None:
    with pytest.raises(ValueError, match="sac does not train fused"):
        train_fused("sac", [hopper], "unused", options=TrainOptions(seeds=(0, 1)))
    with pytest.raises(ValueError, match="--compile does not apply"):
        build_members("bc", [hopper], (0, 1), [{}] * 2, TrainOptions(compile=True))
    with pytest.raises(ValueError, match="train_fused"):
        train("bc", [hopper], "unused", options=TrainOptions(seeds=(0, 1)))


def test_cli_trains_seeds_fused(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    config = tmp_path / "bc.yaml"
    config.write_text("hidden: [32, 32]\nbatch_size: 32\nlearning_rate: [0.001, 0.0003]\n")
    out = tmp_path / "run"
    args = ["train", "bc", dataset, "--steps", "6", "--log-every", "3", "--eval-every", "0"]
    result = CliRunner().invoke(
        app, [*args, "--seeds", "0,1", "--config", str(config), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    for seed, rate in ((0, 1e-3), (1, 3e-4)):
        restored = load_trainer(out / f"seed_{seed}" / "checkpoint.pt")
        assert restored.config.learning_rate == rate
    bad = CliRunner().invoke(app, [*args, "--seeds", "0,1", "--config", str(config), "--compile"])
    assert bad.exit_code != 0 and "compile" in bad.output


def test_fused_stage_returns_the_per_seed_stages_records(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    data = load_transitions(dataset)
    ref = DatasetRef(dataset, len(data), data.num_episodes, "", False, dict(data.meta))
    train_config = TrainModel(algorithms=("iql",), steps=10, configs={"iql": SMALL["iql"]})
    evaluation = EvaluationModel(episodes=1)
    outs = [str(tmp_path / "fused" / f"iql-{seed}") for seed in (0, 1)]
    fused = train_offline_fused("iql", ref, None, train_config, evaluation, outs, [0, 1])
    for seed, record, out in zip((0, 1), fused, outs, strict=True):
        single = train_offline(
            "iql", ref, None, train_config, evaluation, str(tmp_path / f"iql-{seed}"), seed
        )
        assert record.name == single.name == "iql-original"
        assert record.path == str(Path(out) / "checkpoint.pt")
        assert record.metrics.keys() == single.metrics.keys()
        assert record.metrics["eval"]["returns"] == pytest.approx(
            single.metrics["eval"]["returns"], rel=TOLERANCE
        )
        assert record.metrics["train"]["critic_loss"] == pytest.approx(
            single.metrics["train"]["critic_loss"], rel=1e-4
        )
    assert not list((tmp_path / "fused").glob(".*"))  # no staging directory left behind


def test_a_fused_stage_where_fusing_does_not_pay_trains_its_seeds_one_by_one(
    make_test_dataset, tmp_path: Path
) -> None:
    """``fuse_seeds: auto`` plans a fused stage when the workflow names no device; on a CPU
    worker, where fusing CQL does not pay, the stage trains each seed as its per-seed stage
    would: the same records, exactly."""
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    data = load_transitions(dataset)
    ref = DatasetRef(dataset, len(data), data.num_episodes, "", False, dict(data.meta))
    train_config = TrainModel(
        algorithms=("cql",), steps=6, device="cpu", configs={"cql": SMALL["cql"]}
    )
    assert train_config.fuse_seeds == "auto"
    evaluation = EvaluationModel(episodes=1)
    outs = [str(tmp_path / "fused" / f"cql-{seed}") for seed in (0, 1)]
    fused = train_offline_fused("cql", ref, None, train_config, evaluation, outs, [0, 1])
    for seed, record in zip((0, 1), fused, strict=True):
        single = train_offline(
            "cql", ref, None, train_config, evaluation, str(tmp_path / f"cql-{seed}"), seed
        )
        timing = {"steps_per_s"}  # the one figure that is measured, not computed
        train, reference = record.metrics["train"], single.metrics["train"]
        assert {k: v for k, v in train.items() if k not in timing} == {
            k: v for k, v in reference.items() if k not in timing
        }
        assert record.metrics["eval"]["returns"] == single.metrics["eval"]["returns"]


def test_fused_stage_trains_each_seed_on_its_own_augmented_data(
    make_test_dataset, tmp_path: Path
) -> None:
    """Seed 0 mixes in its own shard set; seed 1's rollout filter kept nothing, so it trains on
    the original data alone, as its per-seed stage would (a fused run of its own)."""
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    data = load_transitions(dataset)
    ref = DatasetRef(dataset, len(data), data.num_episodes, "", False, dict(data.meta))
    shards = write_shard_set(data.slice(0, int(data.episode_bounds()[3])), tmp_path / "aug")
    kept = AugmentedRef(str(shards.directory), shards.rows, shards.episodes, 1, "", {}, 0)
    empty = AugmentedRef(str(tmp_path / "none"), 0, 0, 0, "", {}, 0)
    train_config = TrainModel(
        algorithms=("td3bc",), steps=10, weighting="none", configs={"td3bc": SMALL["td3bc"]}
    )
    evaluation = EvaluationModel(episodes=1)
    outs = [str(tmp_path / "fused" / f"td3bc-{seed}") for seed in (0, 1)]
    fused = train_offline_fused("td3bc", ref, [kept, empty], train_config, evaluation, outs, [0, 1])
    for seed, augmented, record in zip((0, 1), (kept, empty), fused, strict=True):
        single = train_offline(
            "td3bc", ref, augmented, train_config, evaluation, str(tmp_path / f"s{seed}"), seed
        )
        assert record.name == single.name == "td3bc-augmented"
        recorded = json.loads((Path(record.path).parent / "config.json").read_text())
        assert len(recorded["sources"]) == (2 if seed == 0 else 1)
        assert record.metrics["eval"]["returns"] == pytest.approx(
            single.metrics["eval"]["returns"], rel=TOLERANCE
        )
        assert record.metrics["train"]["critic_loss"] == pytest.approx(
            single.metrics["train"]["critic_loss"], rel=1e-4
        )
