"""Diagnostics: the issue's known answers, each metric on hand-made data, and the whole stage.

Known answers: augmented data identical to the original has ESS/N = 1 (all weights 1) and an OOD
fraction of 1 - quantile; pure noise (states far outside, random actions, log-normal weights)
has a low ESS/N and an OOD fraction near 1; a critic that says +100 everywhere over-estimates.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from offaug.algorithms import registry
from offaug.algorithms.base import save_checkpoint, spaces_from_transitions
from offaug.datasets import Transitions, load_transitions, write_shard_set
from offaug.pipeline import diagnostics as diag
from offaug.pipeline.layout import AugmentedRef, DatasetRef, ModelRef
from offaug.pipeline.noise import parse_noise
from offaug.pipeline.rollout import RolloutConfig
from offaug.pipeline.rollout_tasks import merge_rollout_shards, run_rollout_task, split_tasks
from offaug.pipeline.workflow import DiagnosticsModel

# Small enough for seconds on 2 cores; the hopper test dataset has ~800 rows, all used.
FAST = diag.DiagnosticsSettings(evaluation_episodes=2, fqe_steps=50, scatter_points=50)
NOISE_CLIP = 1e4
CONFIG = DiagnosticsModel(k=5, quantile=0.95, gamma=0.99, max_states=2000)


# -- fixtures -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hopper:
    """The hopper test dataset, its record, and untrained checkpoints made from it."""

    data: Transitions
    ref: DatasetRef
    bc: ModelRef
    critic: ModelRef | None
    """A CQL checkpoint (None when offaug.algorithms.cql is not there yet)."""
    root: Path


def _checkpoint(name: str, data: Transitions, path: Path, config: dict[str, Any]) -> ModelRef:
    """An untrained learner saved as a checkpoint: enough for every diagnostic."""
    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    trainer = registry.build(name, spaces, config, device="cpu")
    save_checkpoint(
        path, algorithm=name, config=trainer.config, spaces=spaces, state=trainer.state_dict()
    )
    return ModelRef(name=path.parent.name, path=str(path), checksum="", metrics={})


@pytest.fixture(scope="module")
def hopper(make_test_dataset, tmp_path_factory: pytest.TempPathFactory) -> Hopper:
    root = tmp_path_factory.mktemp("diagnostics")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFAUG_CACHE_DIR", str(root / "cache"))
        dataset_id = make_test_dataset("hopper", "hdf5").dataset_id
        data = load_transitions(dataset_id)
    ref = DatasetRef(
        source=dataset_id,
        rows=len(data),
        episodes=data.num_episodes,
        identity="test",
        has_simulator_state=False,
        meta=dict(data.meta),
    )
    bc = _checkpoint(
        "bc", data, root / "bc" / "checkpoint.pt", {"policy": "gaussian", "hidden": (32, 32)}
    )
    critic = None
    if "cql" in registry.available():
        critic = _checkpoint(
            "cql", data, root / "cql-original" / "checkpoint.pt", {"hidden": (32, 32)}
        )
    return Hopper(data, ref, bc, critic, root)


def _augmented(transitions: Transitions, directory: Path, **params: Any) -> AugmentedRef:
    shard_set = write_shard_set(
        transitions, directory, rows_per_shard=max(1, len(transitions) // 2), params=params
    )
    return AugmentedRef(
        directory=shard_set.directory,
        rows=shard_set.rows,
        episodes=shard_set.episodes,
        shards=len(shard_set.shards),
        manifest_checksum="",
        weight_stats={},
        faults=0,
    )


def _plain(data: Transitions) -> Transitions:
    """The original rows as augmented data: every weight exactly 1, no log-probabilities."""
    return Transitions(
        observations=np.array(data.observations),
        actions=np.array(data.actions),
        rewards=np.array(data.rewards),
        next_observations=np.array(data.next_observations),
        terminals=np.array(data.terminals),
        timeouts=np.array(data.timeouts),
        episode_ids=np.array(data.episode_ids),
        importance_weight=np.ones(len(data), dtype=np.float32),
        meta=dict(data.meta),
    )


def _noise(data: Transitions, seed: int = 0) -> Transitions:
    """Pure noise: states uniform far outside the data, random actions, log-normal weights."""
    rng = np.random.default_rng(seed)
    n = len(data)
    scale = np.abs(np.asarray(data.observations)).max()
    observations = rng.uniform(5 * scale, 50 * scale, size=data.observations.shape)
    signs = rng.choice([-1.0, 1.0], size=observations.shape)
    observations = (observations * signs).astype(np.float32)
    log_ratio = rng.normal(0.0, 4.0, size=n)
    return Transitions(
        observations=observations,
        actions=rng.uniform(-1, 1, size=data.actions.shape).astype(np.float32),
        rewards=rng.normal(size=n).astype(np.float32),
        next_observations=observations,
        terminals=np.array(data.terminals),
        timeouts=np.array(data.timeouts),
        episode_ids=np.array(data.episode_ids),
        rollout_log_prob=np.zeros(n, dtype=np.float32),
        behaviour_log_prob=log_ratio.astype(np.float32),
        importance_weight=np.exp(np.minimum(log_ratio, math.log(NOISE_CLIP))).astype(np.float32),
        meta=dict(data.meta),
    )


# -- importance weights ---------------------------------------------------------------------------


def test_effective_sample_size_formula() -> None:
    assert diag.effective_sample_size([1.0, 1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert diag.effective_sample_size([1.0, 0.0, 0.0, 0.0]) == pytest.approx(1.0)
    assert diag.effective_sample_size([2.0, 1.0, 1.0]) == pytest.approx(16.0 / 6.0)
    # Scale-free, and the log form agrees without overflowing.
    weights = np.random.default_rng(0).lognormal(0.0, 2.0, size=1000)
    assert diag.effective_sample_size(7.0 * weights) == pytest.approx(
        diag.effective_sample_size(weights)
    )
    assert diag.effective_sample_size_from_logs(np.log(weights) + 900.0) == pytest.approx(
        diag.effective_sample_size(weights)
    )
    assert diag.effective_sample_size([]) == 0.0


def test_weight_summary_counts_clipping_from_raw_log_ratios() -> None:
    raw = np.log([0.5, 1.0, 200.0, 1000.0])
    summary = diag.weight_summary(np.exp(np.minimum(raw, math.log(100.0))), raw, 100.0)
    assert summary["clipped_fraction"] == 0.5
    assert summary["n"] == 4
    assert diag.weight_summary(np.ones(3), None, 100.0)["clipped_fraction"] is None


def test_episode_weights_use_cumulative_log_ratio_at_episode_end() -> None:
    ids = np.array([0, 0, 0, 1, 1])
    ratio = np.array([0.1, -0.2, 0.3, 1.0, 2.0], dtype=np.float32)
    cumulative = np.array([0.1, -0.1, 0.2, 1.0, 3.0], dtype=np.float32)
    base = _transitions(ids, rollout_log_prob=np.zeros(5, np.float32), behaviour_log_prob=ratio)
    assert diag.episode_log_weights(base) == pytest.approx([0.2, 3.0], abs=1e-6)
    with_extra = dataclasses.replace(base, extras={"cumulative_log_ratio": cumulative})
    assert diag.episode_log_weights(with_extra) == pytest.approx([0.2, 3.0], abs=1e-6)


def _transitions(ids: np.ndarray, **optional: Any) -> Transitions:
    n = len(ids)
    observations = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    last = np.r_[ids[1:] != ids[:-1], True]
    return Transitions(
        observations=observations,
        actions=np.zeros((n, 1), dtype=np.float32),
        rewards=np.ones(n, dtype=np.float32),
        next_observations=observations + 1,
        terminals=last.copy(),
        timeouts=np.zeros(n, dtype=bool),
        episode_ids=ids.astype(np.int64),
        **optional,
    )


# -- state coverage -------------------------------------------------------------------------------


def test_identical_states_score_one_minus_quantile(hopper: Hopper) -> None:
    observations = np.asarray(hopper.data.observations)
    coverage = diag.state_coverage(
        observations,
        observations.copy(),
        k=5,
        quantile=0.95,
        max_states=10_000,
        rng=np.random.default_rng(0),
    )
    # Same states, same leave-one-out distances: exactly the share above the 0.95 quantile,
    # which is 0.05 up to the quantile's interpolation (tolerance 0.01 on ~800 states).
    assert coverage["ood_fraction"] == pytest.approx(0.05, abs=0.01)
    assert coverage["range_violation"]["any_dimension"] == 0.0


def test_fresh_states_from_the_same_distribution_score_one_minus_quantile() -> None:
    rng = np.random.default_rng(1)
    original = rng.normal(size=(3000, 4))
    augmented = rng.normal(size=(3000, 4))
    coverage = diag.state_coverage(
        original, augmented, k=5, quantile=0.9, max_states=3000, rng=np.random.default_rng(2)
    )
    # 0.1 expected; tolerance 0.03: about 5 binomial standard deviations plus the threshold's
    # own sampling error.
    assert coverage["ood_fraction"] == pytest.approx(0.1, abs=0.03)


def test_noise_states_are_out_of_distribution(hopper: Hopper) -> None:
    noise = _noise(hopper.data)
    coverage = diag.state_coverage(
        hopper.data.observations,
        noise.observations,
        k=5,
        quantile=0.95,
        max_states=2000,
        rng=np.random.default_rng(0),
    )
    assert coverage["ood_fraction"] > 0.99
    assert coverage["range_violation"]["any_dimension"] > 0.99
    assert min(coverage["range_violation"]["per_dimension"]) > 0.9


def test_knn_distances_leave_the_query_out() -> None:
    from scipy.spatial import cKDTree

    points = np.array([[0.0], [1.0], [3.0], [7.0]])
    tree = cKDTree(points)
    # k = 1: nearest *other* point for members, nearest point for a new query.
    assert diag.knn_distances(tree, 4, points, 1) == pytest.approx([1.0, 1.0, 2.0, 4.0])
    assert diag.knn_distances(tree, 4, np.array([[2.0]]), 1) == pytest.approx([1.0])


# -- returns and value ----------------------------------------------------------------------------


def test_monte_carlo_returns_on_hand_made_episodes() -> None:
    rewards = [1.0, 2.0, 3.0, 4.0, 5.0]
    ids = [0, 0, 0, 1, 1]
    returns = diag.discounted_returns(rewards, ids, 0.5)
    assert returns == pytest.approx([1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3, 4 + 0.5 * 5, 5])
    assert diag.steps_to_end(ids).tolist() == [2, 1, 0, 1, 0]
    # Episode 0 terminated: complete. Episode 1 was cut by a timeout with fewer than
    # 3 / (1 - gamma) = 6 steps left: incomplete.
    complete = diag.complete_returns([False, False, True, False, False], ids, 0.5)
    assert complete.tolist() == [True, True, True, False, False]


def test_monte_carlo_returns_match_a_python_loop(hopper: Hopper) -> None:
    data = hopper.data
    fast = diag.discounted_returns(data.rewards, data.episode_ids, 0.9)
    slow = np.zeros(len(data))
    for start, stop in zip(data.episode_bounds()[:-1], data.episode_bounds()[1:], strict=True):
        following = 0.0
        for t in range(stop - 1, start - 1, -1):
            following = float(data.rewards[t]) + 0.9 * following
            slow[t] = following
    assert fast == pytest.approx(slow, rel=1e-6)


def test_constant_critic_shows_a_positive_gap(hopper: Hopper) -> None:
    data = hopper.data
    mc = diag.discounted_returns(data.rewards, data.episode_ids, 0.99)
    assert mc.max() < 100.0

    def critic(observations: np.ndarray, actions: np.ndarray) -> np.ndarray:
        return np.full(len(observations), 100.0, dtype=np.float32)

    q = diag.batched_q(critic, data.observations, data.actions)
    gap = diag.value_gap(q, mc)
    assert gap["gap_mean"] > 0
    assert gap["sign"] == "over"
    assert gap["overestimated_fraction"] == 1.0
    assert gap["gap_mean"] == pytest.approx(100.0 - mc.mean())
    random = diag.random_action_gap(
        critic, data.observations, data.actions, np.zeros_like(data.actions)
    )
    assert random["difference"] == 0.0


# -- off-policy evaluation ------------------------------------------------------------------------


def test_wpdis_on_policy_is_the_mean_discounted_return() -> None:
    rng = np.random.default_rng(0)
    lengths = [3, 7, 1, 5]
    ids = np.repeat(np.arange(4), lengths)
    rewards = rng.normal(size=len(ids))
    result = diag.weighted_per_decision_is(rewards, ids, np.zeros(len(ids)), 0.9)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    truth = diag.discounted_returns(rewards, ids, 0.9)[starts].mean()
    assert result["estimate"] == pytest.approx(truth)
    assert result["ess_fraction"] == pytest.approx(1.0)
    # One episode with an overwhelming weight: WPDIS becomes that episode's return.
    log_ratio = np.where(ids == 1, 50.0, 0.0)
    heavy = diag.weighted_per_decision_is(rewards, ids, log_ratio, 0.9)
    episode = diag.discounted_returns(rewards, ids, 0.9)[starts[1]]
    assert heavy["estimate"] == pytest.approx(episode, rel=1e-6)


def test_fqe_recovers_one_step_values() -> None:
    rng = np.random.default_rng(0)
    n = 2000
    observations = rng.normal(size=(n, 3)).astype(np.float32)
    actions = rng.uniform(-1, 1, size=(n, 1)).astype(np.float32)
    rewards = 2.0 + observations[:, 0] + 0.5 * actions[:, 0]
    settings = dataclasses.replace(FAST, fqe_steps=400)
    # Every step terminates: Q(s, a) = r(s, a), and the start value is E[r(s0, pi(s0))].
    starts = observations[:200]
    policy = np.full((200, 1), 0.5, dtype=np.float32)
    value = diag.fitted_q_evaluation(
        observations,
        actions,
        rewards,
        observations,
        actions,
        np.ones(n, dtype=bool),
        starts,
        policy,
        gamma=0.99,
        settings=settings,
        seed=0,
    )
    truth = float(np.mean(2.0 + starts[:, 0] + 0.25))
    assert value == pytest.approx(truth, abs=0.15)


# -- policy divergence ----------------------------------------------------------------------------


def _known_behaviour(sigma: float) -> diag.BehaviourModel:
    def parameters(observations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mean = np.tanh(observations[:, :2].astype(np.float64))
        return mean, np.full_like(mean, math.log(sigma))

    return diag.BehaviourModel(parameters, diag.ActionSpace.box([-2.0, -2.0], [2.0, 2.0]))


def test_divergence_of_the_behaviour_mean_and_of_noisy_rollouts() -> None:
    from offaug.pipeline.noise import truncnorm_log_prob

    rng = np.random.default_rng(0)
    behaviour = _known_behaviour(0.3)
    states = rng.normal(size=(500, 3)).astype(np.float32)
    mean, _ = behaviour.parameters(states)
    mean_actions = behaviour.actions.denormalise(mean)
    dataset_actions = behaviour.actions.denormalise(np.clip(mean + 0.1, -1, 1))
    entry = diag.policy_divergence(behaviour, states, dataset_actions, mean_actions)
    expected = -np.mean(truncnorm_log_prob(mean, mean, 0.3))
    assert entry["nll"] == pytest.approx(expected, rel=1e-6)
    assert entry["action_distance"] == pytest.approx(np.linalg.norm([0.1, 0.1]), rel=0.05)
    # A rollout with exactly beta_hat's noise has KL 0; a wider one has a positive KL.
    same = diag._rollout_divergence(behaviour, states, dataset_actions, "gaussian:0.3", rng)
    assert same["kl_monte_carlo"] == pytest.approx(0.0, abs=1e-9)
    wide = diag._rollout_divergence(behaviour, states, dataset_actions, "gaussian:0.9", rng)
    assert wide["kl_monte_carlo"] > 0.1


def test_action_space_round_trip_and_distance() -> None:
    space = diag.ActionSpace.box([0.0, -4.0], [2.0, 4.0])
    actions = np.array([[0.0, -4.0], [2.0, 4.0], [1.0, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(space.normalise(actions), [[-1, -1], [1, 1], [0, 0]])
    np.testing.assert_allclose(space.denormalise(space.normalise(actions)), actions)
    assert space.distance(actions[:1], actions[1:2]) == pytest.approx([math.sqrt(8)])
    discrete = diag.ActionSpace(True, np.zeros(0), np.zeros(0), 3)
    assert discrete.distance(np.array([0, 1]), np.array([0, 2])).tolist() == [0.0, 1.0]
    assert discrete.features(np.array([2])).tolist() == [[0.0, 0.0, 1.0]]


# -- ranking --------------------------------------------------------------------------------------


def test_rank_results_orders_by_return_then_success() -> None:
    results = [
        {"name": "a", "mean_return": 1.0, "success_rate": 1.0, "mean_length": 10.0},
        {"name": "b", "mean_return": 5.0, "success_rate": 0.0, "mean_length": 3.0},
        {"name": "c", "mean_return": 5.0, "success_rate": 0.5, "mean_length": 3.0},
    ]
    ranked = diag.rank_results(results)
    assert [r["name"] for r in ranked] == ["c", "b", "a"]
    assert ranked[0]["rank_by"] == {"return": 1, "success": 2, "length": 2}
    assert ranked[2]["rank_by"] == {"return": 3, "success": 1, "length": 1}


def test_rank_checkpoints_sequential_and_on_dask_agree(hopper: Hopper) -> None:
    checkpoints = [hopper.bc.path] + ([hopper.critic.path] if hopper.critic else [])
    sequential = diag.rank_checkpoints(checkpoints, hopper.ref.meta, episodes=2, seeds=[0, 100])
    assert len(sequential) == len(checkpoints)
    returns = [r["mean_return"] for r in sequential]
    assert returns == sorted(returns, reverse=True)
    assert [r["rank"] for r in sequential] == list(range(1, len(checkpoints) + 1))

    from distributed import Client

    with Client(
        processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0"
    ) as client:
        parallel = diag.rank_checkpoints(
            checkpoints, hopper.ref.meta, episodes=2, seeds=[0, 100], client=client
        )
    assert parallel == sequential


# -- the stage ------------------------------------------------------------------------------------


def test_identical_augmented_data_has_full_ess_and_expected_ood(
    hopper: Hopper, tmp_path: Path
) -> None:
    augmented = _augmented(_plain(hopper.data), tmp_path / "identical")
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
    augmented = _augmented(_noise(hopper.data), tmp_path / "noise", max_weight=NOISE_CLIP)
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
    assert result["data"]["augmented"] is None
    assert "rollout" not in result["divergence"]["policies"]
    assert result["data"]["effective_horizon"] == pytest.approx(100.0)


def test_diagnose_run_reads_the_run_records(hopper: Hopper, tmp_path: Path) -> None:
    from offaug.pipeline.report import report_run

    run = tmp_path / "run"
    run.mkdir()
    augmented = _augmented(_plain(hopper.data), run / "shards" / "augmented")
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
    bc = _checkpoint("bc", data, tmp_path / "bc" / "checkpoint.pt", {"hidden": (32, 32)})
    models = []
    if "discrete_cql" in registry.available():
        path = tmp_path / "discrete_cql-original" / "checkpoint.pt"
        models.append(_checkpoint("discrete_cql", data, path, {"hidden": (32, 32)}))
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
