"""The pipeline's stages: plain functions from small records and config to small records.

No stage imports Dask: :mod:`offaug.pipeline.engine.plan` plans them,
:mod:`offaug.pipeline.engine.graph` runs the plan, and a test calls any of them directly. Every
stage writes its outputs atomically, so a stage that is killed and run again leaves no partial file
and no duplicate.

Every Dask worker imports this module to unpickle its first stage, before the background
import of torch (:mod:`offaug.pipeline.engine.workers`) is done; so the modules that import torch
are imported inside the stages that use them, and this module's header holds none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

from offaug.algorithms.online.making import make_source_dataset
from offaug.datasets.atomic import staged_directory, write_json_atomic
from offaug.datasets.errors import DatasetNotFoundError
from offaug.datasets.sampler import batch_shares
from offaug.datasets.shards import file_checksum
from offaug.datasets.sources import cache_key, load_transitions, resolve_source
from offaug.datasets.transitions import SPACE_META_KEYS, Transitions
from offaug.pipeline.contracts import AugmentedRef, DatasetRef, ModelRef, RunIndex
from offaug.pipeline.outcome.summary import summarise
from offaug.pipeline.rollouts.env_state import load_with_states
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.run_sections import DiagnosticsModel, EvaluationModel
from offaug.pipeline.schema.sections import BCConfigModel, SourceConfig, TrainModel
from offaug.pipeline.schema.workflow import Workflow


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
        sac_config = None
        if make.policy == "sac":
            # Imports torch: only a source made by SAC needs it.
            from offaug.algorithms.online.levels import small_sac_config

            sac_config = small_sac_config()
        make_source_dataset(
            make.env,
            config.dataset,
            policy=make.policy,
            level=make.level,
            train_steps=make.train_steps,
            steps=make.steps,
            data_format=make.format,
            seed=make.seed,
            max_episode_steps=make.max_episode_steps,
            sac_config=sac_config,
            threads=1,
        )
        resolved = resolve_source(config.dataset)
    # Datasets without recorded states still load; they just cannot be branched from.
    data, state_kind = load_with_states(config.dataset)
    info_keys = list(state_kind.keys) if state_kind is not None else []
    return DatasetRef(
        source=config.dataset,
        rows=len(data),
        episodes=data.num_episodes,
        identity=cache_key(resolved, {"info_keys": info_keys}),
        has_simulator_state=state_kind is not None,
        meta=_meta_subset(data.meta),
    )


def _train_into(out: str, run: Any) -> Path:
    """Run ``run(directory)`` in a fresh sibling directory, then move it to ``out`` atomically.

    A stage can execute twice at once (a client killed while its task still runs on a worker,
    and the rerun's task): each execution writes its own directory and the last one to finish
    replaces ``out`` whole, so files of two executions never mix.
    """
    with staged_directory(out, overwrite=True) as staging:
        run(staging)
    return Path(out)


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


def data_score(data: Transitions) -> dict[str, Any]:
    """The data's own mean episode return and its normalised score (reference scores)."""
    from offaug.algorithms.evaluate import normalised_score, reference_scores  # torch: see top

    returns = data.episode_returns()
    mean_return = float(returns.mean()) if len(returns) else 0.0
    return {
        "episodes": len(returns),
        "return": mean_return,
        "normalised_score": normalised_score(mean_return, reference_scores(data.meta, None)),
    }


def train_bc(data: DatasetRef, config: BCConfigModel, out: str, seed: int) -> ModelRef:
    """Behaviour cloning (Gaussian): the rollout policy and the behaviour model.

    Its metrics hold the final training line, its own evaluation (``eval``: mean ``return``
    and ``normalised_score`` over ``config.evaluation_episodes`` greedy episodes, with the
    learners' evaluation seeds) when the dataset records its env, and the data's own score
    (``data``: :func:`data_score`), so a report can set the rollout policy against the data.
    """
    from offaug.algorithms.training.loop import train
    from offaug.algorithms.training.options import TrainOptions

    evaluate = config.evaluation_episodes > 0 and bool(data.meta.get("env_spec"))
    options = TrainOptions(
        steps=config.steps,
        seed=seed,
        eval_every=config.steps if evaluate else 0,
        eval_episodes=max(1, config.evaluation_episodes),
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
    metrics = {**_last_metrics(final), "data": data_score(load_transitions(data.source))}
    return _model_ref("bc", final / "checkpoint.pt", metrics)


def train_offline(
    algorithm: str,
    data: DatasetRef,
    augmented: AugmentedRef | None,
    train_config: TrainModel,
    evaluation: EvaluationModel,
    out: str,
    seed: int,
    threads: int | None = None,
    init: ModelRef | None = None,
    *,
    plain: bool | None = None,
) -> ModelRef:
    """Train one learner on the original data, or on original + augmented data.

    A plain run (default: the run without augmented data, the baseline) takes neither weights
    nor state noise; ``plain=False`` gives the original data alone ``train_config``'s state
    noise (an S4RL arm without rollouts). ``init``: the checkpoint to start from
    (``train.init: plain``: the same learner's plain run), trained ``train_config.steps`` more.
    """
    from offaug.algorithms.training.loop import train

    sources, options = _train_inputs(
        data, augmented, train_config, evaluation, seed, threads, plain=plain
    )
    if init is not None:
        options = dataclasses.replace(options, init_checkpoint=init.path)
    config = dict(train_config.configs.get(algorithm, {}))
    final = _train_into(out, lambda d: train(algorithm, sources, d, config=config, options=options))
    return _model_ref(
        _model_name(algorithm, augmented), final / "checkpoint.pt", _run_metrics(final, options)
    )


def train_offline_fused(
    algorithm: str,
    data: DatasetRef,
    augmented: list[AugmentedRef] | None,
    train_config: TrainModel,
    evaluation: EvaluationModel,
    outs: list[str],
    seeds: list[int],
    threads: int | None = None,
    *,
    plain: bool | None = None,
) -> list[ModelRef]:
    """:func:`train_offline` for several seeds at once, as one fused run; one record per seed.

    ``augmented[k]`` is seed ``seeds[k]``'s augmented data (``None``: every seed trains on the
    original data). ``outs[k]`` receives what :func:`train_offline` with ``seeds[k]`` writes to
    its ``out``, and the records are those it returns (the numbers agree to float32 rounding).
    With ``fuse_seeds: auto`` on a device where fusing does not pay (the worker's, which the
    planning client may not share), the seeds train one after another, each exactly as
    :func:`train_offline` trains it.
    """
    # Imports torch: see the top.
    from offaug.algorithms.runtime import choose_device
    from offaug.algorithms.training.fused_loop import fusing_pays, train_fused
    from offaug.algorithms.training.loop import train

    per_seed = augmented if augmented is not None else [None] * len(seeds)
    inputs = [
        _train_inputs(data, a, train_config, evaluation, seed, threads, plain=plain)
        for a, seed in zip(per_seed, seeds, strict=True)
    ]
    # Seeds whose options differ beyond the seed (one whose rollout filter kept no episode
    # trains on the original data alone) train as separate fused runs.
    groups: dict[Any, list[int]] = {}
    for k, (_, options) in enumerate(inputs):
        groups.setdefault(dataclasses.replace(options, seed=0), []).append(k)
    config = dict(train_config.configs.get(algorithm, {}))
    finals = [Path(o) for o in outs]
    fuse = train_config.fuse_seeds is True or fusing_pays(
        algorithm, choose_device(train_config.device)
    )
    with contextlib.ExitStack() as staged:
        # Each seed's directory moves into place once every seed has trained (or none does).
        stagings = [staged.enter_context(staged_directory(f, overwrite=True)) for f in finals]
        for shared, members in groups.items():
            if not fuse:
                for k in members:
                    sources, options = inputs[k]
                    train(algorithm, sources, stagings[k], config=config, options=options)
                continue
            options = dataclasses.replace(shared, seeds=tuple(seeds[k] for k in members))
            sources = [inputs[k][0] for k in members]
            train_fused(
                algorithm, sources, [stagings[k] for k in members], config=config, options=options
            )
    return [
        _model_ref(_model_name(algorithm, a), f / "checkpoint.pt", _run_metrics(f, options))
        for a, f, (_, options) in zip(per_seed, finals, inputs, strict=True)
    ]


def member_model(models: list[ModelRef], index: int) -> ModelRef:
    """The record of seed ``index`` of a :func:`train_offline_fused` stage: a stage of its own,
    so that every later stage reads a seed's model as it reads a per-seed training's."""
    return models[index]


def _model_name(algorithm: str, augmented: AugmentedRef | None) -> str:
    return f"{algorithm}-{'augmented' if augmented is not None else 'original'}"


def _run_metrics(run_dir: Path, options: Any) -> dict[str, Any]:
    """A finished run's last metrics, with how its augmented rows were weighted and noised."""
    metrics = _last_metrics(run_dir)
    metrics["weighting"] = options.weighting
    # The shares each batch held (train.mixing, or less augmented under mixing_follows_rows).
    metrics["mixing"] = list(options.mixing) if options.mixing is not None else None
    # ESS/N of the weights the losses used, over every weighted row of the run.
    metrics["weight_ess_fraction"] = metrics["train"].get("weight_ess_fraction_run")
    metrics["state_noise"] = (
        dataclasses.asdict(options.state_noise) if options.state_noise is not None else None
    )
    return metrics


def _train_inputs(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    train_config: TrainModel,
    evaluation: EvaluationModel,
    seed: int,
    threads: int | None,
    *,
    plain: bool | None = None,
) -> tuple[list[Any], Any]:
    """The sources and :class:`~offaug.algorithms.training.options.TrainOptions` of a training
    stage."""
    from offaug.algorithms.training.options import TrainOptions
    from offaug.algorithms.training.state_noise import StateNoise  # imports torch: see the top

    plain = augmented is None if plain is None else plain
    if augmented is not None and augmented.rows == 0:
        # The rollout filter kept no episode: nothing to mix in, so the arm trains on the original
        # data alone (its summary's augmented_rows of 0 tells the verdict why).
        augmented = None
    sources: list[Any] = [data.source]
    mixing = None
    if augmented is not None:
        sources.append(augmented.directory)
        mixing = batch_shares(
            train_config.mixing,
            (data.rows, augmented.rows) if train_config.mixing_follows_rows else None,
        )
    noise = train_config.state_noise
    steps = train_config.steps
    options = TrainOptions(
        steps=steps,
        seed=seed,
        mixing=mixing,
        weighting="none" if plain or augmented is None else train_config.weighting,
        state_noise=None if plain or noise is None else StateNoise(noise.kind, noise.scale),
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


def report_stage(
    workflow: Workflow,
    names: tuple[str, ...],
    results: list[Any],
    layout: RunLayout,
    index: RunIndex,
) -> dict[str, Any]:
    """Write ``metrics.json`` (:func:`offaug.pipeline.outcome.summary.summarise`) and
    ``report.html`` into the run directory from every result; ``index`` says which stage holds
    which run."""
    metrics = summarise(workflow, dict(zip(names, results, strict=True)), index)
    write_json_atomic(layout.metrics, metrics)
    paths = [str(layout.metrics)]
    try:
        from offaug.pipeline.report import write_report
    except ImportError:  # matplotlib is optional: metrics.json alone then
        return {"kind": "files", "paths": paths}
    write_report(metrics, layout.report)
    return {"kind": "files", "paths": [*paths, str(layout.report)]}
