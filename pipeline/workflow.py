"""Workflow files: a YAML document validated by a pydantic schema.

A workflow is data only: every choice is a ``Literal`` (no field can name a Python callable),
unknown keys are errors, and an error names the field, its line in the file and the allowed
values. ``offaug validate WORKFLOW`` runs this without running anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from offaug.pipeline.noise import DEFAULT_NOISE, NoiseSpec, NoiseSpecError, parse_noise
from offaug.pipeline.rank_metric import RankMetric, parse_rank_metric

Algorithm = Literal["cql", "bcq", "bc", "discrete_cql", "discrete_bcq", "iql", "td3bc", "rebrac"]


def _noise_spec(value: Any) -> NoiseSpec:
    if isinstance(value, NoiseSpec):
        return value
    if not isinstance(value, str):
        raise ValueError(f"noise is a string such as 'gaussian:0.1', not {value!r}")
    try:
        return parse_noise(value)
    except NoiseSpecError as exc:
        raise ValueError(str(exc)) from exc


Noise = Annotated[
    NoiseSpec,
    PlainValidator(_noise_spec),
    PlainSerializer(lambda spec: spec.text, return_type=str),
    WithJsonSchema({"type": "string"}),
]
"""A noise specification: parsed once at validation, written back as the text it came from."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MakeSource(_Strict):
    """How to make the source dataset when it is missing (offaug make-dataset)."""

    env: str = Field(description="Gymnasium env id, e.g. Hopper-v5.")
    policy: Literal["random"] = Field("random", description="The generating policy.")
    steps: int = Field(gt=0, description="Steps to collect (whole episodes).")
    format: Literal["hdf5", "arrow"] = Field("hdf5", description="Minari storage format.")
    seed: int = Field(0, description="Seed of resets and actions.")
    max_episode_steps: int | None = Field(None, gt=0, description="Override the time limit.")


class SourceConfig(_Strict):
    """The dataset to augment."""

    dataset: str = Field(
        description="Minari id (under MINARI_DATASETS_PATH), Minari directory or D4RL .hdf5 file."
    )
    make: MakeSource | None = Field(None, description="Make the dataset first when it is missing.")
    download: bool = Field(
        False, description="Download a missing Minari dataset (needs a network)."
    )


class BCConfigModel(_Strict):
    """Behaviour cloning: the rollout policy's warm start and the behaviour model."""

    steps: int = Field(5000, gt=0, description="Gradient steps.")
    hidden: tuple[int, ...] = Field((256, 256), description="Hidden layer widths.")
    learning_rate: float = Field(1e-3, gt=0, description="Adam learning rate.")
    batch_size: int = Field(256, gt=0, description="Transitions per step.")
    compile: bool = Field(
        False,
        description=(
            "torch.compile the Gaussian BC loss: 1.13x (256x256) to 1.42x (64x64) steps/s on one"
            " CPU thread after 3-11 s of compiling; pays for runs of tens of thousands of steps."
        ),
    )


class DynamicsModel(_Strict):
    """The learned-dynamics ensemble (rollout backend 'model')."""

    members: int = Field(7, gt=0, description="Ensemble size.")
    hidden: tuple[int, ...] = Field((200, 200, 200), description="Hidden widths.")
    steps: int = Field(5000, gt=0, description="Training steps.")
    horizon: int = Field(5, gt=0, description="Model rollout length H.")
    penalty: float = Field(1.0, ge=0, description="MOPO's lambda.")
    starts: int = Field(1000, gt=0, description="Dataset states to branch from per task.")


class RolloutModel(_Strict):
    """Noisy rollouts of the BC policy."""

    backend: Literal["simulator", "model"] = Field(
        "simulator", description="The dataset's simulator, or a learned dynamics ensemble."
    )
    noise: Noise = Field(
        DEFAULT_NOISE,
        description="gaussian:SIGMA, ou:SIGMA[:THETA], uniform, +epsilon:EPS, mixtures W*C+W*C.",
    )
    episodes: int = Field(100, gt=0, description="Episodes in total (simulator backend).")
    tasks: int = Field(4, gt=0, description="Units of parallel work; one shard each.")
    n_envs: int = Field(16, gt=0, description="Environments stepped together per task.")
    start: Literal["reset", "dataset"] = Field(
        "reset", description="Start from env resets or branch from dataset states."
    )
    max_weight: float = Field(100.0, gt=0, description="Importance weights are clipped here.")
    max_episode_steps: int | None = Field(None, gt=0, description="Override the time limit.")
    env: str | None = Field(None, description="Roll out in this env id instead of the dataset's.")
    dynamics: DynamicsModel = Field(
        default_factory=DynamicsModel, description="Model backend settings."
    )

    @model_validator(mode="after")
    def _tasks_fit(self) -> RolloutModel:
        if self.backend == "simulator" and self.tasks > self.episodes:
            raise ValueError(f"tasks ({self.tasks}) must not exceed episodes ({self.episodes})")
        return self


class TrainModel(_Strict):
    """The offline learners trained on original and original + augmented data."""

    algorithms: tuple[Algorithm, ...] = Field(("cql", "bcq"), description="Learners to train.")
    steps: int = Field(10_000, gt=0, description="Gradient steps per run.")
    mixing: tuple[float, float] = Field(
        (0.5, 0.5), description="Share of original and augmented rows per batch."
    )
    weighting: bool = Field(True, description="Weight augmented rows by their importance weights.")
    baseline: bool = Field(True, description="Also train on the original data alone.")
    configs: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Config overrides per learner: fields of its config class, checked here.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="Dask resources a training task needs, e.g. {GPU: 1}."
    )
    device: str | None = Field(
        None, description="Torch device for training (default: cuda if present)."
    )
    compile: bool = Field(
        False,
        description=(
            "torch.compile each learner's parts where it pays (today Gaussian BC's loss; the"
            " others train as without it)."
        ),
    )
    fuse_seeds: bool = Field(
        True,
        description=(
            "With several seeds, train each learner's seeds together as one batched network in"
            " one stage (learners that cannot train fused get one stage per seed); false: one"
            " stage per seed, spread over the cluster. The outputs are the same either way."
        ),
    )

    @field_validator("configs")
    @classmethod
    def _configs_fit_their_learners(
        cls, value: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        learners = typing.get_args(Algorithm)
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for algorithm, config in value.items():
            if algorithm not in learners:
                allowed = ", ".join(learners)
                problems.append(((algorithm,), f"unknown learner; allowed here: {allowed}"))
                continue
            problems.extend(
                ((algorithm, *where), message)
                for where, message in learner_config_problems(algorithm, config)
            )
        if problems:
            # load_workflow turns each problem into its own line, with the field's line number.
            summary = "; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems)
            raise PydanticCustomError(
                LEARNER_CONFIG_ERROR, "{summary}", {"summary": summary, "problems": problems}
            )
        return value

    @field_validator("mixing")
    @classmethod
    def _mixing_valid(cls, value: tuple[float, float]) -> tuple[float, float]:
        if min(value) < 0 or sum(value) <= 0:
            raise ValueError("mixing needs two non-negative shares, not both zero")
        return value


LEARNER_CONFIG_ERROR = "learner_config"
"""The pydantic error type of :meth:`TrainModel._configs_fit_their_learners`."""


def learner_config_problems(
    algorithm: str, config: Mapping[str, Any]
) -> list[tuple[tuple[str | int, ...], str]]:
    """What is wrong with ``config`` as overrides of learner ``algorithm``'s config dataclass.

    Each problem is (the field's path inside ``config``, message): an unknown field name (with
    the allowed ones), or a value of the wrong type (checked strictly, as the learner will use
    it: a YAML list stands for a tuple, an int for a float, nothing else is converted).
    """
    # Imported here, not at the top: the learners' modules import torch, and every Dask worker
    # unpickles this module's models before its first stage (offaug.pipeline.workers).
    from offaug.algorithms.registry import config_type

    kind = config_type(algorithm)
    fields = {f.name for f in dataclasses.fields(kind)}
    hints = typing.get_type_hints(kind)
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for name, item in config.items():
        if name not in fields:
            allowed = ", ".join(sorted(fields))
            problems.append(((name,), f"unknown {kind.__name__} field; allowed here: {allowed}"))
            continue
        try:
            TypeAdapter(hints[name]).validate_python(_lists_as_tuples(item), strict=True)
        except ValidationError as exc:
            for error in exc.errors():
                problems.append(((name, *error["loc"]), error["msg"]))
    return problems


def _lists_as_tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_lists_as_tuples(v) for v in value)
    return value


class EvaluationModel(_Strict):
    """Evaluation of trained policies in the environment."""

    episodes: int = Field(5, gt=0, description="Episodes per evaluation.")
    every: int = Field(
        0, ge=0, description="Evaluate every N training steps too (0: only at the end)."
    )


class DiagnosticsModel(_Strict):
    """Distribution-shift diagnostics."""

    enabled: bool = Field(True, description="Run the diagnostics stage.")
    k: int = Field(5, gt=0, description="Neighbours for the out-of-distribution score.")
    quantile: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="OOD threshold: this quantile of the dataset's own k-NN distances.",
    )
    gamma: float = Field(0.99, gt=0, lt=1, description="Discount for Monte-Carlo returns.")
    max_states: int = Field(5000, gt=0, description="States sampled for the k-NN and value checks.")
    rank_metric: str | None = Field(
        None,
        description=(
            "Rank the trained policies by a weighted score of their evaluation episodes, e.g. "
            "'return:0.6,success:0.3,length:0.1' (metrics return, success, length; -NAME: lower "
            "is better). Unset: by mean return, then success rate, then length."
        ),
    )

    @field_validator("rank_metric")
    @classmethod
    def _check_rank_metric(cls, value: str | None) -> str | None:
        if value is not None:
            parse_rank_metric(value)  # RankMetricError is a ValueError: pydantic reports it
        return value

    @property
    def rank_weights(self) -> RankMetric | None:
        """``rank_metric`` parsed (None when unset)."""
        return None if self.rank_metric is None else parse_rank_metric(self.rank_metric)


class PublishModel(_Strict):
    """Publishing the augmented dataset as a Minari dataset."""

    dataset_id: str = Field(description="Minari id to write: [namespace/]name-vK.")
    include: Literal["original", "augmented", "both"] = Field(
        "both", description="Which data to publish."
    )
    format: Literal["hdf5", "arrow"] = Field("hdf5", description="Minari storage format.")
    overwrite: bool = Field(False, description="Replace an existing dataset with this id.")
    root: str | None = Field(None, description="Datasets root (default MINARI_DATASETS_PATH).")


class ReportModel(_Strict):
    """What the run report shows beyond the metrics: videos and the dataset doctor."""

    videos: bool = Field(
        False,
        description=(
            "Film each trained policy's best and worst evaluation episode and a few original and"
            " augmented episodes (offscreen OpenGL; without it the report says so)."
        ),
    )
    video_episodes: int = Field(
        2,
        gt=0,
        description=(
            "Episodes shown per trained policy and per kind of data, at evenly spaced return "
            "ranks: 1 the best, 2 the best and the worst, 3 adds the median."
        ),
    )
    max_report_mb: float = Field(
        20.0,
        gt=0,
        description=(
            "Bound on report.html: animations lose frames, then resolution, then whole episodes"
            " until it fits, and the report says what it left out."
        ),
    )
    width: int | None = Field(None, gt=0, description="Frame width (default the renderer's).")
    height: int | None = Field(None, gt=0, description="Frame height (default the renderer's).")
    frame_skip: int | None = Field(
        None, gt=0, description="Film every k-th step (default the renderer's)."
    )
    max_frames: int | None = Field(
        None, gt=0, description="At most this many frames per episode (default the renderer's)."
    )
    doctor: bool = Field(
        True, description="Run the dataset doctor on the source and on the augmented data."
    )


class ClusterModel(_Strict):
    """Where the Dask graph runs."""

    kind: Literal["local", "address", "slurm", "kubernetes"] = Field(
        "local",
        description=(
            "A LocalCluster, an existing scheduler, or one built with dask-jobqueue / "
            "dask-kubernetes."
        ),
    )
    address: str | None = Field(
        None, description="Scheduler address (tcp://HOST:PORT) for kind 'address'."
    )
    workers: int | None = Field(None, gt=0, description="Workers (local: default one per core).")
    threads_per_worker: int = Field(1, gt=0, description="Threads per worker (and torch threads).")
    memory_limit: str = Field("auto", description="Memory per worker.")
    job: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for the SLURM/Kubernetes cluster class.",
    )

    @model_validator(mode="after")
    def _address_given(self) -> ClusterModel:
        if self.kind == "address" and not self.address:
            raise ValueError("cluster.kind 'address' needs cluster.address: tcp://HOST:PORT")
        return self


class Workflow(_Strict):
    """An augmentation workflow: source, BC, rollouts, train, diagnose, report, publish."""

    name: str = Field(description="A name for the run.")
    seed: int = Field(0, description="Seed of every stage.")
    source: SourceConfig
    bc: BCConfigModel = Field(default_factory=BCConfigModel)
    rollout: RolloutModel = Field(default_factory=RolloutModel)
    train: TrainModel = Field(default_factory=TrainModel)
    evaluation: EvaluationModel = Field(default_factory=EvaluationModel)
    diagnostics: DiagnosticsModel = Field(default_factory=DiagnosticsModel)
    publish: PublishModel | None = Field(None, description="Publish the result (omit to skip).")
    report: ReportModel = Field(default_factory=ReportModel)
    cluster: ClusterModel = Field(default_factory=ClusterModel)
    shards: str | None = Field(
        None, description="Directory for shards every worker can reach (default RUN_DIR/shards)."
    )

    def digest(self) -> str:
        """A stable hash of the resolved workflow."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class WorkflowError(ValueError):
    """A workflow file that cannot be used; one line per problem, each with field and line."""


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the YAML node at ``loc`` (the deepest key that exists)."""
    line = None if node is None else node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((v for k, v in node.value if getattr(k, "value", None) == str(part)), None)
            key = next((k for k, v in node.value if getattr(k, "value", None) == str(part)), None)
            if match is None:
                break
            line = key.start_mark.line + 1 if key is not None else line
            node = match
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def load_workflow(path: str | Path) -> Workflow:
    """Read and validate a workflow file.

    Raises:
        WorkflowError: unreadable YAML, or fields that fail validation (each named with its
            line and what is allowed).
    """
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise WorkflowError(f"{file}: cannot read ({exc})") from exc
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise WorkflowError(f"{file}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise WorkflowError(f"{file}: a workflow is a mapping of sections (name, source, ...)")
    try:
        return Workflow.model_validate(data)
    except ValidationError as exc:
        lines = []
        for loc, message in _problems(exc):
            field = ".".join(str(p) for p in loc) or "(top level)"
            line = _line_of(node, loc)
            where = f"{file}:{line}" if line else str(file)
            lines.append(f"{where}: {field}: {message}")
        raise WorkflowError("\n".join(lines)) from exc


def _problems(exc: ValidationError) -> list[tuple[tuple[Any, ...], str]]:
    """Each validation error as (its path in the document, a message naming what is allowed)."""
    problems: list[tuple[tuple[Any, ...], str]] = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        message = error["msg"]
        if error["type"] == LEARNER_CONFIG_ERROR:
            problems.extend((loc + where, text) for where, text in error["ctx"]["problems"])
            continue
        if error["type"] == "extra_forbidden":
            message = f"unknown key; allowed here: {', '.join(_allowed_fields(loc[:-1]))}"
        problems.append((loc, message))
    return problems


def _allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    model: Any = Workflow
    for part in loc:
        field = model.model_fields.get(str(part)) if hasattr(model, "model_fields") else None
        if field is None:
            return []
        annotation = field.annotation
        candidates = [
            a
            for a in getattr(annotation, "__args__", (annotation,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if not candidates:
            return []
        model = candidates[0]
    return sorted(model.model_fields)
