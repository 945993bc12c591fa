"""Rollout throughput: offaug's full rollout against a raw env loop and Minari's DataCollector.

offaug's side is everything a rollout task does: a batched BC policy call per step, noise,
both log-probabilities, importance weights and the shard write. Baselines, in the same process,
one core (torch uses one thread):

* ``env_loop``: a plain Gymnasium ``env.step(env.action_space.sample())`` loop with resets;
* ``minari.DataCollector`` recording the same env driven by the same BC policy (one policy
  call per step, as a collector is used), then ``create_dataset``.

And the rollout algorithm's search in a learned ensemble (``backend: model`` with
``rollout.lookahead``): offaug's (every candidate of a search step in one ensemble call,
``ModelEnv.step_batch``) against the same search stepping each candidate alone
(``ModelEnv.step``, as any gymnasium env is stepped), the same model, policy and seed, so both
make the same model steps.

Usage: ``python benchmarks/bench_rollout.py [--quick]``; JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Reporter,
    interleave_many,
    log,
    protect_stdout,
    scratch_dir,
    throughput_record,
)


def _bc_checkpoint(workdir: Path, env_id: str) -> Path:
    """A small Gaussian BC policy trained briefly on random data of ``env_id``."""
    import gymnasium as gym
    import numpy as np

    from offaug.algorithms.base import Spaces, save_checkpoint
    from offaug.algorithms.batch import TorchBatch
    from offaug.algorithms.learners.bc import BC, BCConfig

    env = gym.make(env_id)
    obs_dim = int(np.prod(env.observation_space.shape))
    act_dim = int(np.prod(env.action_space.shape))
    spaces = Spaces(
        obs_dim,
        act_dim,
        action_low=tuple(map(float, env.action_space.low)),
        action_high=tuple(map(float, env.action_space.high)),
    )
    config = BCConfig(hidden=(256, 256))
    trainer = BC(spaces, config, device="cpu")
    import torch

    rng = np.random.default_rng(0)
    for _ in range(50):
        batch = TorchBatch(
            observations=torch.as_tensor(rng.normal(size=(256, obs_dim)).astype(np.float32)),
            actions=torch.as_tensor(rng.uniform(-1, 1, size=(256, act_dim)).astype(np.float32)),
            rewards=torch.zeros(256),
            next_observations=torch.zeros(256, obs_dim),
            terminals=torch.zeros(256),
            timeouts=torch.zeros(256),
            weights=torch.ones(256),
        )
        trainer.update(batch)
    return save_checkpoint(
        workdir / f"bc-{env_id}.pt",
        algorithm="bc",
        config=config,
        spaces=spaces,
        state=trainer.state_dict(),
    )


def _offaug_rollout(
    env_id: str, checkpoint: Path, episodes: int, max_steps: int | None, workdir: Path
) -> tuple[float, int]:
    import gymnasium as gym

    from offaug.algorithms.training.checkpoints import load_trainer
    from offaug.datasets.shards import write_shard
    from offaug.pipeline.rollouts.config import RolloutConfig
    from offaug.pipeline.rollouts.noise import parse_noise
    from offaug.pipeline.rollouts.policies import BCRolloutPolicy
    from offaug.pipeline.rollouts.simulator import rollout

    policy = BCRolloutPolicy(load_trainer(checkpoint, device="cpu"))
    kwargs = {"max_episode_steps": max_steps} if max_steps else {}
    config = RolloutConfig(
        episodes=episodes, n_envs=min(32, episodes), noise=parse_noise("gaussian:0.1"), seed=0
    )
    envs = [gym.make(env_id, **kwargs) for _ in range(config.n_envs)]
    pool = iter(envs)
    start = time.perf_counter()
    result = rollout(policy, lambda: next(pool), config)
    write_shard(result.transitions, workdir / "rollout.arrow")
    return time.perf_counter() - start, len(result.transitions)


def _env_loop(env_id: str, steps: int, max_steps: int | None) -> float:
    import gymnasium as gym

    kwargs = {"max_episode_steps": max_steps} if max_steps else {}
    env = gym.make(env_id, **kwargs)
    env.reset(seed=0)
    env.action_space.seed(0)
    start = time.perf_counter()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()
    return time.perf_counter() - start


def _data_collector(
    env_id: str, checkpoint: Path, steps: int, max_steps: int | None, root: Path
) -> float:
    import gymnasium as gym
    import minari
    import numpy as np

    from offaug.algorithms.training.checkpoints import load_trainer

    trainer = load_trainer(checkpoint, device="cpu")
    rng = np.random.default_rng(0)
    kwargs = {"max_episode_steps": max_steps} if max_steps else {}
    env = minari.DataCollector(gym.make(env_id, **kwargs), record_infos=False)
    observation, _ = env.reset(seed=0)
    start = time.perf_counter()
    done_steps = 0
    while done_steps < steps:
        action = trainer.act(np.asarray(observation, dtype=np.float32)[None])[0]
        action = np.clip(action + 0.1 * rng.normal(size=action.shape), -1, 1).astype(np.float32)
        observation, _, terminated, truncated, _ = env.step(action)
        done_steps += 1
        if terminated or truncated:
            observation, _ = env.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import os

        os.environ["MINARI_DATASETS_PATH"] = str(root)
        env.create_dataset(
            dataset_id=f"bench/collector-{time.time_ns()}-v0",
            algorithm_name="bench",
            author="offaug",
            author_email="x@y.z",
            code_permalink="none",
            description="bench",
        )
    elapsed = time.perf_counter() - start
    env.close()
    return elapsed


def _measure(
    case: dict[str, Any], quick: bool, repeats: int, workdir: Path, reporter: Reporter
) -> None:
    env_id: str = case["env"]
    max_steps = case["max_steps"]
    checkpoint = _bc_checkpoint(workdir, env_id)
    # Enough episodes that every batched policy call serves many environments.
    episodes = (120 if quick else 600) if case["short"] else (16 if quick else 32)
    # The baselines' step budget is what the rollout produces.
    _, steps = _offaug_rollout(env_id, checkpoint, episodes, max_steps, workdir)
    log(f"{env_id}: {episodes} episodes = {steps} steps per measurement")
    times = interleave_many(
        {
            "offaug": lambda: _offaug_rollout(env_id, checkpoint, episodes, max_steps, workdir)[0],
            "env_loop": lambda: _env_loop(env_id, steps, max_steps),
            "collector": lambda: _data_collector(
                env_id, checkpoint, steps, max_steps, workdir / "minari"
            ),
        },
        repeats,
    )
    size = {"env": env_id, "steps": steps, "episodes": episodes, "n_envs": min(32, episodes)}
    env_loop_rate = steps / sorted(times["env_loop"])[len(times["env_loop"]) // 2]
    reporter.emit(
        throughput_record(
            benchmark=f"rollout_vs_env_loop_{env_id}",
            unit="steps/s",
            work=steps,
            offaug_times=times["offaug"],
            baseline_times=times["env_loop"],
            baseline_name="gymnasium env.step(action_space.sample()) loop",
            goal=0.9,
            size=size,
            notes=(
                "offaug: batched BC policy (256x256), truncated-Gaussian noise, both "
                "log-probs, weights, shard write; one core, torch and BLAS on 1 thread. "
                "Episode lengths differ (BC policy vs random actions), so resets differ too."
            ),
            absolute={"env_loop_steps_per_s": env_loop_rate},
        )
    )
    reporter.emit(
        throughput_record(
            benchmark=f"rollout_vs_data_collector_{env_id}",
            unit="steps/s",
            work=steps,
            offaug_times=times["offaug"],
            baseline_times=times["collector"],
            baseline_name="minari.DataCollector + BC policy per step + create_dataset",
            goal=case["goal_collector"],
            size=size,
            notes="same env, same BC policy and Gaussian noise; the collector records no infos",
        )
    )


def _measure_model_lookahead(quick: bool, repeats: int, workdir: Path, reporter: Reporter) -> None:
    import itertools

    import numpy as np

    from offaug.algorithms.training.checkpoints import load_trainer
    from offaug.datasets import load_transitions
    from offaug.datasets.generate import make_dataset
    from offaug.datasets.transitions import CONTROL_STATE_KEY
    from offaug.pipeline.models.dynamics import DynamicsConfig, train_dynamics
    from offaug.pipeline.rollouts.config import Lookahead, RolloutConfig
    from offaug.pipeline.rollouts.env_state import STATE_KINDS, StartStates
    from offaug.pipeline.rollouts.lookahead import lookahead_rollout
    from offaug.pipeline.rollouts.model_rollouts import ModelEnv, model_lookahead_rollout
    from offaug.pipeline.rollouts.noise import parse_noise
    from offaug.pipeline.rollouts.policies import BCRolloutPolicy

    class OneByOne(ModelEnv):
        """The baseline's env: the search finds no ``step_batch`` and steps it alone."""

        step_batch = None  # type: ignore[assignment]

        def step(self, action: Any) -> Any:
            outcome = ModelEnv.step_batch([self], np.asarray(action).reshape(1, -1))[0]
            if isinstance(outcome, Exception):
                raise outcome
            return (*outcome, False, {})

    env_id = "Hopper-v5"
    made = make_dataset(
        env_id,
        "bench/hopper-random-v0",
        episodes=40,
        seed=7,
        max_episode_steps=30,
        root=workdir / "minari-model",
    )
    data = load_transitions(made.path)
    # The model backend's default sizes, trained briefly: speed does not depend on its quality.
    model, _ = train_dynamics(data, DynamicsConfig(steps=200, horizon=5, seed=0))
    policy = BCRolloutPolicy(load_trainer(_bc_checkpoint(workdir, env_id), device="cpu"))
    starts = np.asarray(data.observations, dtype=np.float32)
    episodes = 8 if quick else 32
    config = RolloutConfig(
        episodes=episodes,
        n_envs=episodes,
        noise=parse_noise("gaussian:0.3"),
        seed=0,
        horizon=50,
        lookahead=Lookahead(candidates=8, window=5, depth=30),
    )
    # What model_lookahead_rollout runs the search with: dataset starts, bounds exits as faults.
    search = dataclasses.replace(config, start="dataset", max_faults=sys.maxsize)
    control = next(kind for kind in STATE_KINDS if kind.name == "control")
    steps: dict[str, int] = {}

    def batched() -> float:
        start = time.perf_counter()
        result = model_lookahead_rollout(model, policy, config, starts)
        elapsed = time.perf_counter() - start
        steps["batched"] = int(result.transitions.meta["model_steps"])
        return elapsed

    def one_by_one() -> float:
        counter = itertools.count()
        start_states = StartStates(control, {CONTROL_STATE_KEY: starts.astype(np.float64)})
        start = time.perf_counter()
        result = lookahead_rollout(
            policy,
            lambda: OneByOne(model, starts, None, config.seed * 1009 + next(counter)),
            search,
            start_states=start_states,
        )
        elapsed = time.perf_counter() - start
        steps["one_by_one"] = result.simulator_steps
        return elapsed

    times = interleave_many({"batched": batched, "one_by_one": one_by_one}, repeats)
    if steps["batched"] != steps["one_by_one"]:
        raise RuntimeError(f"the two searches made different model steps: {steps}")
    reporter.emit(
        throughput_record(
            benchmark=f"model_lookahead_batched_{env_id}",
            unit="model steps/s",
            work=steps["batched"],
            offaug_times=times["batched"],
            baseline_times=times["one_by_one"],
            baseline_name="the same search, each candidate stepped alone (ModelEnv.step)",
            goal=None,
            size={
                "env": env_id,
                "episodes": episodes,
                "horizon": 50,
                "candidates": 8,
                "window": 5,
                "depth": 30,
                "model_steps": steps["batched"],
            },
            notes="the model backend's default ensemble; BC policy (256x256); one core",
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="about a minute")
    args = parser.parse_args(argv)
    out = protect_stdout()
    reporter = Reporter(out)
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    cases: list[dict[str, Any]] = [
        {"env": "Hopper-v5", "max_steps": None, "short": True, "goal_collector": 2.0},
        {"env": "HalfCheetah-v5", "max_steps": None, "short": False, "goal_collector": 1.25},
    ]
    repeats = 3 if args.quick else 5
    with scratch_dir("rollout-") as workdir:
        for case in cases:
            _measure(case, args.quick, repeats, workdir, reporter)
        _measure_model_lookahead(args.quick, repeats, workdir, reporter)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
