"""Running the diagnostics: the ``diagnose`` stage, one policy's checks, and a re-run of a run.

:func:`run_diagnostics` (the ``diagnose`` stage) loads the original dataset and the augmented
shard set, computes every section of :class:`~offaug.pipeline.diagnostics.document.Diagnostics`
on at most ``config.max_states`` sampled states each, writes it atomically as JSON and returns
it. Each trained policy's checks are one :func:`diagnose_policy` call, which the pipeline runs as
a stage of its own as soon as that policy is trained, and :func:`run_diagnostics` merges (or
computes them itself when not given); :func:`diagnose_run` re-runs all of it from a run
directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from offaug.algorithms.training.checkpoints import load_trainer
from offaug.algorithms.training.state_noise import StateNoise, noisy_copy
from offaug.datasets import ShardSet, load_transitions
from offaug.datasets.atomic import write_json_atomic
from offaug.datasets.transitions import Transitions
from offaug.pipeline.contracts import AugmentedRef, DatasetRef, ModelRef
from offaug.pipeline.diagnostics.coverage import state_coverage
from offaug.pipeline.diagnostics.data import data_section
from offaug.pipeline.diagnostics.divergence import divergence_section, policy_divergence
from offaug.pipeline.diagnostics.document import (
    SCHEMA_VERSION,
    CoverageSection,
    Diagnostics,
    WeightsSection,
)
from offaug.pipeline.diagnostics.evaluation import evaluation_entry, evaluation_episodes
from offaug.pipeline.diagnostics.importance import importance_weight_diagnostics
from offaug.pipeline.diagnostics.ope import ope_entry
from offaug.pipeline.diagnostics.policy_document import (
    EvaluationEntry,
    PolicyPart,
    RankingEntry,
    ValueEntry,
)
from offaug.pipeline.diagnostics.policy_models import BehaviourModel
from offaug.pipeline.diagnostics.quality import QualitySettings, quality_report
from offaug.pipeline.diagnostics.quality_document import QualityReport
from offaug.pipeline.diagnostics.ranking import rank_results
from offaug.pipeline.diagnostics.sampling import (
    PolicySample,
    TrainedPolicy,
    batched_act,
    draw_sample,
    jsonable,
    single_threaded,
)
from offaug.pipeline.diagnostics.settings import DiagnosticsSettings
from offaug.pipeline.diagnostics.value import value_entry
from offaug.pipeline.rollouts.noise import parse_noise
from offaug.pipeline.rundir.files import read_run_records
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.run_sections import DiagnosticsModel
from offaug.pipeline.schema.workflow import load_workflow


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - started, 4)


def run_diagnostics(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    bc: ModelRef,
    models: list[ModelRef],
    config: DiagnosticsModel,
    out: str,
    seed: int,
    *,
    settings: DiagnosticsSettings | None = None,
    parts: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Compute every diagnostic, write ``out`` (JSON) atomically, return it.

    Args:
        data: The source dataset.
        augmented: The augmented shard set, or None for a run without augmentation.
        bc: The Gaussian BC checkpoint: beta_hat and the rollout policy's mean.
        models: Trained learners; those whose trainer has ``q_values`` get the value checks.
        config: k, quantile, gamma and max_states.
        out: The JSON file to write.
        seed: Seed of every sample drawn here.
        settings: Sizes the workflow does not set (defaults: :class:`DiagnosticsSettings`).
        parts: The per-policy checks of ``models`` already made by :func:`diagnose_policy`
            (the pipeline runs them as stages of their own); computed here when None.

    Returns:
        The document, shaped as :class:`~offaug.pipeline.diagnostics.document.Diagnostics`.
    """
    with single_threaded():
        result = _diagnose(data, augmented, bc, models, config, seed, settings, parts)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    return result


def _diagnose(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    bc: ModelRef,
    models: list[ModelRef],
    config: DiagnosticsModel,
    seed: int,
    settings: DiagnosticsSettings | None,
    parts: Sequence[Mapping[str, Any]] | None,
) -> dict[str, Any]:
    settings = settings or DiagnosticsSettings()
    rng = np.random.default_rng(seed)
    timer = _Timer()
    gamma = config.gamma
    bins = settings.histogram_bins
    with timer("load"):
        original = load_transitions(data.source)
        shard_set = ShardSet.open(augmented.directory) if augmented is not None else None
        shards = []
        augmented_data = None
        if shard_set is not None:
            shards = [(Path(ref.path).name, shard_set.read(ref)) for ref in shard_set.shards]
            # Every shard was just verified by read(): no second hashing pass.
            augmented_data = shard_set.load(verify=False)
        bc_trainer = load_trainer(bc.path, device="cpu")
        behaviour = BehaviourModel.from_trainer(bc_trainer)

    with timer("data"):
        data_part = data_section(original, augmented_data, gamma, bins)
    with timer("weights"):
        weights: WeightsSection | None = None
        if shard_set is not None:
            # The rollout's clip, as its manifest records it.
            max_weight = shard_set.params.get("max_weight")
            weights = importance_weight_diagnostics(
                shards, None if max_weight is None else float(max_weight), bins
            )
    with timer("coverage"):
        coverage: CoverageSection | None = None
        if augmented_data is not None and len(augmented_data):
            coverage = state_coverage(
                original.observations,
                augmented_data.observations,
                k=config.k,
                quantile=config.quantile,
                max_states=config.max_states,
                rng=rng,
                bins=bins,
            )
    with timer("quality"):
        quality = _quality(data, original, augmented_data, shard_set, models, config, seed)

    # One sample of whole episodes serves every policy check: each policy acts on it once.
    sample = draw_sample(original, config, seed)
    if parts is None:
        parts = [
            _policy_part(data, behaviour, sample, model, config, seed, index, settings)
            for index, model in enumerate(models)
        ]
    with timer("divergence"):
        # The manifest records the noise as text: parsed once, here.
        recorded = shard_set.params.get("noise") if shard_set is not None else None
        noise = None if recorded is None else parse_noise(str(recorded))
        divergence = divergence_section(
            behaviour, bc_trainer, parts, sample, augmented_data, noise, rng
        )
    evaluation: dict[str, EvaluationEntry] | None = None
    ranking: list[RankingEntry] | None = None
    if all(part["evaluation"] is not None for part in parts):  # else no environment
        evaluation = {part["name"]: part["evaluation"] for part in parts}
        named = [{"name": name, **entry} for name, entry in evaluation.items()]
        ranking = rank_results(named, config.rank_weights, seed=seed)
    value: dict[str, ValueEntry] = {
        part["name"]: part["value"] for part in parts if part["value"] is not None
    }
    lengths = [part["evaluation_max_length"] for part in parts]
    ope: dict[str, Any] = {
        "settings": {
            "target_sigma": settings.target_sigma,
            "target_epsilon": settings.target_epsilon,
            "fqe_steps": settings.fqe_steps,
            "fqe_tau": settings.fqe_tau,
            "episodes": len(sample.starts),
            "transitions": len(sample.rows),
            # Evaluation episodes shorter than ~3 effective horizons are cut by the time limit:
            # FQE (infinite horizon) then reads high against their returns.
            "evaluation_max_length": max((n for n in lengths if n is not None), default=None),
        },
        **{part["name"]: part["ope"] for part in parts if part["ope"] is not None},
    }
    timer.seconds.update({f"policy:{part['name']}": part["seconds"] for part in parts})
    result: Diagnostics = {
        "schema_version": SCHEMA_VERSION,
        "seed": seed,
        "config": config.model_dump(mode="json"),
        "settings": dataclasses.asdict(settings),
        "data": data_part,
        "weights": weights,
        "coverage": coverage,
        "quality": quality,
        "divergence": divergence,
        "evaluation": evaluation,
        "ranking": ranking,
        "value": value,
        "ope": ope,
        "timings": timer.seconds,
    }
    converted: dict[str, Any] = jsonable(result)
    return converted


def _quality(
    data: DatasetRef,
    original: Transitions,
    augmented: Transitions | None,
    shard_set: ShardSet | None,
    models: Sequence[ModelRef],
    config: DiagnosticsModel,
    seed: int,
) -> dict[str, QualityReport] | None:
    """The ``quality`` section: a report per augmented source (the shard set, named by its
    rollout backend; a state-noise copy of the source when the learners trained with it)."""
    settings = QualitySettings(
        max_states=config.max_states, k=config.k, quantile=config.quantile, seed=seed
    )
    reports: dict[str, QualityReport] = {}
    if augmented is not None and shard_set is not None and len(augmented):
        backend = str(shard_set.params.get("backend") or "augmented")
        reports[backend] = quality_report(augmented, original, data.meta, settings=settings)
    # The train stage records the state noise its learner trained with (None: none).
    noise = next((m.metrics["state_noise"] for m in models if m.metrics.get("state_noise")), None)
    if noise is not None:
        noisy = noisy_copy(original, StateNoise(noise["kind"], float(noise["scale"])), seed)
        reports["state_noise"] = quality_report(noisy, original, data.meta, settings=settings)
    return reports or None


def diagnose_policy(
    data: DatasetRef,
    bc: ModelRef,
    model: ModelRef,
    config: DiagnosticsModel,
    seed: int,
    index: int,
    *,
    settings: DiagnosticsSettings | None = None,
) -> dict[str, Any]:
    """The checks of one trained policy: divergence from beta_hat, fresh evaluation episodes,
    Q against Monte-Carlo returns and OPE (FQE seeded ``seed + index``, WPDIS).

    A stage of its own in the pipeline, run as soon as that policy is trained (in parallel with
    the other trainings); :func:`run_diagnostics` merges the parts. Returns a
    :class:`~offaug.pipeline.diagnostics.document.PolicyPart` (JSON-ready).
    """
    with single_threaded():
        behaviour = BehaviourModel.from_trainer(load_trainer(bc.path, device="cpu"))
        sample = draw_sample(load_transitions(data.source), config, seed)
        part = _policy_part(
            data, behaviour, sample, model, config, seed, index, settings or DiagnosticsSettings()
        )
    converted: dict[str, Any] = jsonable(part)
    return converted


def _policy_part(
    data: DatasetRef,
    behaviour: BehaviourModel,
    sample: PolicySample,
    model: ModelRef,
    config: DiagnosticsModel,
    seed: int,
    index: int,
    settings: DiagnosticsSettings,
) -> PolicyPart:
    """One policy's checks on the shared sample (``run_diagnostics`` passes its own)."""
    started = time.perf_counter()
    trainer = load_trainer(model.path, device="cpu")
    policy = TrainedPolicy(model.name, trainer.act, getattr(trainer, "q_values", None))
    greedy = batched_act(policy.act, sample.states)
    divergence = policy_divergence(behaviour, sample.states, sample.actions, greedy)
    episodes = evaluation_episodes(data.meta, [policy], seed, settings)
    runs = None if episodes is None else episodes.get(policy.name)
    gamma = config.gamma
    evaluation = None if runs is None else evaluation_entry(runs, gamma, data.meta)
    value = None
    if policy.q_values is not None:
        rng = np.random.default_rng([seed, 2, index])
        value = value_entry(policy, sample, behaviour.actions, episodes, gamma, settings, rng)
    ope = ope_entry(behaviour, policy, greedy, sample, runs, gamma, settings, seed + index)
    return {
        "name": model.name,
        "divergence": divergence,
        "evaluation": evaluation,
        "value": value,
        "ope": ope,
        "evaluation_max_length": max((e.length for e in runs), default=None) if runs else None,
        "seconds": time.perf_counter() - started,
    }


def diagnose_run(
    run_dir: str | Path, *, settings: DiagnosticsSettings | None = None
) -> dict[str, Any]:
    """Run the diagnostics of a finished run again, from its records (``offaug diagnose``).

    Reads ``RUN_DIR/stages.json`` (the records of stages ``source``, ``bc``, ``rollout`` and
    ``train:<algorithm>-<data>``) and the ``diagnostics`` section and seed of
    ``RUN_DIR/workflow.yaml`` (defaults without one), writes ``RUN_DIR/diagnostics.json`` and
    puts the result under ``"diagnostics"`` in ``RUN_DIR/metrics.json``. Stage records are not
    touched.

    Raises:
        FileNotFoundError: no ``stages.json``.
        DataError: the records lack the ``source`` or ``bc`` stage.
    """
    layout = RunLayout(Path(run_dir))
    records = read_run_records(layout.root)
    data, bc, augmented, models = records.data, records.bc, records.augmented, records.models
    config, seed = DiagnosticsModel(), 0
    if layout.workflow.is_file():
        workflow = load_workflow(layout.workflow)
        config, seed = workflow.diagnostics, workflow.seed
    result = run_diagnostics(
        data,
        augmented,
        bc,
        models,
        config,
        str(layout.diagnostics),
        seed,
        settings=settings,
    )
    metrics = json.loads(layout.metrics.read_text()) if layout.metrics.is_file() else {}
    metrics["diagnostics"] = result
    write_json_atomic(layout.metrics, metrics)
    return result
