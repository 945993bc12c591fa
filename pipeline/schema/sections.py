"""The sections of a workflow that name the data and train on it (source, bc, train): one
pydantic model each, every field documented. The rollout section is
:mod:`offaug.pipeline.schema.rollout_section`'s.

A workflow is data only: every choice is a ``Literal`` (no field can name a Python callable) and
unknown keys are errors. :mod:`offaug.pipeline.schema.workflow` assembles them into a ``Workflow``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from offaug.algorithms.names import (
    OFFLINE_LEARNERS,
    GeneratingPolicy,
    Level,
    OfflineLearner,
    Weighting,
)
from offaug.pipeline.contracts import STAGE_KEY_CONTEXT


class StrictSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MakeSource(StrictSection):
    """How to make the source dataset when it is missing (offaug make-dataset)."""

    env: str = Field(description="Gymnasium env id, e.g. Hopper-v5.")
    policy: GeneratingPolicy = Field(
        "random",
        description="The generating policy: uniform random, or SAC trained online (D4RL levels).",
    )
    level: Level = Field("medium", description="With policy sac: which D4RL level to collect.")
    train_steps: int = Field(
        8000, gt=0, description="With policy sac: SAC's environment steps (its final policy)."
    )
    steps: int = Field(gt=0, description="Steps to collect (whole episodes).")
    format: Literal["hdf5", "arrow"] = Field("hdf5", description="Minari storage format.")
    seed: int = Field(0, description="Seed of resets and actions.")
    max_episode_steps: int | None = Field(None, gt=0, description="Override the time limit.")


class SourceConfig(StrictSection):
    """The dataset to augment."""

    dataset: str = Field(
        description="Minari id (under MINARI_DATASETS_PATH), Minari directory or D4RL .hdf5 file."
    )
    make: MakeSource | None = Field(None, description="Make the dataset first when it is missing.")
    download: bool = Field(
        False, description="Download a missing Minari dataset (needs a network)."
    )


class BCConfigModel(StrictSection):
    """Behaviour cloning: the rollout policy's warm start and the behaviour model."""

    steps: int = Field(
        20_000,
        gt=0,
        description="Gradient steps: the clone is the rollout policy, so train it to convergence.",
    )
    hidden: tuple[int, ...] = Field((64, 64), description="Hidden layer widths.")
    learning_rate: float = Field(1e-3, gt=0, description="Adam learning rate.")
    batch_size: int = Field(256, gt=0, description="Transitions per step.")
    compile: bool = Field(
        False,
        description=(
            "torch.compile the Gaussian BC loss: more steps per second once compiled, after a"
            " few seconds of compiling, so it pays for long runs (figures in"
            " benchmarks/RESULTS.md, train_bc_gaussian_compiled_*)."
        ),
    )
    evaluation_episodes: int = Field(
        10,
        ge=0,
        description=(
            "Greedy episodes to evaluate the clone in the dataset's env after training (its"
            " return and normalised score go into the BC stage's metrics; 0: no evaluation)."
        ),
    )


class StateNoiseModel(StrictSection):
    """S4RL state noise inside the loss (offaug.algorithms.training.state_noise)."""

    kind: Literal["gaussian", "uniform"] = Field(
        description="N(0, 1) or U(-1, 1) noise, times scale and each dimension's std."
    )
    scale: float = Field(
        gt=0, description="Noise size in units of each observation dimension's std."
    )


class TrainModel(StrictSection):
    """The offline learners trained on original and original + augmented data."""

    algorithms: tuple[OfflineLearner, ...] = Field(("cql", "bcq"), description="Learners to train.")
    steps: int = Field(10_000, gt=0, description="Gradient steps per run.")
    mixing: tuple[float, float] = Field(
        (0.5, 0.5), description="Share of original and augmented rows per batch."
    )
    mixing_follows_rows: bool = Field(
        False,
        description=(
            "Cap the augmented share of a batch at the augmented rows' share of all rows"
            " (original + augmented), the rest going to the original data: when the rollout"
            " filter keeps a few episodes they fill proportionally little of each batch instead"
            " of being repeated to fill the stated share."
        ),
    )
    baseline: bool = Field(
        True,
        description=(
            "Also train on the original data alone: each learner with train.steps, and again"
            " for each augmented arm's total gradient steps (its own and its rollout policy's:"
            " the bar it is judged against, see docs/pipeline.md)."
        ),
    )
    init: Literal["scratch", "plain", "policy"] = Field(
        "scratch",
        description=(
            "Where an augmented arm's learner starts: from scratch; from the same learner's"
            " plain run of the same seed (its checkpoint's weights), training train.steps more"
            " on the mix, its total gradient steps then including the plain run's; or 'policy':"
            " the learner that rolled out (rollout.policy; bc: the BC clone, its sizes as"
            " train.configs.bc's) continues from the policy whose rollouts it trains on (the"
            " last round's), already counted in its total, and the other learners from scratch."
        ),
    )
    configs: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Config overrides per learner: fields of its config class, checked here.",
    )
    # After algorithms and configs: its check reads them.
    weighting: Weighting = Field(
        "behaviour",
        description=(
            "How augmented rows are weighted in the losses: none; behaviour (their"
            " importance_weight beta_hat/mu); policy (pi/mu from each learner's current policy,"
            " for learners whose policy has a density). Weights are normalised within each"
            " source, so the mixing ratio is what a batch holds. true/false mean behaviour/none."
        ),
    )
    state_noise: StateNoiseModel | None = Field(
        None,
        description=(
            "S4RL noise on the observations and next observations of every training batch of"
            " the augmented runs, e.g. {kind: gaussian, scale: 0.003} (omit: off)."
        ),
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
    fuse_seeds: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "With several seeds, train each learner's seeds together as one batched network in"
            " one stage (learners that cannot train fused get one stage per seed); false: one"
            " stage per seed, spread over the cluster; auto: fused where it pays, i.e. every"
            " fusable learner on a GPU and all but CQL and BCQ on a CPU (device: train.device,"
            " else the training worker's: its fused stage then trains the seeds one after another"
            " where fusing does not pay). The outputs are the same either way up to float"
            " rounding, which can still move a seed's score (docs/performance.md)."
        ),
    )
    fuse_group: int = Field(
        5,
        gt=0,
        description=(
            "Fused seeds train in groups of at most this many, in the order of `seeds`, one"
            " stage per group: a study that adds seeds later trains only the groups they fill"
            " (a group that is not yet full is retrained when it grows), and two groups train"
            " at once on two workers. Only the grouping: it is not part of any stage's key."
        ),
    )

    @field_validator("configs")
    @classmethod
    def _configs_fit_their_learners(
        cls, value: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        learners = OFFLINE_LEARNERS
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

    @field_validator("weighting", mode="before")
    @classmethod
    def _booleans_name_a_weighting(cls, value: Any) -> Any:
        # Workflows written before there was a choice say true or false.
        if value is True:
            return "behaviour"
        if value is False:
            return "none"
        return value

    @field_validator("weighting")
    @classmethod
    def _policy_weights_need_a_density(cls, value: Weighting, info: ValidationInfo) -> Weighting:
        if value != "policy" or "configs" not in info.data:
            return value  # a broken configs mapping is reported by its own check
        # Imported here, not at the top: the registry imports torch (see learner_config_problems).
        from offaug.algorithms.registry import policy_weighting_refusal

        refusals = [
            refusal
            for algorithm in info.data.get("algorithms", ())
            if (refusal := policy_weighting_refusal(algorithm, info.data["configs"].get(algorithm)))
        ]
        if refusals:
            raise ValueError("; ".join(refusals))
        return value

    @field_validator("mixing")
    @classmethod
    def _mixing_valid(cls, value: tuple[float, float]) -> tuple[float, float]:
        if min(value) < 0 or sum(value) <= 0:
            raise ValueError("mixing needs two non-negative shares, not both zero")
        return value

    def fuses(self, algorithm: str, seeds: int, *, plain: bool) -> bool:
        """Whether ``algorithm``'s ``seeds`` seeds train in fused stages under these settings
        (``plain``: on the original data alone); the planner's rule, docs/pipeline.md."""
        if not self.fuse_seeds or seeds < 2 or self.fuse_group < 2 or self.compile:
            return False
        if not plain and (self.weighting == "policy" or self.state_noise is not None):
            return False  # drawn per batch by the single-seed loop only
        if not plain and self.init != "scratch":
            return False  # each seed starts from its own checkpoint: single-seed loop only
        # Imported here: the learners' modules import torch, and the client that plans a run
        # imports this module before anything heavy (offaug run takes its lock first).
        from offaug.algorithms.training.fused_loop import fusable, fusing_pays

        if self.fuse_seeds == "auto" and self.device is not None:
            # The workflow names the device: whether fusing pays there is known now, and seeds
            # that do not fuse train in parallel on the cluster.
            return fusing_pays(algorithm, self.device)
        # fuse_seeds true, or auto on the device the worker finds: the fused stage asks there
        # whether fusing pays, and trains its seeds one after another if not.
        return fusable(algorithm)

    @model_serializer(mode="wrap")
    def _dump(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        # The grouping of fused seeds is in each fused stage's own seeds: a stage key that also
        # hashed fuse_group would rerun every finished stage of a run whose grouping changed.
        data: dict[str, Any] = handler(self)
        if isinstance(info.context, dict) and info.context.get(STAGE_KEY_CONTEXT):
            data.pop("fuse_group", None)
        return data


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
    # unpickles this module's models before its first stage (offaug.pipeline.engine.workers).
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
