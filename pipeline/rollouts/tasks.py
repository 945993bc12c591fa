"""Rollouts as units of work: tasks that travel to Dask workers, their shards, the shard set.

A rollout of E episodes is split into tasks (:func:`split_tasks`), each with its own seed and
shard; :func:`run_rollout_task` loads the policy (BC, or a trained learner around BC) and the
dataset (its states to branch from, where branches start, the returns the filter compares
with), rolls out (:func:`offaug.pipeline.rollouts.simulator.rollout`) and writes one shard
atomically;
:func:`merge_rollout_shards` writes the shard set's manifest over the finished tasks, with the
weight statistics, the self-normalisation constant and the filter's counts (and, for the
filters against the policy's own reference, its scores and references) pooled over every shard.
:func:`rollout_to_shard_set` does all three in this process and replaces a directory as a whole.
:func:`rollout_results` rolls one task out under several configs in memory, loading once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from offaug.datasets.atomic import staged_directory, write_json_atomic
from offaug.datasets.shards import (
    POOLED_MEAN_WEIGHT,
    ShardSet,
    file_checksum,
    read_shard,
    write_shard,
)
from offaug.datasets.sources import load_transitions
from offaug.datasets.transitions import SPACE_META_KEYS, Transitions
from offaug.pipeline.contracts import FilterRecord, RolloutShard
from offaug.pipeline.rollouts.behaviour import weight_statistics
from offaug.pipeline.rollouts.config import Lookahead, RolloutConfig, RolloutResult
from offaug.pipeline.rollouts.data import (
    EpisodeFilter,
    FilterKind,
    ReturnBaseline,
    sparsity,
    start_probabilities,
)
from offaug.pipeline.rollouts.env_state import dataset_start_states, load_with_states
from offaug.pipeline.rollouts.lookahead import lookahead_rollout
from offaug.pipeline.rollouts.references import DiscountedValue, ValueFilter
from offaug.pipeline.rollouts.simulator import rollout


@dataclasses.dataclass(frozen=True)
class RolloutTask:
    """One unit of rollout work: a reference, not data, so it can travel to a Dask worker."""

    source: str
    """The dataset the policy was cloned from (its env, spaces and start states)."""
    policy: str
    """Path of the BC checkpoint."""
    config: RolloutConfig
    """Episodes, noise, seed, ... of this task."""
    shard_path: str
    """Where this task's shard goes."""
    env_id: str | None = None
    """Roll out in this env instead of the dataset's."""
    task_index: int = 0
    """Position among the tasks of one rollout stage."""
    learner: str | None = None
    """Checkpoint of a trained learner whose action the noise is centred on (None: BC's)."""


def save_faults(result: RolloutResult, directory: str | Path, name: str = "faults") -> Path | None:
    """Write the faults and offending steps to ``NAME.json`` (None when there were none)."""
    if not result.faults:
        return None
    path = Path(directory) / f"{name}.json"
    write_json_atomic(
        path,
        {"faults": [dataclasses.asdict(f) for f in result.faults], "bad_steps": result.bad_steps},
    )
    return path


def checkpoint_hash(path: str | Path) -> str:
    """The xxh3-128 digest of a policy checkpoint (recorded as provenance)."""
    return file_checksum(path)


# Environments kept by each worker process between rollout tasks, keyed by env spec.
_ENV_POOL: dict[str, list[Any]] = {}


def run_rollout_task(task: RolloutTask) -> RolloutShard:
    """Load the policy and dataset, roll out, write one shard atomically."""
    result = next(rollout_results(task, [task.config]))
    shard_path = Path(task.shard_path)
    shard_path.parent.mkdir(parents=True, exist_ok=True)
    save_faults(result, shard_path.parent, f"{shard_path.stem}.faults")
    ref = write_shard(result.transitions, shard_path)
    return RolloutShard(
        ref,
        result.weight_stats,
        len(result.faults),
        tuple(result.episode_returns),
        result.episodes_dropped,
        filter_record=result.filter_record,
        simulator_steps=result.simulator_steps,
    )


def rollout_results(task: RolloutTask, configs: Iterable[RolloutConfig]) -> Iterator[RolloutResult]:
    """``task``'s rollout under each of ``configs`` in turn, in memory (nothing is written).

    The policy, the dataset, its branch points and the filter's returns are loaded once, from
    ``task.config``: the configs may differ from it in episodes (or simulator steps), noise and
    seed only (the probes of :mod:`offaug.pipeline.rollouts.calibration`). Lazy, so a caller can
    stop early.
    """
    # torch comes with these: imported when a task runs, not when a Dask worker unpickles the
    # stage module.
    from offaug.algorithms.evaluate import make_env
    from offaug.pipeline.rollouts.policies import load_rollout_policy

    config = task.config
    branch = config.start == "dataset"
    data = load_with_states(task.source)[0] if branch else load_transitions(task.source)
    policy = load_rollout_policy(task.policy, task.learner)
    kwargs: dict[str, Any] = {}
    if config.max_episode_steps is not None:
        kwargs["max_episode_steps"] = config.max_episode_steps
    meta: dict[str, Any] = {key: data.meta.get(key) for key in SPACE_META_KEYS}
    meta["format"] = "offaug-rollout"
    checkpoints = {
        "source": task.source,
        "policy": task.policy,
        "policy_checkpoint_xxh3": checkpoint_hash(task.policy),
        "learner": task.learner,
        "learner_checkpoint_xxh3": checkpoint_hash(task.learner) if task.learner else None,
    }
    start_states = dataset_start_states(data) if branch else None
    probabilities = dataset_start_probabilities(data, config) if branch else None
    episode_filter = data_filter(data, config) or value_filter(data, config, policy)
    pool_key = json.dumps([data.meta.get("env_spec"), task.env_id, kwargs], sort_keys=True)
    pool = _ENV_POOL.setdefault(pool_key, [])
    taken: list[Any] = []

    def pooled_env() -> Any:
        env = pool.pop() if pool else make_env(data.meta, task.env_id, **kwargs)
        taken.append(env)
        return env

    for run in configs:
        same = dataclasses.replace(
            run,
            episodes=config.episodes,
            simulator_steps=config.simulator_steps,
            noise=config.noise,
            seed=config.seed,
        )
        if same != config:
            raise ValueError(
                "rollout_results: a config may differ from the task's in episodes, simulator"
                f" steps, noise and seed only, not {run} against {config}"
            )
        provenance = {
            **checkpoints,
            "noise": run.noise.text,
            "seed": run.seed,
            "env_id": task.env_id,
            "task_index": task.task_index,
        }
        run_meta = {**meta, "provenance": provenance}
        if run.lookahead is None:
            result = rollout(
                policy,
                pooled_env,
                run,
                start_states=start_states,
                start_probabilities=probabilities,
                episode_filter=episode_filter,
                meta=run_meta,
                close_envs=False,
            )
        else:
            result = lookahead_rollout(
                policy,
                pooled_env,
                run,
                start_states=start_states,
                start_probabilities=probabilities,
                meta=run_meta,
                close_envs=False,
                value=_lookahead_value(policy, run.lookahead),
            )
        # Back to this process's pool: the next task on this worker skips building them (every
        # episode starts with a seeded reset, so no state carries over).
        pool.extend(taken)
        taken.clear()
        yield result


def _lookahead_value(policy: Any, search: Lookahead) -> DiscountedValue | None:
    """The rollout learner's value for ``lookahead.bootstrap`` (None: off, or the BC clone,
    which :func:`lookahead_rollout` then refuses with what to change)."""
    own = getattr(policy, "discounted_value", None)
    return own() if search.bootstrap and own is not None else None


def dataset_start_probabilities(
    data: Transitions, config: RolloutConfig
) -> npt.NDArray[np.float64] | None:
    """How likely each dataset state is as a branch point: None (uniform) or ``sparse``."""
    if config.starts == "uniform":
        return None
    if config.starts == "sparse":
        return start_probabilities(sparsity(data.observations))
    raise ValueError(f"starts={config.starts!r} needs the model backend")


class FilterSettings(Protocol):
    """The filter fields a rollout config carries (:class:`RolloutConfig` and the workflow's
    rollout section alike)."""

    @property
    def filter(self) -> FilterKind: ...
    @property
    def filter_margin(self) -> float: ...
    @property
    def filter_tolerance(self) -> float: ...


def data_filter(data: Transitions, settings: FilterSettings) -> EpisodeFilter | None:
    """The episode filter of ``filter: data`` (None for any other filter)."""
    if settings.filter != "data":
        return None
    return EpisodeFilter(
        ReturnBaseline.from_transitions(data), settings.filter_margin, settings.filter_tolerance
    )


def value_filter(data: Transitions, settings: FilterSettings, policy: Any) -> ValueFilter | None:
    """The filter of ``filter: value`` (None for any other filter): the rollout learner's own
    value and discount over ``data``'s returns-to-go.

    Raises:
        ValueError: the rollout policy is not a learner with a value (the BC clone, BCQ).
    """
    if settings.filter != "value":
        return None
    learner: Any = getattr(policy, "learner", None)
    if not callable(getattr(learner, "state_values", None)):
        raise ValueError(
            "filter 'value' needs a rollout learner with a value of its own (rollout.policy:"
            " iql, td3bc, rebrac or cql), not "
            + ("the BC clone" if learner is None else type(learner).__name__)
        )
    return ValueFilter.from_data(data, learner.state_values, float(learner.config.gamma))


def filter_counts(results: Sequence[RolloutShard]) -> dict[str, int]:
    """Episodes kept and dropped by the filter over every task."""
    return {
        "kept": sum(len(r.episode_returns) for r in results),
        "dropped": sum(r.episodes_dropped for r in results),
    }


def filter_references(results: Sequence[RolloutShard]) -> dict[str, float | int | None] | None:
    """What the filter against the policy's own reference compared, pooled over every task
    (None for the other filters): the mean score and reference of the kept and of the dropped
    episodes, the kept episodes' mean improvement on their references, and how many references
    could not be computed (an environment that raised)."""
    records = [r.filter_record for r in results if r.filter_record is not None]
    if not records:
        return None
    scores = np.concatenate([np.asarray(r.scores, dtype=np.float64) for r in records])
    references = np.concatenate([np.asarray(r.references, dtype=np.float64) for r in records])
    kept = np.concatenate([np.asarray(r.kept, dtype=bool) for r in records])

    def mean(values: npt.NDArray[np.float64]) -> float | None:
        finite = values[np.isfinite(values)]
        return float(finite.mean()) if len(finite) else None

    return {
        "kept_score": mean(scores[kept]),
        "kept_reference": mean(references[kept]),
        "dropped_score": mean(scores[~kept]),
        "dropped_reference": mean(references[~kept]),
        "kept_improvement": mean(scores[kept] - references[kept]),
        "missing_references": int((~np.isfinite(references)).sum()),
    }


def task_share(total: int, tasks: int, index: int) -> int:
    """Task ``index``'s share of ``total`` (episodes, samples) split over ``tasks``: the first
    ``total % tasks`` tasks take one more."""
    return total // tasks + (1 if index < total % tasks else 0)


def split_tasks(
    source: str,
    policy: str,
    config: RolloutConfig,
    out: str | Path,
    tasks: int,
    env_id: str | None = None,
    learner: str | None = None,
) -> list[RolloutTask]:
    """Split ``config.episodes`` (or ``config.simulator_steps``) over ``tasks`` tasks, each with
    its own seed and shard."""
    budget = config.simulator_steps
    total = config.episodes if budget is None else budget
    tasks = max(1, min(tasks, total))
    counts = [task_share(total, tasks, i) for i in range(tasks)]

    def share(count: int, i: int) -> RolloutConfig:
        seed = config.seed * 1000 + i
        if budget is None:
            return dataclasses.replace(config, episodes=count, seed=seed)
        return dataclasses.replace(config, simulator_steps=count, seed=seed)

    return [
        RolloutTask(
            source=source,
            policy=str(policy),
            config=share(count, i),
            shard_path=str(Path(out) / f"shard-{i:05d}.arrow"),
            env_id=env_id,
            task_index=i,
            learner=learner,
        )
        for i, count in enumerate(counts)
    ]


def merge_rollout_shards(
    out: str | Path, results: Sequence[RolloutShard], params: Mapping[str, Any]
) -> ShardSet:
    """Write the shard-set manifest over finished rollout tasks.

    The weight statistics and the mean importance weight that ``self_normalised_weight`` is
    divided by are pooled over every shard (the set's reader applies the pooled mean), and so
    are the filter's counts (``filter_counts``: episodes ``kept`` and ``dropped``). ``params``
    (JSON values: the noise as its text) are stored in the manifest.
    """
    directory = Path(out).absolute()
    weights = []
    log_ratios = []
    meta: dict[str, Any] = {}
    for result in results:
        part = read_shard(result.shard.path, checksum=result.shard.checksum)
        meta = dict(part.meta)
        if part.importance_weight is None:
            continue
        weight = np.asarray(part.importance_weight, dtype=np.float64)
        weights.append(weight)
        if part.behaviour_log_prob is not None and part.rollout_log_prob is not None:
            log_ratios.append(
                np.asarray(part.behaviour_log_prob, dtype=np.float64)
                - np.asarray(part.rollout_log_prob, dtype=np.float64)
            )
        else:
            # Generated rows carry no densities: their weight (1) is the whole ratio.
            log_ratios.append(np.log(weight))
    max_weight = float(params.get("max_weight", RolloutConfig.max_weight))
    pooled_weights = np.concatenate(weights) if weights else np.zeros(0)
    pooled = weight_statistics(
        pooled_weights, np.concatenate(log_ratios) if log_ratios else np.zeros(0), max_weight
    )
    provenance = meta.get("provenance", {})
    normaliser = {POOLED_MEAN_WEIGHT: float(pooled_weights.mean())} if len(pooled_weights) else {}
    shard_set = ShardSet(
        directory=str(directory),
        shards=tuple(r.shard for r in results),
        source={
            "kind": "rollout",
            **{
                k: v
                for k, v in provenance.items()
                if k in ("source", "policy", "policy_checkpoint_xxh3", "learner", "env_id")
            },
        },
        params={
            **dict(params),
            "weight_stats": pooled,
            **normaliser,
            "filter_counts": filter_counts(results),
            "filter_references": filter_references(results),
            "per_shard": [
                {
                    "weight_stats": r.weight_stats,
                    "faults": r.faults,
                    "episodes": len(r.episode_returns),
                    "episodes_dropped": r.episodes_dropped,
                    "filter_record": _record_json(r.filter_record),
                }
                for r in results
            ],
        },
        meta={k: v for k, v in meta.items() if k != "rollout"},
    )
    shard_set.write_manifest()
    return ShardSet.open(directory)


def _record_json(record: FilterRecord | None) -> dict[str, list[Any]] | None:
    """A filter record as strict JSON: a reference that could not be computed is null."""
    if record is None:
        return None
    values = {name: list(value) for name, value in dataclasses.asdict(record).items()}
    values["references"] = [r if np.isfinite(r) else None for r in record.references]
    return values


@dataclasses.dataclass(frozen=True)
class RolloutOutcome:
    """A finished :func:`rollout_to_shard_set`: the shard set and each task's result."""

    shard_set: ShardSet
    tasks: tuple[RolloutShard, ...]

    @property
    def faults(self) -> int:
        """Environment faults over all tasks."""
        return sum(task.faults for task in self.tasks)


def rollout_to_shard_set(
    source: str,
    policy: str | Path,
    config: RolloutConfig,
    out: str | Path,
    *,
    tasks: int = 1,
    env_id: str | None = None,
    learner: str | Path | None = None,
    overwrite: bool = False,
    on_task: Callable[[RolloutTask, int], None] | None = None,
) -> RolloutOutcome:
    """Roll out ``config.episodes`` in ``tasks`` shards here and write them as one shard set.

    The set is built in a temporary sibling of ``out`` and moved into place whole, so ``out``
    holds the complete set or what was there before.

    Args:
        source: The dataset the policy was cloned from.
        policy: The BC checkpoint.
        config: Episodes, noise, seed, ... of the whole rollout.
        out: The shard-set directory to write.
        tasks: Shards (units of work), each with its own seed.
        env_id: Roll out in this env instead of the dataset's.
        learner: A trained learner's checkpoint to centre the noise on (None: BC's action).
        overwrite: Replace an existing ``out``.
        on_task: Called with each task and the number of tasks before it runs (progress).

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is false.
    """
    final = Path(out).absolute()
    with staged_directory(final, overwrite=overwrite) as staging:
        jobs = split_tasks(
            source,
            str(policy),
            config,
            staging,
            tasks,
            env_id=env_id,
            learner=None if learner is None else str(learner),
        )
        results = []
        for job in jobs:
            if on_task is not None:
                on_task(job, len(jobs))
            results.append(run_rollout_task(job))
        merge_rollout_shards(
            staging,
            results,
            {
                "noise": config.noise.text,
                "max_weight": config.max_weight,
                "episodes": config.episodes,
                "horizon": config.horizon,
                "starts": config.starts,
                "filter": config.filter,
                "filter_margin": config.filter_margin,
                "filter_tolerance": config.filter_tolerance,
                "tries": config.tries,
                "keep_reference": config.keep_reference,
                "lookahead": config.to_json()["lookahead"],
            },
        )
    return RolloutOutcome(ShardSet.open(final), tuple(results))
