"""Filters against the rollout policy's own reference, on real envs and real Minari datasets.

``filter: policy`` keeps a noisy episode only when it beats the noiseless policy from the same
start; ``filter: value`` keeps a branch only when its return bootstrapped with the learner's V
beats the data's return-to-go from its start row. Every reference here is computed again
independently: a fresh environment, the recorded reset seed and dataset state, a plain loop.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import yaml
from pydantic import ValidationError

from offaug.algorithms.evaluate import make_env
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import Transitions, load_transitions
from offaug.pipeline.contracts import FilterRecord, ModelRef
from offaug.pipeline.rollouts.config import RolloutConfig
from offaug.pipeline.rollouts.env_state import (
    StartStates,
    dataset_start_states,
    load_with_states,
    set_state,
)
from offaug.pipeline.rollouts.noise import parse_noise
from offaug.pipeline.rollouts.policies import load_rollout_policy
from offaug.pipeline.rollouts.tasks import rollout_to_shard_set
from offaug.pipeline.schema.rollout_section import RolloutModel
from offaug.pipeline.schema.sections import BCConfigModel, SourceConfig
from offaug.pipeline.schema.validation import WorkflowError
from offaug.pipeline.schema.workflow import load_workflow
from offaug.pipeline.stages import learning as stages
from offaug.pipeline.stages import rollouts as rollout_stages


def _train(algorithm: str, dataset_id: str, out: Path, steps: int) -> Path:
    config: dict[str, Any] = {"hidden": (32, 32)}
    if algorithm != "bc":
        config["batch_size"] = 64
    run = train(
        algorithm,
        [dataset_id],
        out,
        config=config,
        options=TrainOptions(steps=steps, eval_every=0, log_every=steps, checkpoint_every=steps),
    )
    return run.checkpoint


def _noiseless_return(
    act: Any,
    meta: dict[str, Any],
    seed: int,
    row: int,
    states: StartStates | None,
    limit: int,
) -> float:
    """The return of ``act`` (environment actions) from ``reset(seed)`` and dataset ``row``."""
    env = make_env(meta)
    obs, _ = env.reset(seed=seed)
    if row >= 0:
        assert states is not None
        obs = set_state(env, states.kind, states.row(row))
    total = 0.0
    for _ in range(limit):
        action = act(np.asarray(obs, dtype=np.float32)[None])[0]
        obs, reward, terminated, truncated, _ = env.step(action)
        total += float(np.float32(reward))
        if terminated or truncated:
            break
    env.close()
    return total


def _records(outcome: Any) -> list[FilterRecord]:
    records = [task.filter_record for task in outcome.tasks]
    assert all(record is not None for record in records)
    return records


def test_self_improvement_keeps_only_episodes_that_beat_the_noiseless_policy(
    make_test_dataset, tmp_path: Path
) -> None:
    made = make_test_dataset("pendulum", "hdf5")
    checkpoint = _train("bc", made.dataset_id, tmp_path / "bc", steps=60)
    config = RolloutConfig(
        episodes=8, n_envs=3, noise=parse_noise("gaussian:0.3"), seed=5, horizon=25, filter="policy"
    )
    outcome = rollout_to_shard_set(made.dataset_id, checkpoint, config, tmp_path / "aug", tasks=2)
    records = _records(outcome)
    meta = load_transitions(made.dataset_id).meta
    bc = load_rollout_policy(str(checkpoint))

    def mean_action(observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        return bc.to_env(bc(observations)[0])  # the Gaussian's mean, no noise

    kept_scores, kept_references = [], []
    for record in records:
        assert all(row == -1 for row in record.start_rows)  # resets
        assert len(set(record.reset_seeds)) == len(record.reset_seeds)
        for score, reference, kept, seed in zip(
            record.scores, record.references, record.kept, record.reset_seeds, strict=True
        ):
            independent = _noiseless_return(mean_action, meta, seed, -1, None, limit=25)
            assert reference == pytest.approx(independent, abs=1e-3)
            assert kept == (score > reference)
            if kept:
                kept_scores.append(score)
                kept_references.append(independent)
    # Each reset seed is its own start, so the references differ.
    assert len({round(r, 3) for record in records for r in record.references}) > 1
    # The shard set holds exactly the kept episodes, each better than its own reference.
    returns = outcome.shard_set.load().episode_returns()
    np.testing.assert_allclose(returns, kept_scores, rtol=1e-6)
    assert all(r > ref - 1e-3 for r, ref in zip(returns, kept_references, strict=True))
    counts = outcome.shard_set.params["filter_counts"]
    assert counts["kept"] == len(returns) and counts["kept"] + counts["dropped"] == 8
    assert counts["dropped"] > 0  # noise around a smooth policy mostly costs reward
    summary = outcome.shard_set.params["filter_references"]
    assert summary["missing_references"] == 0
    if kept_scores:
        assert summary["kept_improvement"] > 0


def _best_of_four(
    make_test_dataset: Any, tmp_path: Path, episodes: int, keep_reference: bool
) -> tuple[Any, Path, Any]:
    """A 60-step clone on Pendulum rolled out under ``filter: policy``, ``tries: 4``, in two
    tasks of horizon 25: the dataset, the clone's checkpoint and the outcome."""
    made = make_test_dataset("pendulum", "hdf5")
    checkpoint = _train("bc", made.dataset_id, tmp_path / "bc", steps=60)
    config = RolloutConfig(
        episodes=episodes,
        n_envs=3,
        noise=parse_noise("gaussian:0.5"),
        seed=5,
        horizon=25,
        filter="policy",
        tries=4,
        keep_reference=keep_reference,
    )
    outcome = rollout_to_shard_set(made.dataset_id, checkpoint, config, tmp_path / "aug", tasks=2)
    return made, checkpoint, outcome


def test_tries_keep_the_best_of_each_start_where_it_beats_the_noiseless_policy(
    make_test_dataset, tmp_path: Path
) -> None:
    """``tries: 4``: four noisy episodes from one reset seed share one reference; only the
    best of them stays, and only when it beats that reference."""
    _, _, outcome = _best_of_four(make_test_dataset, tmp_path, episodes=12, keep_reference=False)
    kept_scores = []
    for record in _records(outcome):
        groups: dict[int, list[int]] = {}
        for index, seed in enumerate(record.reset_seeds):
            groups.setdefault(seed, []).append(index)
        assert sorted(len(g) for g in groups.values()) == [2, 4]  # 6 episodes: starts of 4, 2
        for members in groups.values():
            references = {round(record.references[i], 4) for i in members}
            assert len(references) == 1  # one start, one noiseless reference
            scores = [record.scores[i] for i in members]
            assert len({round(v, 4) for v in scores}) == len(scores)  # each try its own noise
            best = members[int(np.argmax(scores))]
            for i in members:
                assert record.kept[i] == (i == best and record.scores[i] > record.references[i])
            kept_scores += [record.scores[i] for i in members if record.kept[i]]
    returns = outcome.shard_set.load().episode_returns() if kept_scores else []
    np.testing.assert_allclose(returns, kept_scores, rtol=1e-6)
    assert outcome.shard_set.params["tries"] == 4
    # Per task: 6 noisy episodes and 2 references (one per start), all of horizon 25.
    assert [task.simulator_steps for task in outcome.tasks] == [(6 + 2) * 25] * 2
    with pytest.raises(ValidationError, match="tries is the simulator backend's"):
        RolloutModel(backend="model", tries=2)


def test_keep_reference_makes_the_first_try_the_noiseless_policy_and_keeps_every_start(
    make_test_dataset, tmp_path: Path
) -> None:
    """``keep_reference``: the first try of each start is the noiseless policy (its return is
    the reference, rolled out once as an episode); every start keeps exactly one episode, the
    reference itself unless a noisy try beats it."""
    made, checkpoint, outcome = _best_of_four(
        make_test_dataset, tmp_path, episodes=16, keep_reference=True
    )
    meta = load_transitions(made.dataset_id).meta
    bc = load_rollout_policy(str(checkpoint))

    def mean_action(observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        return bc.to_env(bc(observations)[0])

    kept_scores, kept_references, beaten = [], [], 0
    for record in _records(outcome):
        groups: dict[int, list[int]] = {}
        for index, seed in enumerate(record.reset_seeds):
            groups.setdefault(seed, []).append(index)
        assert sorted(len(g) for g in groups.values()) == [4, 4]  # 8 episodes a task: 2 starts
        for seed, members in groups.items():
            independent = _noiseless_return(mean_action, meta, seed, -1, None, limit=25)
            scores = [record.scores[i] for i in members]
            # One try of the four is the noiseless policy: its return is the reference.
            matches = [i for i in members if record.scores[i] == record.references[i]]
            assert len(matches) == 1
            assert record.references[members[0]] == pytest.approx(independent, abs=1e-3)
            assert len({round(v, 4) for v in scores}) == len(scores)  # the others are noisy
            best = members[int(np.argmax(scores))]
            assert [record.kept[i] for i in members] == [i == best for i in members]
            beaten += int(best != matches[0])
            kept_scores.append(record.scores[best])
            kept_references.append(independent)
    # Every start keeps one episode, never worse than the noiseless policy's from it.
    returns = outcome.shard_set.load().episode_returns()
    np.testing.assert_allclose(returns, kept_scores, rtol=1e-6)
    assert len(returns) == 4
    assert all(r >= ref - 1e-3 for r, ref in zip(returns, kept_references, strict=True))
    assert 0 < beaten < 4  # at this noise, some starts are improved on and some are not
    # No reference is rolled out beside the tries: 8 episodes of 25 steps a task.
    assert [task.simulator_steps for task in outcome.tasks] == [8 * 25] * 2
    assert outcome.shard_set.params["keep_reference"] is True
    data = outcome.shard_set.load()
    assert np.isfinite(np.asarray(data.rollout_log_prob)).all()
    with pytest.raises(ValidationError, match="keep_reference needs filter 'policy'"):
        RolloutModel(filter="data", tries=4, keep_reference=True)
    with pytest.raises(ValidationError, match="keep_reference needs filter 'policy'"):
        RolloutModel(filter="policy", keep_reference=True)


def test_self_improvement_branches_compare_with_the_same_restored_state(
    make_test_dataset, tmp_path: Path
) -> None:
    made = make_test_dataset("hopper", "hdf5")
    checkpoint = _train("bc", made.dataset_id, tmp_path / "bc", steps=30)
    config = RolloutConfig(
        episodes=6,
        n_envs=3,
        noise=parse_noise("gaussian:0.2"),
        seed=4,
        start="dataset",
        horizon=10,
        filter="policy",
    )
    outcome = rollout_to_shard_set(made.dataset_id, checkpoint, config, tmp_path / "aug", tasks=1)
    (record,) = _records(outcome)
    data, _ = load_with_states(made.dataset_id)
    states = dataset_start_states(data)
    bc = load_rollout_policy(str(checkpoint))

    def mean_action(observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        return bc.to_env(bc(observations)[0])

    assert all(row >= 0 for row in record.start_rows)
    for score, reference, kept, seed, row in zip(
        record.scores,
        record.references,
        record.kept,
        record.reset_seeds,
        record.start_rows,
        strict=True,
    ):
        independent = _noiseless_return(mean_action, data.meta, seed, row, states, limit=10)
        assert reference == pytest.approx(independent, abs=1e-3)
        assert kept == (score > reference)
    # A kept branch starts at the observation of its recorded row: the reference's start.
    loaded = outcome.shard_set.load()
    firsts = loaded.observations[loaded.episode_bounds()[:-1]]
    rows = [row for row, kept in zip(record.start_rows, record.kept, strict=True) if kept]
    np.testing.assert_allclose(firsts, data.observations[rows], atol=1e-5)


@pytest.fixture(scope="module")
def pendulum_td3bc(make_test_dataset, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    made = make_test_dataset("pendulum", "hdf5")
    data = stages.prepare_source(SourceConfig(dataset=made.dataset_id))
    out = tmp_path_factory.mktemp("value")
    bc = stages.train_bc(
        data, BCConfigModel(steps=40, hidden=(32, 32), evaluation_episodes=0), str(out / "bc"), 0
    )
    checkpoint = _train("td3bc", made.dataset_id, out / "td3bc", steps=30)
    learner = ModelRef("td3bc-original", str(checkpoint), "", {})
    return data, bc, learner


def _data_returns_to_go(data: Transitions, values: Any, gamma: float) -> npt.NDArray[np.float64]:
    """Each row's discounted return to its episode's end, plus gamma^k V at a non-terminal end."""
    to_go = np.zeros(len(data))
    bounds = data.episode_bounds()
    for start, end in itertools.pairwise(bounds):
        last = end - 1
        running = 0.0
        if not data.terminals[last]:
            running = float(values(np.asarray(data.next_observations[last : last + 1]))[0])
        for row in range(last, start - 1, -1):
            running = float(data.rewards[row]) + gamma * running
            to_go[row] = running
    return to_go


def test_value_filtered_branches_beat_the_datas_return_to_go(
    pendulum_td3bc, tmp_path: Path
) -> None:
    data_ref, bc, learner_ref = pendulum_td3bc
    config = RolloutModel(
        policy="td3bc",
        episodes=10,
        tasks=2,
        n_envs=5,
        noise="gaussian:0.3",  # type: ignore[arg-type]
        start="dataset",
        horizon=20,  # half the data's episodes: a branch from a late row outlives the data there
        filter="value",
    )
    out = str(tmp_path / "aug")
    shards = [
        rollout_stages.rollout_shard(data_ref, bc, config, out, 3, i, learner_ref) for i in range(2)
    ]
    augmented = rollout_stages.merge_rollouts(shards, out, config)

    learner = load_trainer(learner_ref.path, device="cpu")
    gamma = float(learner.config.gamma)
    data = load_transitions(data_ref.source)
    to_go = _data_returns_to_go(data, learner.state_values, gamma)
    loaded = load_transitions(augmented.directory)
    bounds = loaded.episode_bounds()
    records = [shard.filter_record for shard in shards]
    kept_rows = [
        row
        for record in records
        if record is not None
        for row, kept in zip(record.start_rows, record.kept, strict=True)
        if kept
    ]
    assert len(kept_rows) == len(bounds) - 1 == augmented.episodes
    for (start, end), row in zip(itertools.pairwise(bounds), kept_rows, strict=True):
        rewards = loaded.rewards[start:end].astype(np.float64)
        length = end - start
        score = float(np.sum(rewards * gamma ** np.arange(length)))
        if not loaded.terminals[end - 1]:
            final = loaded.next_observations[end - 1 : end]
            score += gamma**length * float(learner.state_values(final)[0])
        assert score > to_go[row] - 1e-4
        # The branch starts at its row's state.
        np.testing.assert_allclose(loaded.observations[start], data.observations[row], atol=1e-5)
    for record in records:
        assert record is not None
        np.testing.assert_allclose(record.references, to_go[list(record.start_rows)], rtol=1e-5)
    metrics = augmented.metrics["filter"]
    assert metrics["kind"] == "value" and metrics["kept"] + metrics["dropped"] == 10
    # Branches from early rows face the data's long, costly return-to-go; from late rows its
    # short one: some pass and some do not.
    assert metrics["kept"] > 0 and metrics["dropped"] > 0
    assert metrics["references"]["missing_references"] == 0


def _workflow_file(tmp_path: Path, rollout: dict[str, Any]) -> Path:
    path = tmp_path / "workflow.yaml"
    document = {"name": "w", "source": {"dataset": "a/b-v0"}, "rollout": rollout}
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_the_filter_choices_validate_and_a_bad_one_is_named(tmp_path: Path) -> None:
    assert RolloutModel(filter="policy").filter == "policy"
    assert RolloutModel(filter="policy", start="dataset", horizon=5, rounds=2, policy="iql")
    value = RolloutModel(filter="value", start="dataset", horizon=5, policy="td3bc")
    assert value.filter == "value"
    assert RolloutModel(filter="policy", noise_calibration={"scales": [0.1]})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="filter"):
        RolloutModel(filter="better")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="filter 'value' needs start 'dataset'"):
        RolloutModel(filter="value", policy="td3bc")
    with pytest.raises(ValidationError, match="bc has none"):
        RolloutModel(filter="value", start="dataset")
    with pytest.raises(ValidationError, match="bcq has none"):
        RolloutModel(filter="value", start="dataset", policy="bcq")
    with pytest.raises(ValidationError, match="filter 'policy' needs backend 'simulator'"):
        RolloutModel(filter="policy", backend="model")
    with pytest.raises(WorkflowError) as info:
        load_workflow(_workflow_file(tmp_path, {"filter": "better"}))
    message = str(info.value)
    assert "rollout.filter" in message and "'policy'" in message and "'value'" in message
    with pytest.raises(WorkflowError, match=r"rollout\.policy 'bc'"):
        load_workflow(_workflow_file(tmp_path, {"filter": "value", "start": "dataset"}))
