"""The offaug command line, run as a user runs it (a real subprocess for the entry point)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from offaug.cli import app

runner = CliRunner()


def test_make_dataset_inspect_shard_verify(minari_root: Path, tmp_path: Path) -> None:
    made = runner.invoke(
        app,
        [
            "make-dataset",
            "CartPole-v1",
            "--dataset-id",
            "cli/cartpole-v0",
            "--episodes",
            "5",
            "--format",
            "arrow",
            "--max-episode-steps",
            "20",
        ],
    )
    assert made.exit_code == 0, made.output
    assert (minari_root / "cli" / "cartpole-v0" / "data" / "metadata.json").is_file()

    inspected = runner.invoke(app, ["inspect", "cli/cartpole-v0", "--json"])
    assert inspected.exit_code == 0, inspected.output
    summary = json.loads(inspected.stdout)
    assert summary["episodes"] == 5
    assert summary["terminals"] + summary["timeouts"] == 5
    assert summary["action_dtype"] == "int64"

    out = tmp_path / "shards"
    sharded = runner.invoke(
        app, ["shard", "cli/cartpole-v0", "--out", str(out), "--rows-per-shard", "30"]
    )
    assert sharded.exit_code == 0, sharded.output
    assert (out / "manifest.json").is_file()
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0

    victim = sorted(out.glob("*.arrow"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-20] ^= 0xFF
    victim.write_bytes(bytes(raw))
    verified = runner.invoke(app, ["verify", str(out)])
    assert verified.exit_code == 1
    assert victim.name in verified.output


def test_missing_dataset_exits_2_with_a_clear_line(minari_root: Path) -> None:
    result = runner.invoke(app, ["inspect", "ghost/none-v0"])
    assert result.exit_code == 2
    assert "MINARI_DATASETS_PATH" in result.output
    assert "Traceback" not in result.output


def test_train_refuses_an_unknown_algorithm_before_reading_data(
    minari_root: Path, tmp_path: Path
) -> None:
    # The source does not exist either: the algorithm is checked first.
    result = runner.invoke(
        app, ["train", "qlearn", "nowhere/missing-v0", "--steps", "5", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "unknown algorithm 'qlearn'" in result.output
    assert "bc, bcq, cql, discrete_bcq, discrete_cql, iql, rebrac, sac, td3bc" in result.output
    assert not any(tmp_path.iterdir())


def test_train_compile_flag_reaches_the_learner(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    config = tmp_path / "bc.yaml"
    config.write_text("hidden: [32, 32]\nbatch_size: 32\n")
    out = tmp_path / "run"
    args = ["train", "bc", dataset, "--steps", "10", "--log-every", "5", "--eval-every", "0"]
    result = runner.invoke(app, [*args, "--config", str(config), "--out", str(out), "--compile"])
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["options"]["compile"] is True
    assert recorded["compiled"] == ["loss"]  # Gaussian BC, the default policy


def test_train_compile_step_option_reaches_the_run(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    out = tmp_path / "run"
    args = ["train", "td3bc", dataset, "--steps", "4", "--log-every", "2", "--eval-every", "0"]
    options = ["--compile-step", "off", "--steps-per-call", "2", "--out", str(out)]
    result = runner.invoke(app, [*args, *options])
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "config.json").read_text())["options"]
    assert (recorded["compile_step"], recorded["steps_per_call"]) == ("off", 2)
    refused = runner.invoke(app, [*args, "--compile-step", "on", "--weighting", "behaviour"])
    assert refused.exit_code != 0 and "no graph-safe step" in refused.output


def test_train_refuses_policy_weighting_for_a_learner_without_a_density(
    minari_root: Path, tmp_path: Path
) -> None:
    # Before any data is read: the source does not exist.
    args = ["train", "bcq", "nowhere/missing-v0", "--out", str(tmp_path)]
    result = runner.invoke(app, [*args, "--weighting", "policy"])
    assert result.exit_code == 2
    assert "--weighting policy" in result.output and "bcq's policy has no density" in result.output
    contradiction = runner.invoke(app, [*args, "--weights", "--weighting", "none"])
    assert contradiction.exit_code == 2 and "--weights" in contradiction.output
    bad_noise = runner.invoke(app, ["train", "cql", "nowhere/missing-v0", "--state-noise", "0.1"])
    assert bad_noise.exit_code == 2 and "--state-noise" in bad_noise.output
    assert "KIND:SCALE" in bad_noise.output
    assert not any(tmp_path.iterdir())


def test_train_weights_and_state_noise_reach_the_run(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    config = tmp_path / "cql.yaml"
    config.write_text("hidden: [32, 32]\nbatch_size: 32\n")
    args = ["train", "cql", dataset, "--steps", "4", "--log-every", "2", "--eval-every", "0"]
    args += ["--config", str(config)]
    runs = {
        "weights": ["--weights"],
        "policy": ["--weighting", "policy", "--state-noise", "uniform:0.01"],
    }
    for name, extra in runs.items():
        result = runner.invoke(app, [*args, "--out", str(tmp_path / name), *extra])
        assert result.exit_code == 0, result.output
    options = json.loads((tmp_path / "weights" / "config.json").read_text())["options"]
    assert options["weighting"] == "behaviour" and options["state_noise"] is None
    options = json.loads((tmp_path / "policy" / "config.json").read_text())["options"]
    assert options["weighting"] == "policy"
    assert options["state_noise"] == {"kind": "uniform", "scale": 0.01}


def test_train_without_evaluation_needs_no_environment(make_test_dataset, tmp_path: Path) -> None:
    """A shard set that records no environment trains with --eval-episodes 0 and the CLI says
    nothing was evaluated; with evaluations it still asks for --env."""
    import dataclasses

    from offaug.datasets import load_transitions, write_shard_set

    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
    meta = {k: v for k, v in data.meta.items() if k not in ("env_spec", "eval_env_spec")}
    shards = tmp_path / "no-env"
    write_shard_set(dataclasses.replace(data, meta=meta), shards)
    config = tmp_path / "bc.yaml"
    config.write_text("hidden: [16, 16]\nbatch_size: 16\n")
    args = ["train", "bc", str(shards), "--steps", "4", "--log-every", "2", "--config", str(config)]

    trained = runner.invoke(app, [*args, "--eval-episodes", "0", "--out", str(tmp_path / "run")])
    assert trained.exit_code == 0, trained.output
    assert "not evaluated" in trained.output
    assert "nan" not in trained.output and "final return" not in trained.output
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["train", "train"]

    fused = runner.invoke(
        app, [*args, "--eval-episodes", "0", "--seeds", "0,1", "--out", str(tmp_path / "fused")]
    )
    assert fused.exit_code == 0, fused.output
    assert "not evaluated" in fused.output and "final return" not in fused.output

    evaluated = runner.invoke(app, [*args, "--eval-every", "2", "--out", str(tmp_path / "eval")])
    assert evaluated.exit_code != 0
    assert "--env" in evaluated.output


def test_make_dataset_refuses_an_existing_id(minari_root: Path) -> None:
    args = ["make-dataset", "CartPole-v1", "--dataset-id", "cli/twice-v0", "--episodes", "2"]
    assert runner.invoke(app, args).exit_code == 0
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0


@pytest.mark.parametrize("bad_id", ["no-version", "../escape-v0"])
def test_make_dataset_refuses_bad_ids(minari_root: Path, bad_id: str) -> None:
    result = runner.invoke(
        app, ["make-dataset", "CartPole-v1", "--dataset-id", bad_id, "--episodes", "1"]
    )
    assert result.exit_code == 2
    assert not list(minari_root.glob("**/no-version"))


def test_console_script_runs(minari_root: Path) -> None:
    offaug = Path(sys.executable).parent / "offaug"
    result = subprocess.run([str(offaug), "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0
    for command in ("make-dataset", "inspect", "shard", "verify"):
        assert command in result.stdout


def test_validate_names_a_typo_in_a_learner_config(tmp_path: Path) -> None:
    workflow = tmp_path / "typo.yaml"
    workflow.write_text(
        "name: x\nsource: {dataset: a/b-v0}\ntrain:\n  configs:\n"
        "    cql: {hiden: [64, 64], learning_rat: 3}\n"
    )
    result = runner.invoke(app, ["validate", str(workflow)])
    assert result.exit_code == 2
    assert f"{workflow}:5: train.configs.cql.hiden: unknown CQLConfig field" in result.output
    assert "train.configs.cql.learning_rat" in result.output
    assert "Traceback" not in result.output


def test_publish_and_verify_a_run_directory(make_test_dataset, tmp_path: Path) -> None:
    """A run directory stands for its source dataset and augmented shard set, read from its
    stage records."""
    from offaug.datasets import load_transitions, write_shard_set
    from offaug.pipeline.contracts import AugmentedRef, DatasetRef
    from offaug.pipeline.rundir.files import StageRecords
    from offaug.pipeline.rundir.run_layout import RunLayout

    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    data = load_transitions(dataset)
    run_dir = tmp_path / "run"
    shards = write_shard_set(data.slice(0, 60), run_dir / "shards" / "augmented")
    records = StageRecords(RunLayout(run_dir))
    source = DatasetRef(dataset, len(data), data.num_episodes, "", False, {})
    records.record("source", "k", source, 0.0, None, [])
    augmented = AugmentedRef(str(shards.directory), shards.rows, shards.episodes, 1, "", {}, 0)
    records.record("rollout", "k", augmented, 0.0, None, ["source"])

    verified = runner.invoke(app, ["verify", str(run_dir)])
    assert verified.exit_code == 0, verified.output
    assert f"{shards.rows} rows: all checksums match" in verified.output

    args = ["publish", str(run_dir), "--dataset-id", "cli/from-run-v0"]
    published = runner.invoke(app, [*args, "--include", "both"])
    assert published.exit_code == 0, published.output
    assert f"{data.num_episodes + shards.episodes} episodes" in published.output
    only = runner.invoke(app, [*args, "--include", "original", "--overwrite"])
    assert only.exit_code == 0, only.output
    assert f"{data.num_episodes} episodes" in only.output
    bad = runner.invoke(app, [*args, "--include", "neither", "--overwrite"])
    assert bad.exit_code == 2


def test_quality_reports_simulator_rollouts_against_their_source(
    make_test_dataset, tmp_path: Path
) -> None:
    from offaug.algorithms.evaluate import make_env
    from offaug.datasets import load_transitions, write_shard_set
    from offaug.pipeline.rollouts.config import RolloutConfig
    from offaug.pipeline.rollouts.noise import parse_noise
    from offaug.pipeline.rollouts.simulator import rollout
    from tests.pipeline.test_rollout import KnownHopperPolicy

    dataset_id = make_test_dataset("hopper", "hdf5").dataset_id
    data = load_transitions(dataset_id)
    config = RolloutConfig(episodes=3, n_envs=3, noise=parse_noise("gaussian:0.3"), seed=2)
    result = rollout(KnownHopperPolicy(), lambda: make_env(data.meta, max_episode_steps=20), config)
    shards = tmp_path / "rollouts"
    write_shard_set(result.transitions, shards)

    out = tmp_path / "quality.json"
    printed = runner.invoke(
        app, ["quality", str(shards), "--source", dataset_id, "--json", "--out", str(out)]
    )
    assert printed.exit_code == 0, printed.output
    report = json.loads(printed.stdout)
    assert json.loads(out.read_text()) == report
    assert report["rows"] == len(result.transitions) and report["source_rows"] == len(data)
    # Rollouts in the true env replay exactly from states rebuilt from their observations.
    assert report["state"]["kind"] == "rebuilt" and report["state"]["env"] == "Hopper-v5"
    assert report["dynamics_error"]["max"] < 1e-4 and report["reward_error"]["max"] < 1e-4

    table = runner.invoke(app, ["quality", str(shards), "--source", dataset_id])
    assert table.exit_code == 0, table.output
    assert "rebuilt" in table.output and "novelty" in table.output

    missing = runner.invoke(app, ["quality", str(tmp_path / "nowhere"), "--source", dataset_id])
    assert missing.exit_code == 2 and "Traceback" not in missing.output
