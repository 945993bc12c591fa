"""The doctor with a workflow (rollout horizon against T_eff), and `offaug doctor` as a user
runs it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from typer.testing import CliRunner

from offaug.cli import app
from offaug.datasets import write_shard_set
from offaug.datasets.doctor import env_facts
from offaug.pipeline.schema.workflow import load_workflow
from offaug.pipeline.stages.doctor import doctor_source, horizon_findings, rollout_horizon
from tests.datasets.test_doctor import clean_dataset

runner = CliRunner()


def _workflow(tmp_path: Path, dataset: str, rollout: str, gamma: float = 0.99) -> Path:
    path = tmp_path / "workflow.yaml"
    path.write_text(
        f"name: doctor\nsource:\n  dataset: {dataset}\nrollout:\n{rollout}\n"
        f"diagnostics:\n  gamma: {gamma}\n"
    )
    return path


def test_rollout_horizon_comes_from_the_workflow_or_the_env(tmp_path: Path) -> None:
    facts = env_facts(clean_dataset().meta)
    override = load_workflow(_workflow(tmp_path, "x", "  max_episode_steps: 20"))
    horizon = rollout_horizon(override, facts)
    assert horizon is not None and (horizon.steps, horizon.backend) == (20, "simulator")
    (short,) = horizon_findings(horizon, 0.99)
    assert (short.code, short.severity) == ("rollout-horizon-short", "warning")
    assert short.numbers["rollout_horizon"] == 20
    assert "50" in short.advice

    from_env = rollout_horizon(load_workflow(_workflow(tmp_path, "x", "  episodes: 4")), facts)
    assert from_env is not None and from_env.steps == 120
    assert horizon_findings(from_env, 0.99)[0].severity == "info"
    named = load_workflow(_workflow(tmp_path, "x", "  env: Hopper-v5"))
    named_horizon = rollout_horizon(named, facts)
    assert named_horizon is not None and named_horizon.steps == 1000

    model = load_workflow(_workflow(tmp_path, "x", "  backend: model"))
    model_horizon = rollout_horizon(model, facts)
    assert model_horizon is not None and model_horizon.steps == 5
    (finding,) = horizon_findings(model_horizon, 0.99)
    assert (finding.code, finding.severity) == ("rollout-horizon", "info")


def test_doctor_source_uses_the_workflow_gamma(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper").dataset_id
    workflow = load_workflow(_workflow(tmp_path, dataset, "  max_episode_steps: 4", gamma=0.9))
    report = doctor_source(dataset, workflow=workflow)
    assert report.facts["gamma"] == 0.9
    assert report.codes("warning") == ["rollout-horizon-short"]
    assert doctor_source(dataset, workflow=workflow, gamma=0.5).exit_code == 0


def test_cli_doctor_exit_codes_table_and_json(make_test_dataset, tmp_path: Path) -> None:
    clean = write_shard_set(clean_dataset(), tmp_path / "clean").directory
    quiet = runner.invoke(app, ["doctor", str(clean)])
    assert quiet.exit_code == 0, quiet.output
    assert "reward-scale" in quiet.output and "T_eff 99.5" in quiet.output

    broken = clean_dataset()
    actions = broken.actions.copy()
    actions[3, 1] = 1.5
    bad = write_shard_set(dataclasses.replace(broken, actions=actions), tmp_path / "bad")
    errors = runner.invoke(app, ["doctor", str(bad.directory), "--json"])
    assert errors.exit_code == 2, errors.output
    found = json.loads(errors.stdout)
    assert found["worst"] == "error" and found["exit_code"] == 2
    assert [f["code"] for f in found["findings"] if f["severity"] == "error"] == [
        "actions-outside-box"
    ]

    hopper = make_test_dataset("hopper").dataset_id
    warned = runner.invoke(app, ["doctor", hopper, "--json"])
    assert warned.exit_code == 1, warned.output
    assert "episodes-short" in [f["code"] for f in json.loads(warned.stdout)["findings"]]
    assert runner.invoke(app, ["doctor", hopper, "--gamma", "0.9"]).exit_code == 0
    workflow = _workflow(tmp_path, hopper, "  max_episode_steps: 4")
    flagged = runner.invoke(app, ["doctor", hopper, "--workflow", str(workflow), "--gamma", "0.9"])
    assert flagged.exit_code == 1 and "rollout-horizon-short" in flagged.output
    assert runner.invoke(app, ["doctor", hopper, "--gamma", "1.5"]).exit_code == 2
