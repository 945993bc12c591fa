"""The rollout stages: tasks of simulator or model rollouts, the dynamics model, the diffusion
model and its sample tasks, the merge.

Plain functions from small records and config to small records, as every stage in
:mod:`offaug.pipeline.stages.learning` (which the graph wires them from). ``policy_model`` is the
trained learner whose action the rollout noise is centred on (``rollout.policy``; None: the BC
policy's own action); beta_hat is always the BC checkpoint's density. Modules that import torch
are imported inside the stages that use them (see :mod:`offaug.pipeline.stages.learning`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from offaug.datasets.shards import file_checksum
from offaug.datasets.sources import load_transitions
from offaug.pipeline.contracts import AugmentedRef, DatasetRef, ModelRef, RolloutShard
from offaug.pipeline.rollouts.calibration import NoiseCalibration, calibrate_noise
from offaug.pipeline.rollouts.config import Lookahead, RolloutConfig
from offaug.pipeline.rollouts.data import sparsity, start_probabilities
from offaug.pipeline.rollouts.tasks import (
    RolloutTask,
    data_filter,
    filter_counts,
    filter_references,
    merge_rollout_shards,
    run_rollout_task,
    split_tasks,
    task_share,
)
from offaug.pipeline.schema.rollout_section import RolloutModel


def _rollout_config(
    data: DatasetRef, config: RolloutModel, seed: int, calibration: NoiseCalibration | None = None
) -> RolloutConfig:
    start = config.start if data.has_simulator_state else "reset"
    return RolloutConfig(
        episodes=config.episodes,
        simulator_steps=config.simulator_steps,
        n_envs=config.n_envs,
        noise=config.noise if calibration is None else calibration.noise,
        seed=seed,
        max_weight=config.max_weight,
        start=start,
        max_episode_steps=config.max_episode_steps,
        horizon=config.horizon,
        starts="uniform" if start == "reset" else config.starts,
        filter=config.filter,
        filter_margin=config.filter_margin,
        filter_tolerance=config.filter_tolerance,
        tries=config.tries,
        keep_reference=config.keep_reference,
        lookahead=None if config.lookahead is None else Lookahead(**config.lookahead.model_dump()),
    )


def rollout_tasks(
    data: DatasetRef,
    bc: ModelRef,
    config: RolloutModel,
    out: str,
    seed: int,
    policy_model: ModelRef | None = None,
    calibration: NoiseCalibration | None = None,
) -> list[RolloutTask]:
    """The rollout stage's tasks (references only), one shard each.

    ``policy_model``: the trained learner whose action the noise is centred on (``rollout.policy``
    names it; None: the BC policy's own action). ``calibration``: what
    :func:`calibrate_noise_stage` chose, in place of ``config.noise``.
    """
    return split_tasks(
        data.source,
        bc.path,
        _rollout_config(data, config, seed, calibration),
        out,
        config.tasks,
        env_id=config.env,
        learner=None if policy_model is None else policy_model.path,
    )


def rollout_shard(
    data: DatasetRef,
    bc: ModelRef,
    config: RolloutModel,
    out: str,
    seed: int,
    task_index: int,
    policy_model: ModelRef | None = None,
    calibration: NoiseCalibration | None = None,
) -> RolloutShard:
    """Task ``task_index`` of the rollout stage: roll out its episodes and write its shard."""
    tasks = rollout_tasks(data, bc, config, out, seed, policy_model, calibration)
    if task_index >= len(tasks):
        raise ValueError(f"rollout task {task_index} of {len(tasks)}: more tasks than episodes")
    return run_rollout_task(tasks[task_index])


def calibrate_noise_stage(
    data: DatasetRef,
    bc: ModelRef,
    config: RolloutModel,
    out: str,
    seed: int,
    policy_model: ModelRef | None = None,
) -> NoiseCalibration:
    """The noise every task of the rollout stage uses (``rollout.noise_calibration``), probed
    once on the first task's policy, env and filter (:func:`calibrate_noise`)."""
    if config.noise_calibration is None:
        raise ValueError("calibrate_noise_stage needs rollout.noise_calibration")
    task = rollout_tasks(data, bc, config, out, seed, policy_model)[0]
    return calibrate_noise(task, config.noise_calibration)


def train_dynamics_stage(data: DatasetRef, config: RolloutModel, out: str, seed: int) -> ModelRef:
    """Fit the learned-dynamics ensemble (rollout backend 'model')."""
    from offaug.datasets.sources import load_transitions
    from offaug.pipeline.models.dynamics import DynamicsConfig, save_dynamics, train_dynamics

    dyn = config.dynamics
    model, losses = train_dynamics(
        load_transitions(data.source),
        DynamicsConfig(
            members=dyn.members,
            hidden=tuple(dyn.hidden),
            steps=dyn.steps,
            horizon=dyn.horizon,
            penalty=dyn.penalty,
            penalty_coefficient=dyn.penalty_coefficient,
            mobile_samples=dyn.mobile_samples,
            seed=seed,
        ),
    )
    path = save_dynamics(model, out)
    return ModelRef(name="dynamics", path=str(path), checksum=file_checksum(path), metrics=losses)


def model_rollout_task(
    data: DatasetRef,
    bc: ModelRef,
    dynamics: ModelRef,
    config: RolloutModel,
    shard_path: str,
    task_index: int,
    seed: int,
    policy_model: ModelRef | None = None,
) -> RolloutShard:
    """One task of model rollouts from dataset states, written as one shard.

    Start states are drawn as ``rollout.starts`` says (uniform, sparse, or where the ensemble
    disagrees at the dataset action); ``policy_model`` is as for :func:`rollout_tasks`, and its
    own value is MOBILE's V(s') (``dynamics.penalty: mobile``). With ``rollout.lookahead`` the
    task builds its share of ``rollout.episodes`` by the search in the model
    (:func:`~offaug.pipeline.rollouts.model_rollouts.model_lookahead_rollout`), each at most
    ``rollout.horizon`` steps, in place of ``dynamics.starts`` noisy rollouts.
    """
    # torch comes with these: imported when the task runs, not when a worker unpickles stages.
    from offaug.datasets.shards import write_shard
    from offaug.pipeline.models.dynamics import load_dynamics
    from offaug.pipeline.rollouts.model_rollouts import model_lookahead_rollout, model_rollout
    from offaug.pipeline.rollouts.policies import load_rollout_policy

    original = load_transitions(data.source)
    model = load_dynamics(dynamics.path)
    model = _for_task(model, config, seed * 1000 + task_index)
    probabilities = None
    if config.starts == "sparse":
        probabilities = start_probabilities(sparsity(original.observations))
    elif config.starts == "disagreement":
        spread = model.disagreement(original.observations, original.actions)
        probabilities = start_probabilities(spread)
    policy = load_rollout_policy(bc.path, None if policy_model is None else policy_model.path)
    value = None
    bootstrap = config.lookahead is not None and config.lookahead.bootstrap
    if config.dynamics.penalty == "mobile" or bootstrap:
        if policy_model is None:
            what = "lookahead.bootstrap" if bootstrap else "dynamics.penalty 'mobile'"
            raise ValueError(f"{what} needs a learner as rollout.policy")
        value = policy.discounted_value()
    meta = {
        **data.meta,
        "provenance": {
            "source": data.source,
            "policy": bc.path,
            "policy_checkpoint_xxh3": bc.checksum,
            "learner": None if policy_model is None else policy_model.path,
            "dynamics": dynamics.path,
            "noise": config.noise.text,
            "seed": seed,
            "task_index": task_index,
        },
    }
    Path(shard_path).parent.mkdir(parents=True, exist_ok=True)
    if config.lookahead is not None:
        run = dataclasses.replace(
            _rollout_config(data, config, seed),
            episodes=task_share(config.episodes, config.tasks, task_index),
            seed=seed * 1000 + task_index,
        )
        searched = model_lookahead_rollout(
            model,
            policy,
            run,
            np.asarray(original.observations, dtype=np.float32),
            start_probabilities=probabilities,
            value=value,
            meta=meta,
        )
        return RolloutShard(
            write_shard(searched.transitions, shard_path),
            searched.weight_stats,
            len(searched.faults),
            tuple(searched.episode_returns),
            filter_record=searched.filter_record,
        )
    rng = np.random.default_rng(seed * 1000 + task_index)
    rows = rng.choice(len(original), size=config.dynamics.starts, p=probabilities)
    out = model_rollout(
        model,
        policy,
        np.asarray(original.observations[rows]),
        noise=config.noise,
        max_weight=config.max_weight,
        meta=meta,
        horizon=config.horizon,
        start_rows=rows.astype(np.int64),
        episode_filter=data_filter(original, config),
        value=value,
    )
    ref = write_shard(out, shard_path)
    returns = out.episode_returns()
    return RolloutShard(
        ref,
        dict(out.meta["weight_stats"]),
        0,
        tuple(float(r) for r in returns),
        int(out.meta["episodes_dropped"]),
    )


PER_100K = 100_000
"""The sample count the diffusion backend's costs are given for (seconds per 100k samples)."""


def diffusion_seed(config: RolloutModel, seed: int) -> int:
    """The diffusion backend's seed: ``rollout.diffusion.seed``, else the run's."""
    return seed if config.diffusion.seed is None else config.diffusion.seed


def train_denoiser_stage(data: DatasetRef, config: RolloutModel, out: str, seed: int) -> ModelRef:
    """Fit the diffusion model of the source's transitions (rollout backend 'diffusion').

    It trains on CUDA when the worker has it. Its metrics: ``train_loss``, ``train_seconds``,
    ``device`` and ``train_seconds_per_100k_samples`` (the training time spread over
    ``diffusion.samples``, per 100,000 generated transitions).
    """
    # torch and diffusers come with this: imported when the stage runs (see the top).
    from offaug.pipeline.models.diffusion import DiffusionConfig, save_diffusion, train_diffusion

    settings = config.diffusion
    model, metrics = train_diffusion(
        load_transitions(data.source),
        DiffusionConfig(
            width=settings.width,
            blocks=settings.blocks,
            steps=settings.steps,
            batch_size=settings.batch_size,
            learning_rate=settings.learning_rate,
            sampler_steps=settings.sampler_steps,
            next_state=settings.next_state,
            seed=diffusion_seed(config, seed),
        ),
    )
    path = save_diffusion(model, out)
    per_100k = metrics["train_seconds"] * PER_100K / settings.samples
    return ModelRef(
        name="diffusion",
        path=str(path),
        checksum=file_checksum(path),
        metrics={
            **metrics,
            "device": str(model.diffusion.device),
            "train_seconds_per_100k_samples": per_100k,
        },
    )


def diffusion_sample_task(
    data: DatasetRef,
    denoiser: ModelRef,
    config: RolloutModel,
    shard_path: str,
    task_index: int,
    seed: int,
) -> RolloutShard:
    """Task ``task_index`` of the diffusion backend: its share of ``diffusion.samples``
    generated transitions, written as one shard (what a row holds:
    :mod:`offaug.pipeline.models.diffusion`)."""
    from offaug.datasets.shards import write_shard
    from offaug.pipeline.models.diffusion import generate, load_diffusion

    count = task_share(config.diffusion.samples, config.tasks, task_index)
    started = time.perf_counter()
    model = load_diffusion(denoiser.path)
    out = generate(model, count, diffusion_seed(config, seed) * 1000 + task_index, data.meta)
    seconds = time.perf_counter() - started
    out = dataclasses.replace(
        out,
        meta={
            **out.meta,
            "provenance": {
                "source": data.source,
                "denoiser": denoiser.path,
                "denoiser_checkpoint_xxh3": denoiser.checksum,
                "seed": seed,
                "task_index": task_index,
            },
        },
    )
    Path(shard_path).parent.mkdir(parents=True, exist_ok=True)
    ref = write_shard(out, shard_path)
    # No episode returns: a generated row is a one-step episode, and there is no filter to count.
    return RolloutShard(ref, {}, 0, (), seconds=seconds)


def _for_task(model: Any, config: RolloutModel, seed: int) -> Any:
    # The penalty, horizon and projection are the workflow's, whichever settings the ensemble
    # was trained with (recipes that differ only in them share one ensemble).
    dyn = config.dynamics
    model.config = dataclasses.replace(
        model.config,
        seed=seed,
        horizon=dyn.horizon,
        penalty=dyn.penalty,
        penalty_coefficient=dyn.penalty_coefficient,
        mobile_samples=dyn.mobile_samples,
        invariants=dyn.invariants,
    )
    return model


def merge_rollouts(
    results: list[RolloutShard],
    out: str,
    config: RolloutModel,
    calibration: NoiseCalibration | None = None,
) -> AugmentedRef:
    """Write the augmented shard set's manifest over the finished tasks.

    The reference's ``metrics``: ``policy`` (``rollout.policy``), ``noise`` (what the tasks
    used: ``rollout.noise``, or the calibrated one), ``noise_calibration`` (the probes, None
    without calibration), ``filter`` (its kind, margin and the episodes ``kept`` and
    ``dropped``; for ``policy`` and ``value`` also ``references``, what the episodes were
    compared with: :func:`~offaug.pipeline.rollouts.tasks.filter_references`),
    ``episode_return`` (the mean return of the kept episodes, None without any) and
    ``simulator_steps`` (the environment steps every task took; 0 for model rollouts).
    Generated transitions (backend ``diffusion``) have no policy, noise, filter or episode
    return (None, and filter kind ``none``); their ``diffusion`` entry holds the ``samples``,
    the tasks' ``sample_seconds`` and ``sample_seconds_per_100k_samples``.
    """
    generated = config.backend == "diffusion"
    noise = (config.noise if calibration is None else calibration.noise).text
    calibrated = None if calibration is None else calibration.to_json()
    params: dict[str, Any] = {"backend": config.backend, "tasks": config.tasks}
    if generated:
        params["diffusion"] = config.diffusion.model_dump(mode="json")
    else:
        params |= {
            "noise": noise,
            "noise_calibration": calibrated,
            "max_weight": config.max_weight,
            "episodes": config.episodes,
            "simulator_steps": config.simulator_steps,
            "policy": config.policy,
            "horizon": config.horizon,
            "starts": config.starts,
            "filter": config.filter,
            "filter_margin": config.filter_margin,
            "filter_tolerance": config.filter_tolerance,
            "keep_reference": config.keep_reference,
            "lookahead": None if config.lookahead is None else config.lookahead.model_dump(),
        }
    shard_set = merge_rollout_shards(out, results, params)
    returns = [r for result in results for r in result.episode_returns]
    metrics: dict[str, Any] = {
        "policy": config.policy,
        "noise": noise,
        "noise_calibration": calibrated,
        "filter": {
            "kind": config.filter,
            "margin": config.filter_margin,
            "tolerance": config.filter_tolerance,
            **filter_counts(results),
            "references": filter_references(results),
        },
        "episode_return": float(np.mean(returns)) if returns else None,
        "simulator_steps": sum(r.simulator_steps for r in results),
    }
    if generated:
        # What generating cost, for a cost record (the training's is the denoiser stage's).
        seconds = sum(r.seconds for r in results)
        metrics |= {
            "policy": None,
            "noise": None,
            "filter": {
                "kind": "none",
                "margin": 0.0,
                "tolerance": 0.0,
                "kept": 0,
                "dropped": 0,
                "references": None,
            },
            "diffusion": {
                "samples": shard_set.rows,
                "sample_seconds": seconds,
                "sample_seconds_per_100k_samples": seconds * PER_100K / max(shard_set.rows, 1),
            },
        }
    return AugmentedRef(
        directory=shard_set.directory,
        rows=shard_set.rows,
        episodes=shard_set.episodes,
        shards=len(shard_set.shards),
        manifest_checksum=file_checksum(shard_set.manifest_path),
        weight_stats=dict(shard_set.params["weight_stats"]),
        faults=sum(r.faults for r in results),
        metrics=metrics,
    )
