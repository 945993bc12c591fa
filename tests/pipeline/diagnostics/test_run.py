"""The stages: known answers on the whole diagnostics, and re-running from a run directory.

Known answers: augmented data identical to the original has ESS/N = 1 (all weights 1) and an OOD
fraction of 1 - quantile; pure noise (states far outside, random actions, log-normal weights)
has a low ESS/N and an OOD fraction near 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from offaug.algorithms import registry
from offaug.datasets import load_transitions
from offaug.pipeline import diagnostics as diag
from offaug.pipeline.contracts import AugmentedRef, DatasetRef
from offaug.pipeline.rollouts.config import RolloutConfig
from offaug.pipeline.rollouts.noise import parse_noise
from offaug.pipeline.rollouts.tasks import merge_rollout_shards, run_rollout_task, split_tasks
from tests.pipeline.diagnostics.helpers import (
    CONFIG,
    FAST,
    NOISE_CLIP,
    Hopper,
    augmented_ref,
    checkpoint,
    noise_copy,
    plain_copy,
)


def test_identical_augmented_data_has_full_ess_and_expected_ood(
    hopper: Hopper, tmp_path: Path
) -> None:
    augmented = augmented_ref(plain_copy(hopper.data), tmp_path / "identical")
    result = diag.run_diagnostics(
        hopper.ref, augmented, hopper.bc, [], CONFIG, str(tmp_path / "d.json"), 0, settings=FAST
    )
    assert result["weights"]["ess_fraction"] == pytest.approx(1.0)
    assert all(s["ess_fraction"] == pytest.approx(1.0) for s in result["weights"]["per_shard"])
    assert len(result["weights"]["per_shard"]) == 2
    # Tolerance 0.01: see test_identical_states_score_one_minus_quantile.
    assert result["coverage"]["ood_fraction"] == pytest.approx(1 - CONFIG.quantile, abs=0.01)
    assert result["data"]["augmented"] == result["data"]["original"]


def test_noise_augmented_data_has_low_ess_and_high_ood(hopper: Hopper, tmp_path: Path) -> None:
    augmented = augmented_ref(noise_copy(hopper.data), tmp_path / "noise", max_weight=NOISE_CLIP)
    result = diag.run_diagnostics(
        hopper.ref, augmented, hopper.bc, [], CONFIG, str(tmp_path / "d.json"), 0, settings=FAST
    )
    assert result["weights"]["ess_fraction"] < 0.1
    assert result["weights"]["clipped_fraction"] > 0
    assert result["coverage"]["ood_fraction"] > 0.95
    assert result["coverage"]["range_violation"]["any_dimension"] > 0.95


def test_run_diagnostics_writes_every_section(hopper: Hopper, tmp_path: Path) -> None:
    from offaug.pipeline.report import render_plots, write_report

    config = RolloutConfig(episodes=4, n_envs=2, noise=parse_noise("gaussian:0.3"), seed=0)
    tasks = split_tasks(hopper.ref.source, hopper.bc.path, config, tmp_path / "aug", 2)
    shard_set = merge_rollout_shards(
        tmp_path / "aug",
        [run_rollout_task(task) for task in tasks],
        {"noise": config.noise.text, "max_weight": config.max_weight},
    )
    augmented = AugmentedRef(shard_set.directory, shard_set.rows, shard_set.episodes, 2, "", {}, 0)
    models = [dataclasses.replace(hopper.bc, name="bc-original")]
    if hopper.critic is not None:
        models.append(hopper.critic)
    out = tmp_path / "diagnostics.json"
    result = diag.run_diagnostics(
        hopper.ref, augmented, hopper.bc, models, CONFIG, str(out), 3, settings=FAST
    )
    # JSON-ready (no numpy types, no NaN) and exactly what was written.
    assert json.loads(json.dumps(result, allow_nan=False)) == result
    assert json.loads(out.read_text()) == result
    for section in ("data", "weights", "coverage", "divergence", "evaluation", "ranking", "ope"):
        assert result[section] is not None, section
    # Simulator rollouts are the env's own transitions: their states, rebuilt from Hopper's
    # observations, step to the recorded next states (the manifest names no backend here).
    quality = result["quality"]["augmented"]
    assert quality["state"]["kind"] == "rebuilt" and quality["state"]["rows_unset"] == 0
    assert quality["dynamics_error"]["max"] < 1e-4 and quality["terminal_mismatch"] == 0
    policies = result["divergence"]["policies"]
    assert {"bc", "rollout", "bc-original"} <= set(policies)
    assert policies["rollout"]["kl_monte_carlo"] > 0
    assert policies["rollout"]["kl_on_rollout_states"] > 0
    assert result["weights"]["episodes"]["episodes"] == 4
    assert len(result["ranking"]) == len(models)
    assert set(result["ope"]) == {"settings", *(m.name for m in models)}
    for entry in (result["ope"][m.name] for m in models):
        assert math.isfinite(entry["fqe"]) and math.isfinite(entry["wpdis"])
    if hopper.critic is not None:
        value = result["value"][hopper.critic.name]
        assert value["dataset"]["n"] == len(hopper.data)
        assert value["rollout"]["n"] > 0
    else:
        assert result["value"] == {}
    assert set(result["timings"]) >= {"load", "coverage", *(f"policy:{m.name}" for m in models)}
    # The same seed gives the same numbers (timings aside).
    again = diag.run_diagnostics(
        hopper.ref,
        augmented,
        hopper.bc,
        models,
        CONFIG,
        str(tmp_path / "again.json"),
        3,
        settings=FAST,
    )
    assert {k: v for k, v in again.items() if k != "timings"} == {
        k: v for k, v in result.items() if k != "timings"
    }
    # The pipeline's way: each policy's part made on its own (a stage), then merged.
    parts = [
        diag.diagnose_policy(hopper.ref, hopper.bc, model, CONFIG, 3, index, settings=FAST)
        for index, model in enumerate(models)
    ]
    merged = diag.run_diagnostics(
        hopper.ref,
        augmented,
        hopper.bc,
        models,
        CONFIG,
        str(tmp_path / "merged.json"),
        3,
        settings=FAST,
        parts=parts,
    )
    assert {k: v for k, v in merged.items() if k != "timings"} == {
        k: v for k, v in result.items() if k != "timings"
    }
    report = write_report({"diagnostics": result}, tmp_path / "report.html")
    text = report.read_text()
    assert text.count('<img src="data:image/png;base64,') == len(
        render_plots({"diagnostics": result})
    )


def test_run_diagnostics_without_augmented_data(hopper: Hopper, tmp_path: Path) -> None:
    result = diag.run_diagnostics(
        hopper.ref, None, hopper.bc, [], CONFIG, str(tmp_path / "d.json"), 0, settings=FAST
    )
    assert result["weights"] is None
    assert result["coverage"] is None
    assert result["quality"] is None
    assert result["data"]["augmented"] is None
    assert "rollout" not in result["divergence"]["policies"]
    assert result["data"]["effective_horizon"] == pytest.approx(100.0)


def test_state_noise_gets_a_quality_report_of_a_noisy_copy(hopper: Hopper, tmp_path: Path) -> None:
    noisy = dataclasses.replace(
        hopper.bc, name="bc-noisy", metrics={"state_noise": {"kind": "gaussian", "scale": 0.1}}
    )
    result = diag.run_diagnostics(
        hopper.ref, None, hopper.bc, [noisy], CONFIG, str(tmp_path / "d.json"), 0, settings=FAST
    )
    quality = result["quality"]["state_noise"]
    assert quality["rows"] == len(hopper.data) and quality["state"]["kind"] == "rebuilt"
    # Noise of 0.1 std on s and s' leaves s' about that far from where the env goes.
    assert 0.05 < quality["dynamics_error"]["median"] < 1.0


def test_diagnose_run_reads_the_run_records(hopper: Hopper, tmp_path: Path) -> None:
    from offaug.pipeline.report import report_run

    run = tmp_path / "run"
    run.mkdir()
    augmented = augmented_ref(plain_copy(hopper.data), run / "shards" / "augmented")
    models = {"bc": hopper.bc}
    if hopper.critic is not None:
        models[f"train:{hopper.critic.name}"] = hopper.critic

    def record(value: Any) -> dict[str, Any]:
        # As the pipeline records a result: the dataclass's fields plus its type name.
        return {
            "key": "k",
            "result": {"__type__": type(value).__name__, **dataclasses.asdict(value)},
        }

    stages = {"source": record(hopper.ref), "rollout": record(augmented)}
    stages.update({name: record(model) for name, model in models.items()})
    (run / "stages.json").write_text(json.dumps({"stages": stages}))
    (run / "workflow.yaml").write_text(
        f"name: t\nseed: 4\nsource:\n  dataset: {hopper.ref.source}\n"
        "diagnostics:\n  k: 3\n  max_states: 500\n"
    )
    (run / "metrics.json").write_text(json.dumps({"training": {"cql-original": {"return": 1.0}}}))
    result = diag.diagnose_run(run, settings=FAST)
    assert result["config"]["k"] == 3 and result["seed"] == 4
    assert result["divergence"]["states"] <= 500
    assert result["weights"]["ess_fraction"] == pytest.approx(1.0)
    assert json.loads((run / "diagnostics.json").read_text()) == result
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["training"] == {"cql-original": {"return": 1.0}}
    assert metrics["diagnostics"] == result
    if hopper.critic is not None:
        assert set(result["value"]) == {hopper.critic.name}
    assert report_run(run) == run / "report.html"
    assert (run / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_diagnose_run_without_records_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"stages\.json"):
        diag.diagnose_run(tmp_path)


def test_discrete_actions(make_test_dataset, tmp_path: Path) -> None:
    data = load_transitions(make_test_dataset("cartpole", "hdf5").dataset_id)
    ref = DatasetRef(
        data.meta["dataset_id"], len(data), data.num_episodes, "", False, dict(data.meta)
    )
    bc = checkpoint("bc", data, tmp_path / "bc" / "checkpoint.pt", {"hidden": (32, 32)})
    models = []
    if "discrete_cql" in registry.available():
        path = tmp_path / "discrete_cql-original" / "checkpoint.pt"
        models.append(checkpoint("discrete_cql", data, path, {"hidden": (32, 32)}))
    config = RolloutConfig(episodes=4, n_envs=2, noise=parse_noise("epsilon:0.2"), seed=0)
    tasks = split_tasks(ref.source, bc.path, config, tmp_path / "aug", 1)
    shard_set = merge_rollout_shards(
        tmp_path / "aug", [run_rollout_task(t) for t in tasks], {"noise": config.noise.text}
    )
    augmented = AugmentedRef(shard_set.directory, shard_set.rows, shard_set.episodes, 1, "", {}, 0)
    result = diag.run_diagnostics(
        ref, augmented, bc, models, CONFIG, str(tmp_path / "d.json"), 0, settings=FAST
    )
    policies = result["divergence"]["policies"]
    assert policies["bc"]["kind"] == "categorical (beta_hat)"
    # Epsilon-greedy against the categorical beta_hat: an exact, non-negative KL.
    assert policies["rollout"]["kl_monte_carlo"] >= 0
    assert 0 <= policies["rollout"]["action_distance"] <= 1
    for model in models:
        assert result["value"][model.name]["dataset"]["n"] == len(data)
        assert math.isfinite(result["ope"][model.name]["wpdis"])
