"""Benchmark scripts that CI cannot run at their real size keep working at a tiny one.

``benchmarks/bench_gpu.py`` is meant for a lent GPU machine, which CI never has: run here on
the CPU, it must still time both sides and print one well-formed record. No speed is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``benchmarks/SCRIPT ARGS`` in a fresh interpreter, its output captured."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=cwd,
    )


def test_gpu_benchmark_runs_on_the_cpu_and_prints_one_record(tmp_path: Path) -> None:
    args = ["--device", "cpu", "--steps", "10", "--block", "5", "--baseline-steps", "4"]
    done = _run("bench_gpu.py", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, done.stdout  # stdout holds the record and nothing else
    record = json.loads(lines[0])
    assert record["benchmark"] == "train_cql_3x256_cpu"
    assert record["size"]["hidden"] == [256, 256, 256]
    absolute = record["absolute"]
    assert absolute["steps_timed"] == 10 and absolute["baseline_steps_timed"] == 4
    assert absolute["update_only_steps_timed"] == 1 and absolute["update_only_steps_per_s"] > 0
    assert absolute["minutes_per_1M_steps"] * 60 * record["offaug"] == pytest.approx(1e6)
    assert record["ratio"] == pytest.approx(record["offaug"] / record["baseline"])


def test_gpu_graph_suite_dry_run_measures_each_learner_and_member_count(tmp_path: Path) -> None:
    args = ["--suite", "graph", "--dry-run", "--learners", "td3bc,cql", "--members", "1,2"]
    done = _run("bench_gpu.py", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert [r["benchmark"] for r in records] == [
        "graph_step_td3bc_k1_captured_cpu",
        "graph_step_td3bc_k2_captured_cpu",
        "graph_step_cql_k1_captured_cpu",
        "graph_step_cql_k2_captured_cpu",
        "graph_step_td3bc_k1_compiled_captured_cpu",
        "graph_step_cql_k1_compiled_captured_cpu",
    ]
    assert all(r["absolute"]["device"] == "cpu" and r["offaug"] > 0 for r in records)
    assert records[4]["absolute"]["plain_compiled_captured_steps_per_s"] > 0


def test_gpu_graph_suite_arguments() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    args = bench_gpu.parse_graph_args(["--suite", "graph", "--members", "1,10"])
    assert args.learners == list(bench_gpu.GRAPH_LEARNERS)
    assert (args.members, args.compiled_members, args.device) == ([1, 10], [1], "cuda")
    assert args.time_limit == 270.0
    with pytest.raises(SystemExit):
        bench_gpu.parse_graph_args(["--suite", "graph", "--learners", "sac"])


def test_the_affine_layer_benchmark_times_both_sides_at_each_shape(tmp_path: Path) -> None:
    done = _run("bench_fused.py", "--quick", "--only", "affine", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert [r["benchmark"] for r in records] == [
        "batched_affine_critic_head_k5_e2_64",
        "batched_affine_critic_head_single_e2_64",
        "batched_affine_bc_actor_head_k5_64",
        "batched_affine_critic_head_k5_e2_256",
    ]
    for record in records:
        assert record["offaug"] > 0 and record["baseline"] > 0
        assert record["ratio"] == pytest.approx(record["offaug"] / record["baseline"])


def test_gpu_benchmark_without_cuda_says_so_and_exits_2(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = _run("bench_gpu.py", "--quick", cwd=tmp_path)
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "--device cpu" in done.stderr
    assert done.stdout.strip() == ""


def test_a_full_benchmark_run_leaves_the_gpu_script_out_without_a_device() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import run_all
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    without = {path.name for path in run_all.select_scripts("", cuda=False)}
    with_device = {path.name for path in run_all.select_scripts("", cuda=True)}
    assert "bench_gpu.py" not in without and "bench_algorithms.py" in without
    assert with_device == without | {"bench_gpu.py"}
    named = run_all.select_scripts("gpu,io", cuda=False)
    assert [path.name for path in named] == ["bench_gpu.py", "bench_io.py"]
    # An absolute goal (minutes per 1M steps) decides 'met?' where there is no ratio goal.
    assert run_all.met({"ratio": 3.0, "goal": None, "absolute": {"goal_met": False}}) is False
    assert run_all.met({"ratio": 3.0, "goal": None}) is None
    # A record's own verdict (interval and P(improvement) besides the ratio) decides.
    assert run_all.met({"ratio": 6.8, "goal": 0.0, "goal_met": False}) is False


def test_a_saved_run_is_read_back_as_records_stamped_with_its_file_time(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import run_all
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    saved = tmp_path / "aug.jsonl"
    record = {"benchmark": "augmentation_x_cql", "ratio": 1.5, "goal": 0.0}
    saved.write_text(json.dumps(record) + "\nnot json\n" + json.dumps({"no": "name"}) + "\n")
    run = run_all.saved_run(REPO / "benchmarks" / "bench_augmentation.py", saved)
    assert [r["benchmark"] for r in run["records"]] == ["augmentation_x_cql"]
    assert run["records"][0]["script"] == "bench_augmentation.py"
    assert run["records"][0]["measured"].startswith("20")
    assert len(run["problems"]) == 2 and run["partial"]


def test_augmentation_reuse_keeps_the_pairs_this_run_does_not_measure(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_augmentation
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    names = [
        "augmentation_hopper-medium_cql",
        "augmentation_hopper-medium_td3bc",
        "augmentation_pendulum-medium_cql",
        "augmentation_cql_datasets_won",
    ]
    saved = tmp_path / "earlier.jsonl"
    lines = [json.dumps({"benchmark": name, "run": 1}) for name in names]
    lines.append(json.dumps({"benchmark": names[1], "run": 2}))  # a later record of a pair
    saved.write_text("\n".join([*lines, "a log line"]) + "\n")
    reused = bench_augmentation._reusable(saved, ["hopper-medium"], ["cql"])
    assert {r["benchmark"]: r["run"] for r in reused} == {names[1]: 2, names[2]: 1}
    assert bench_augmentation._reusable(None, [], ["cql"]) == []


def test_augmentation_extend_joins_the_seeds_of_two_runs(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_augmentation as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from offaug.pipeline.outcome.statistics import compare

    size = {"dataset": "hopper-medium", "gradient_steps": 10}

    def record(seeds: list[int], plain: list[float], arm: list[float]) -> dict[str, object]:
        diagnostics = {"reset-0.1": {"rows": [10 * s for s in seeds], "rollout_policy": "bc"}}
        absolute = {
            "plain": plain,
            "bc_normalised_scores": [float(s) for s in seeds],
            "data": {"normalised_score": 19.7},
            "rollout_diagnostics": diagnostics,
        }
        return bench._record(
            "hopper-medium", "cql", seeds, {"reset-0.1": arm}, absolute, dict(size)
        )

    earlier = record([0, 1, 2], [1.0, 2.0, 3.0], [2.0, 3.0, 9.0])
    later = record([3, 4], [4.0, 5.0], [6.0, 7.0])
    joined = bench._extended(later, earlier)
    assert joined["seeds"] == [0, 1, 2, 3, 4] and joined["repeats"] == 5
    absolute = joined["absolute"]
    assert absolute["plain"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert absolute["recipes"]["reset-0.1"]["per_seed"] == [2.0, 3.0, 9.0, 6.0, 7.0]
    assert absolute["rollout_diagnostics"]["reset-0.1"]["rows"] == [0, 10, 20, 30, 40]
    assert absolute["rollout_diagnostics"]["reset-0.1"]["rollout_policy"] == "bc"
    expected = compare([1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0, 9.0, 6.0, 7.0])
    assert joined["ratio"] == expected.difference.value
    assert joined["interval"] == [expected.difference.low, expected.difference.high]
    with pytest.raises(ValueError, match="seeds"):
        bench._extended(earlier, earlier)
    with pytest.raises(ValueError, match="sizes"):
        bench._extended({**later, "size": {**size, "gradient_steps": 20}}, earlier)


def test_augmentation_join_adds_an_earlier_runs_recipes_on_the_same_seeds() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_augmentation as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from offaug.pipeline.outcome.statistics import compare

    size = {"dataset": "hopper-medium", "gradient_steps": 10}
    seeds = [0, 1, 2]
    plain = [1.0, 2.0, 3.0]

    def record(arms: dict[str, list[float]], plain: list[float]) -> dict[str, object]:
        diagnostics = {r: {"rows": [len(r)] * 3, "rollout_policy": "bc"} for r in arms}
        absolute = {
            "plain": plain,
            "bc_normalised_scores": [0.0, 1.0, 2.0],
            "data": {"normalised_score": 19.7},
            "rollout_diagnostics": diagnostics,
        }
        return bench._record("hopper-medium", "cql", seeds, arms, absolute, dict(size))

    earlier = record({"reset-0.1": [2.0, 3.0, 4.0]}, plain)
    later = record({"td3bc-reset-0.1": [5.0, 6.0, 9.0]}, plain)
    joined = bench._join(later, earlier)
    recipes = joined["absolute"]["recipes"]
    assert set(recipes) == {"reset-0.1", "td3bc-reset-0.1"}
    assert recipes["reset-0.1"]["per_seed"] == [2.0, 3.0, 4.0]
    assert set(joined["absolute"]["rollout_diagnostics"]) == set(recipes)
    assert joined["best_recipe"] == "td3bc-reset-0.1" and joined["seeds"] == seeds
    expected = compare(plain, [2.0, 3.0, 4.0])
    assert recipes["reset-0.1"]["difference"] == expected.difference.value
    # The rerun plain must agree with the earlier one: otherwise the runs trained differently.
    with pytest.raises(ValueError, match=r"plain scores differ .* seeds \[2\]"):
        bench._join(record({"td3bc-reset-0.1": [5.0, 6.0, 9.0]}, [1.0, 2.0, 3.5]), earlier)
    with pytest.raises(ValueError, match="sizes or seeds"):
        bench._join({**later, "seeds": [0, 1, 5]}, earlier)


def test_rebrac_tuning_reuses_an_earlier_runs_points_at_the_same_sizes(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_learning as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    size = {
        "env": "Hopper-v5",
        "gradient_steps": 5000,
        "eval_episodes": 10,
        "data_fingerprint": "a",
    }
    record = {
        "benchmark": "learning_rebrac_tuning_Hopper-v5",
        "size": size,
        "seeds": bench.REBRAC_TUNING_SEEDS,
        "per_seed": {"0.4/0.1": [14.0, 20.0]},
    }
    other_steps = {**record, "size": {**size, "gradient_steps": 500}, "per_seed": {"x": [1.0]}}
    saved = tmp_path / "run.jsonl"
    saved.write_text("\n".join(["a log line", json.dumps(record), json.dumps(other_steps)]))
    assert bench._earlier_tuning(saved, size) == {"0.4/0.1": [14.0, 20.0]}
    assert bench._earlier_tuning(saved, {**size, "env": "Pendulum-v1"}) == {}
    # Other data under the same dataset id (its generator changed): nothing is reused.
    assert bench._earlier_tuning(saved, {**size, "data_fingerprint": "b"}) == {}
    assert bench._earlier_tuning(None, size) == {}
    # The earlier grid's keys are the new grid's keys for points without normalisation.
    keys = [bench._grid_key(*point) for point in bench.REBRAC_GRID]
    assert "0.4/0.1" in keys and "1.0/0.1/normalised" in keys and len(set(keys)) == len(keys)


def test_a_recipes_learner_configs_add_to_the_datasets() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_augmentation as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    _, combo = bench.RECIPES["combo-reset-0.1"]
    cql = bench._train_model("cql", combo, "hopper-expert-narrow", bench.FULL).configs["cql"]
    assert cql["conservative_rows"] == "original"
    assert cql["conservative_weight"] == bench.MUJOCO_CQL["conservative_weight"]
    assert tuple(cql["hidden"]) == bench.HIDDEN
    # Other learners train on the same rollouts with their own configs.
    td3bc = bench._train_model("td3bc", combo, "hopper-expert-narrow", bench.FULL).configs["td3bc"]
    assert "conservative_rows" not in td3bc


def test_an_arm_whose_rollouts_kept_nothing_is_plains_run() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_augmentation as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from offaug.pipeline.contracts import AugmentedRef, ModelRef

    plain = ModelRef(name="cql", path="plain/checkpoint.pt", checksum="", metrics={})
    empty = AugmentedRef("aug", 0, 0, 0, "", {}, 0)
    # No training happens: the arguments after the rollouts are never read.
    assert bench._plain_if_empty(plain, empty, "cql", None) is plain
    # Mixing and weighting act only on augmented rows; learner configs and state noise do not.
    assert not bench._changes_training("td3bc-reset-calibrated-30k-rows")
    assert bench._changes_training("combo-reset-0.1")
    assert bench._changes_training("state-noise")


def test_a_recipes_rollout_policy_budget_is_not_a_rollout_knob() -> None:
    """``policy_steps`` sets the rollout policy's own training budget: the rollout config
    validates without it, and the policy's train config takes it over the dataset's."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_augmentation as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    rollout, _ = bench.RECIPES["td3bc30k-reset-calibrated-30k-rows"]
    data = types.SimpleNamespace(rows=50_000, episodes=50)
    model = bench._rollout_model(rollout, data, bench.FULL)
    assert model.policy == "td3bc" and model.episodes == 30
    policy = bench._train_model(
        "td3bc", {"steps": rollout["policy_steps"]}, "halfcheetah-medium", bench.FULL
    )
    assert policy.steps == 30_000 != bench._train_steps("halfcheetah-medium", bench.FULL)
