"""The pipeline's stages: plain functions from small records and config to small records.

No stage imports Dask: :mod:`offaug.pipeline.graph` wires them into a graph, and a test calls
any of them directly. Every stage writes its outputs atomically, so a stage that is killed and
run again leaves no partial file and no duplicate.

Every Dask worker imports this module to unpickle its first stage, before the background
import of torch (:mod:`offaug.pipeline.workers`) is done; so the modules that import torch
are imported inside the stages that use them, and this module's header holds none.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from offaug.datasets.atomic import replace_directory, write_json_atomic
from offaug.datasets.errors import DataError, DatasetNotFoundError
from offaug.datasets.generate import make_dataset
from offaug.datasets.publish import publish_dataset
from offaug.datasets.shards import ShardSet, file_checksum
from offaug.datasets.sources import cache_key, load_transitions, resolve_source
from offaug.datasets.transitions import SIMULATOR_STATE_KEYS, SPACE_META_KEYS
from offaug.pipeline.layout import AugmentedRef, DatasetRef, ModelRef
from offaug.pipeline.media_stages import media_metrics
from offaug.pipeline.rollout import RolloutConfig
from offaug.pipeline.rollout_tasks import (
    RolloutShard,
    RolloutTask,
    merge_rollout_shards,
    run_rollout_task,
    split_tasks,
)
from offaug.pipeline.workflow import (
    BCConfigModel,
    DiagnosticsModel,
    EvaluationModel,
    RolloutModel,
    SourceConfig,
    TrainModel,
    Workflow,
)

_STATE_KEYS = list(SIMULATOR_STATE_KEYS)


def _meta_subset(meta: Any) -> dict[str, Any]:
    return {k: meta.get(k) for k in (*SPACE_META_KEYS, "format")}


def prepare_source(config: SourceConfig) -> DatasetRef:
    """Make the source dataset if it is missing and asked to, load it once (warming the cache)."""
    try:
        resolved = resolve_source(config.dataset, download=config.download)
    except DatasetNotFoundError:
        if config.make is None:
            raise
        make = config.make
        make_dataset(
            make.env,
            config.dataset,
            policy=make.policy,
            steps=make.steps,
            data_format=make.format,
            seed=make.seed,
            max_episode_steps=make.max_episode_steps,
        )
        resolved = resolve_source(config.dataset)
    try:
        data = load_transitions(config.dataset, info_keys=_STATE_KEYS)
        has_state = True
    except DataError:
        # Datasets without simulator state still load; they just cannot be branched from.
        data = load_transitions(config.dataset)
        has_state = False
    return DatasetRef(
        source=config.dataset,
        rows=len(data),
        episodes=data.num_episodes,
        identity=cache_key(resolved, {"info_keys": _STATE_KEYS if has_state else []}),
        has_simulator_state=has_state,
        meta=_meta_subset(data.meta),
    )


def _train_into(out: str, run: Any) -> Path:
    """Run ``run(directory)`` in a fresh sibling directory, then move it to ``out`` atomically.

    A stage can execute twice at once (a client killed while its task still runs on a worker,
    and the rerun's task): each execution writes its own directory and the last one to finish
    replaces ``out`` whole, so files of two executions never mix.
    """
    final = Path(out)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        run(staging)
        replace_directory(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _model_ref(name: str, checkpoint: Path, metrics: dict[str, Any]) -> ModelRef:
    return ModelRef(
        name=name, path=str(checkpoint), checksum=file_checksum(checkpoint), metrics=metrics
    )


def _last_metrics(run_dir: Path) -> dict[str, Any]:
    lines = (
        (run_dir / "metrics.jsonl").read_text().splitlines()
        if (run_dir / "metrics.jsonl").is_file()
        else []
    )
    train = [json.loads(x) for x in lines if '"kind": "train"' in x]
    evals = [json.loads(x) for x in lines if '"kind": "eval"' in x]
    return {"train": train[-1] if train else {}, "eval": evals[-1] if evals else None}


def train_bc(data: DatasetRef, config: BCConfigModel, out: str, seed: int) -> ModelRef:
    """Behaviour cloning (Gaussian): the rollout policy and the behaviour model."""
    from offaug.algorithms.train import TrainOptions, train  # imports torch: see the top

    options = TrainOptions(
        steps=config.steps,
        seed=seed,
        eval_every=0,
        log_every=max(1, config.steps // 10),
        checkpoint_every=config.steps,
        threads=None,
        compile=config.compile,
    )
    learner = {
        "policy": "gaussian",
        "hidden": tuple(config.hidden),
        "learning_rate": config.learning_rate,
        "batch_size": config.batch_size,
    }
    final = _train_into(
        out, lambda d: train("bc", [data.source], d, config=learner, options=options)
    )
    return _model_ref("bc", final / "checkpoint.pt", _last_metrics(final))


def rollout_tasks(
    data: DatasetRef, bc: ModelRef, config: RolloutModel, out: str, seed: int
) -> list[RolloutTask]:
    """The rollout stage's tasks (references only), one shard each."""
    start = config.start if data.has_simulator_state else "reset"
    rollout_config = RolloutConfig(
        episodes=config.episodes,
        n_envs=config.n_envs,
        noise=config.noise,
        seed=seed,
        max_weight=config.max_weight,
        start=start,
        max_episode_steps=config.max_episode_steps,
    )
    return split_tasks(data.source, bc.path, rollout_config, out, config.tasks, env_id=config.env)


def rollout_shard(
    data: DatasetRef, bc: ModelRef, config: RolloutModel, out: str, seed: int, task_index: int
) -> RolloutShard:
    """Task ``task_index`` of the rollout stage: roll out its episodes and write its shard."""
    tasks = rollout_tasks(data, bc, config, out, seed)
    if task_index >= len(tasks):
        raise ValueError(f"rollout task {task_index} of {len(tasks)}: more tasks than episodes")
    return run_rollout_task(tasks[task_index])


def train_dynamics_stage(data: DatasetRef, config: RolloutModel, out: str, seed: int) -> ModelRef:
    """Fit the learned-dynamics ensemble (rollout backend 'model')."""
    from offaug.datasets.sources import load_transitions
    from offaug.pipeline.dynamics import DynamicsConfig, save_dynamics, train_dynamics

    dyn = config.dynamics
    model, losses = train_dynamics(
        load_transitions(data.source),
        DynamicsConfig(
            members=dyn.members,
            hidden=tuple(dyn.hidden),
            steps=dyn.steps,
            horizon=dyn.horizon,
            penalty=dyn.penalty,
            seed=seed,
        ),
    )
    path = save_dynamics(model, out)
    return _model_ref("dynamics", path, losses)


def model_rollout_task(
    data: DatasetRef,
    bc: ModelRef,
    dynamics: ModelRef,
    config: RolloutModel,
    shard_path: str,
    task_index: int,
    seed: int,
) -> RolloutShard:
    """One task of model rollouts from random dataset states, written as one shard."""
    # torch comes with these: imported when the task runs, not when a worker unpickles stages.
    from offaug.algorithms.train import load_trainer
    from offaug.datasets.shards import write_shard
    from offaug.datasets.sources import load_transitions
    from offaug.pipeline.dynamics import load_dynamics, model_rollout
    from offaug.pipeline.policies import BCRolloutPolicy

    original = load_transitions(data.source)
    model = load_dynamics(dynamics.path)
    model = _with_seed(model, seed * 1000 + task_index)
    rng = np.random.default_rng(seed * 1000 + task_index)
    starts = np.asarray(
        original.observations[rng.integers(0, len(original), config.dynamics.starts)]
    )
    policy = BCRolloutPolicy(load_trainer(bc.path, device="cpu"))
    meta = {
        **data.meta,
        "provenance": {
            "source": data.source,
            "policy": bc.path,
            "policy_checkpoint_xxh3": bc.checksum,
            "dynamics": dynamics.path,
            "noise": config.noise.text,
            "seed": seed,
            "task_index": task_index,
        },
    }
    out = model_rollout(
        model, policy, starts, noise=config.noise, max_weight=config.max_weight, meta=meta
    )
    Path(shard_path).parent.mkdir(parents=True, exist_ok=True)
    ref = write_shard(out, shard_path)
    bounds = out.episode_bounds()
    returns = (
        np.add.reduceat(out.rewards.astype(np.float64), bounds[:-1]) if len(out) else np.zeros(0)
    )
    return RolloutShard(ref, dict(out.meta["weight_stats"]), 0, tuple(float(r) for r in returns))


def _with_seed(model: Any, seed: int) -> Any:
    model.config = dataclasses.replace(model.config, seed=seed)
    return model


def merge_rollouts(results: list[RolloutShard], out: str, config: RolloutModel) -> AugmentedRef:
    """Write the augmented shard set's manifest over the finished tasks."""
    shard_set = merge_rollout_shards(
        out,
        results,
        {
            "noise": config.noise.text,
            "max_weight": config.max_weight,
            "backend": config.backend,
            "episodes": config.episodes,
            "tasks": config.tasks,
        },
    )
    return AugmentedRef(
        directory=shard_set.directory,
        rows=shard_set.rows,
        episodes=shard_set.episodes,
        shards=len(shard_set.shards),
        manifest_checksum=file_checksum(shard_set.manifest_path),
        weight_stats=dict(shard_set.params["weight_stats"]),
        faults=sum(r.faults for r in results),
    )


def train_offline(
    algorithm: str,
    data: DatasetRef,
    augmented: AugmentedRef | None,
    train_config: TrainModel,
    evaluation: EvaluationModel,
    out: str,
    seed: int,
    threads: int | None = None,
) -> ModelRef:
    """Train one learner on the original data, or on original + augmented data."""
    from offaug.algorithms.train import train  # imports torch: see the top

    sources, options = _train_inputs(data, augmented, train_config, evaluation, seed, threads)
    config = dict(train_config.configs.get(algorithm, {}))
    final = _train_into(out, lambda d: train(algorithm, sources, d, config=config, options=options))
    return _model_ref(
        _model_name(algorithm, augmented), final / "checkpoint.pt", _last_metrics(final)
    )


def train_offline_fused(
    algorithm: str,
    data: DatasetRef,
    augmented: AugmentedRef | None,
    train_config: TrainModel,
    evaluation: EvaluationModel,
    outs: list[str],
    seeds: list[int],
    threads: int | None = None,
) -> list[ModelRef]:
    """:func:`train_offline` for several seeds at once, as one fused run; one record per seed.

    ``outs[k]`` receives what :func:`train_offline` with ``seeds[k]`` writes to its ``out``, and
    the records are those it returns (the numbers agree to float32 rounding).
    """
    from offaug.algorithms.train_fused import train_fused  # imports torch: see the top

    sources, options = _train_inputs(data, augmented, train_config, evaluation, seeds[0], threads)
    options = dataclasses.replace(options, seeds=tuple(seeds))
    config = dict(train_config.configs.get(algorithm, {}))
    finals = [Path(o) for o in outs]
    stagings = [f.with_name(f".{f.name}.tmp-{uuid.uuid4().hex[:12]}") for f in finals]
    try:
        train_fused(algorithm, sources, stagings, config=config, options=options)
        for staging, final in zip(stagings, finals, strict=True):
            final.parent.mkdir(parents=True, exist_ok=True)
            replace_directory(staging, final)
    except BaseException:
        for staging in stagings:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    name = _model_name(algorithm, augmented)
    return [_model_ref(name, f / "checkpoint.pt", _last_metrics(f)) for f in finals]


def _model_name(algorithm: str, augmented: AugmentedRef | None) -> str:
    return f"{algorithm}-{'augmented' if augmented is not None else 'original'}"


def _train_inputs(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    train_config: TrainModel,
    evaluation: EvaluationModel,
    seed: int,
    threads: int | None,
) -> tuple[list[Any], Any]:
    """The sources and :class:`~offaug.algorithms.train.TrainOptions` of a training stage."""
    from offaug.algorithms.train import TrainOptions  # imports torch: see the top

    sources: list[Any] = [data.source]
    mixing = None
    use_weights = False
    if augmented is not None:
        sources.append(augmented.directory)
        mixing = tuple(train_config.mixing)
        use_weights = train_config.weighting
    steps = train_config.steps
    options = TrainOptions(
        steps=steps,
        seed=seed,
        mixing=mixing,
        use_weights=use_weights,
        log_every=max(1, steps // 20),
        eval_every=evaluation.every or steps,
        eval_episodes=evaluation.episodes,
        checkpoint_every=steps,
        device=train_config.device,
        threads=threads,
        compile=train_config.compile,
    )
    return sources, options


def diagnose_policy_stage(
    data: DatasetRef,
    bc: ModelRef,
    model: ModelRef,
    config: DiagnosticsModel,
    seed: int,
    index: int,
) -> dict[str, Any]:
    """One trained policy's diagnostics (:func:`offaug.pipeline.diagnostics.diagnose_policy`)."""
    # The diagnostics evaluate torch policies and use scipy: imported where they run.
    from offaug.pipeline.diagnostics import diagnose_policy

    return diagnose_policy(data, bc, model, config, seed, index)


def diagnose_stage(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    bc: ModelRef,
    models: list[ModelRef],
    config: DiagnosticsModel,
    out: str,
    seed: int,
    parts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Distribution-shift diagnostics (see :mod:`offaug.pipeline.diagnostics`), as a dict."""
    # The diagnostics evaluate torch policies and use scipy: imported where they run.
    from offaug.pipeline.diagnostics import run_diagnostics

    return run_diagnostics(data, augmented, bc, models, config, out, seed, parts=parts)


def publish_stage(
    data: DatasetRef, augmented: AugmentedRef | None, config: Any, provenance: dict[str, Any]
) -> dict[str, Any]:
    """Publish original and/or augmented data as a Minari dataset."""
    parts: list[Any] = []
    if config.include in ("original", "both"):
        parts.append(load_transitions(data.source))
    if config.include in ("augmented", "both"):
        if augmented is None:
            raise ValueError("publish.include asks for augmented data but the run made none")
        parts.append(ShardSet.open(augmented.directory))
    published = publish_dataset(
        parts,
        config.dataset_id,
        root=config.root,
        data_format=config.format,
        overwrite=config.overwrite,
        provenance=provenance,
    )
    return {
        "dataset_id": config.dataset_id,
        "path": str(getattr(published, "path", "")),
        "include": config.include,
    }


def summarise(workflow: Workflow, results: dict[str, Any]) -> dict[str, Any]:
    """metrics.json: scores per learner and data, weight statistics, diagnostics."""
    training: dict[str, Any] = {}
    for name, result in results.items():
        if name.startswith("train:") and isinstance(result, ModelRef):
            evaluation = result.metrics.get("eval") or {}
            training[name.removeprefix("train:")] = {
                "return": evaluation.get("return"),
                "normalised_score": evaluation.get("normalised_score"),
                "checkpoint": result.path,
            }
    augmented = results.get("rollout")
    source = results.get("source")
    metrics: dict[str, Any] = {
        "workflow": workflow.name,
        "workflow_hash": workflow.digest(),
        "source": {"dataset": source.source, "rows": source.rows, "episodes": source.episodes}
        if isinstance(source, DatasetRef)
        else None,
        "augmented": {
            "rows": augmented.rows,
            "episodes": augmented.episodes,
            "shards": augmented.shards,
            "faults": augmented.faults,
        }
        if isinstance(augmented, AugmentedRef)
        else None,
        "weights": augmented.weight_stats if isinstance(augmented, AugmentedRef) else None,
        "training": training,
    }
    if "diagnose" in results:
        metrics["diagnostics"] = results["diagnose"]
    if "publish" in results:
        metrics["publish"] = results["publish"]
    metrics.update(media_metrics(results, workflow.report))
    return metrics


def report_stage(
    workflow: Workflow,
    names: tuple[str, ...],
    results: list[Any],
    metrics_path: str,
    report_path: str,
) -> dict[str, Any]:
    """Write ``metrics.json`` (see :func:`summarise`) and ``report.html`` from every result."""
    metrics = summarise(workflow, dict(zip(names, results, strict=True)))
    write_json_atomic(Path(metrics_path), metrics)
    paths = [metrics_path]
    try:
        from offaug.pipeline.report import write_report
    except ImportError:  # matplotlib is optional: metrics.json alone then
        return {"kind": "files", "paths": paths}
    write_report(metrics, Path(report_path))
    return {"kind": "files", "paths": [*paths, report_path]}
