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
import yaml

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


def _bench_augmentation() -> types.ModuleType:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_augmentation
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return bench_augmentation


def test_every_augmentation_benchmark_workflow_validates(tmp_path: Path) -> None:
    """Each dataset's workflow (full and thin, both sizes) is one ``offaug run`` accepts."""
    from offaug.pipeline.schema.workflow import load_workflow

    bench = _bench_augmentation()
    for name in [n for d in bench.DATASETS for n in (d, f"{d}-thin")]:
        for sizes in (bench.QUICK, bench.FULL):
            document = bench.workflow_document(name, tmp_path / "data", [0, 1], sizes, 2)
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(document))
            workflow = load_workflow(path)
            assert workflow.seeds == (0, 1) and workflow.source.dataset == str(tmp_path / "data")
            assert workflow.train.steps == (
                sizes.train_steps or bench.DATASETS[name.removesuffix("-thin")].train_steps
            )
            assert workflow.train.baseline and len(workflow.train.algorithms) >= 4
    document = bench.workflow_document(
        "pendulum-medium-thin",
        tmp_path / "data",
        [0],
        bench.QUICK,
        2,
        ["default", "bc-best8-r3", "diffusion"],
    )
    assert list(document["recipes"]) == ["default", "bc-best8-r3", "diffusion"]
    # --quick: a recipe's own episodes cut to 4 starts of its tries.
    assert document["recipes"]["bc-best8-r3"]["rollout"]["episodes"] == 4 * 8
    assert document["rollout"]["diffusion"] == {"steps": 300, "samples": 4096}
    # A recipe's own steps scale with the dataset's budget: 9,000 is three of the template's
    # 3,000, so three of --quick's 500 and of Hopper's 10,000.
    template = yaml.safe_load(bench.TEMPLATE.read_text())
    assert template["train"]["steps"] == 3000
    assert template["recipes"]["bc-modellook8w5-r1-9k"]["train"]["steps"] == 9000
    for name, sizes, expected in (
        ("pendulum-medium", bench.QUICK, 1500),
        ("pendulum-medium", bench.FULL, 9000),
        ("hopper-medium-thin", bench.FULL, 30000),
    ):
        document = bench.workflow_document(name, tmp_path, [0], sizes, 2)
        assert document["recipes"]["bc-modellook8w5-r1-9k"]["train"]["steps"] == expected
    # --quick's recipes are the template's.
    template_recipes = set(template["recipes"])
    assert set(bench.QUICK_RECIPES) <= template_recipes and "default" in bench.QUICK_RECIPES
    with pytest.raises(ValueError, match="no recipe nope"):
        bench.workflow_document("pendulum-medium", tmp_path, [0], bench.QUICK, 2, ["nope"])


def test_the_simulator_free_recipes_are_those_without_env_steps() -> None:
    """Model rollouts, generated samples and state noise alone; not the simulator's recipes."""
    bench = _bench_augmentation()
    document = yaml.safe_load(bench.TEMPLATE.read_text())
    assert bench.simulator_free(document) == [
        "diffusion",
        "model-mopo",
        "model-mobile",
        "bc-modellook8w5-r3",
        "bc-modellook8w5-r1-9k",
        "bc-modellook8w5-r2-4500",
        "bc-modellook8w5-r1-23k",
        "bc-modellook8w5-r3-h20",
        "bc-modellook8w5-r1-9k-pen5",
        "bc-modellook8w5-r3-inv",
        "bc-modellook8w5-r1-9k-inv",
        "state-noise",
    ]
    document["rollout"]["backend"] = "model"  # a recipe inherits the workflow's backend
    assert "default" in bench.simulator_free(document)


def test_augmentation_records_are_read_from_metrics_json(tmp_path: Path) -> None:
    """The records restate metrics.json's comparison; the default recipe is judged with the
    product's own judge against the best plain arm at its steps."""
    from offaug.pipeline.contracts import PLAIN, baseline_recipe
    from offaug.pipeline.outcome.summary import run_scores
    from offaug.pipeline.outcome.verdict import judge_best

    bench = _bench_augmentation()
    scores = {
        ("td3bc", PLAIN, 3000): [30.0, 31.0, 29.0, 33.0, 32.0],
        ("td3bc", baseline_recipe(6000), 6000): [50.0, 52.0, 49.0, 51.0, 48.0],
        ("iql", baseline_recipe(6000), 6000): [40.0, 41.0, 39.0, 42.0, 38.0],
        ("td3bc", "td3bc-self-continued", 6000): [60.0, 62.0, 61.0, 63.0, 59.0],
        ("td3bc", "default", 6000): [45.0, 47.0, 44.0, 46.0, 43.0],
        ("iql", "diffusion", 3000): [31.0, 30.0, 32.0, 29.0, 31.0],
    }
    training = {
        f"{learner}-{recipe}@s{seed}": {
            "learner": learner,
            "recipe": recipe,
            "seed": seed,
            "return": score,
            "normalised_score": score,
            "steps": steps,
            "own_steps": 3000,
        }
        for (learner, recipe, steps), per_seed in scores.items()
        for seed, score in enumerate(per_seed)
    }
    metrics = {
        "seeds": [0, 1, 2, 3, 4],
        "training": training,
        "comparison": judge_best(run_scores(training)[0]),
    }
    best, default, simfree = bench.dataset_records(
        "pendulum-medium-thin",
        metrics,
        {"dataset": "pendulum-medium-thin"},
        simulator_free_recipes=("diffusion",),
    )
    assert best["benchmark"] == "augmentation_pendulum-medium-thin"
    assert best["absolute"]["augmented"]["recipe"] == "td3bc-self-continued"
    assert best["absolute"]["plain"]["recipe"] == baseline_recipe(6000)
    assert best["offaug"] == pytest.approx(61.0) and best["baseline"] == pytest.approx(50.0)
    assert best["goal_met"] and best["outcome"] == "helps" and not best["loses"]
    assert best["absolute"]["arms"][f"td3bc-{PLAIN}"] == [30.0, 31.0, 29.0, 33.0, 32.0]
    assert default["benchmark"] == "augmentation_default_pendulum-medium-thin"
    assert default["absolute"]["augmented"]["recipe"] == "default"
    assert default["loses"] and not default["goal_met"]
    # The generated samples' arm (IQL, 3,000 steps: no rollout policy) against the plain arms
    # of 3,000 steps: its IQM about 30.7 against TD3+BC plain at 31.0, level.
    assert simfree["benchmark"] == "augmentation_simfree_pendulum-medium-thin"
    assert simfree["absolute"]["augmented"]["recipe"] == "diffusion"
    assert simfree["absolute"]["plain"]["steps"] == 3000
    assert simfree["outcome"] == "inconclusive" and not simfree["goal_met"]
    summary = bench.summary_records([best, default, simfree])
    assert [(r["benchmark"], r["offaug"], r["goal"]) for r in summary] == [
        ("augmentation_thin_datasets_won", 1, bench.DATASETS_GOAL),
        ("augmentation_simfree_thin_datasets_won", 0, bench.SIMULATOR_FREE_GOAL),
        ("augmentation_default_never_loses", 1, 0),
    ]
    assert all(r["seeds"] == [0, 1, 2, 3, 4] and r["repeats"] == 5 for r in summary)

    # A study run dataset by dataset: an earlier report's records of another dataset count in
    # the summaries (its own seeds too: only those both measured are stated), this run's
    # dataset is never taken from it, and summaries are not records of a dataset.
    earlier_simfree = {
        **simfree,
        "benchmark": "augmentation_simfree_hopper-medium-thin",
        "size": {"dataset": "hopper-medium-thin"},
        "goal_met": True,
        "seeds": [0, 1, 2],
        "measured": "2026-12-01T00:00:00+00:00",
    }
    stale = {**simfree, "goal_met": True}
    report = tmp_path / "results.json"
    report.write_text(json.dumps({"results": [earlier_simfree, stale, *summary]}))
    earlier = bench.earlier_records(report, {"pendulum-medium-thin"})
    assert [r["benchmark"] for r in earlier] == ["augmentation_simfree_hopper-medium-thin"]
    joined = {"hopper-medium-thin": "2026-12-01T00:00:00+00:00"}
    won = {
        r["benchmark"]: r for r in bench.summary_records([best, default, simfree, *earlier], joined)
    }["augmentation_simfree_thin_datasets_won"]
    assert (won["offaug"], won["baseline"]) == (1, 2)
    assert won["size"]["counted"] == ["hopper-medium-thin"]
    assert won["size"]["earlier"] == joined and won["seeds"] == [0, 1, 2]
    assert "hopper-medium-thin (2026-12-01" in won["notes"]
