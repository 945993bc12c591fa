"""Workflow files: a YAML document validated by a pydantic schema.

A workflow is data only: every choice is a ``Literal`` (no field can name a Python callable),
unknown keys are errors, and an error names the field, its line in the file and the allowed
values. ``offaug validate WORKFLOW`` runs this without running anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from offaug.pipeline.schema.recipes import (
    AUGMENTING_TRAIN_FIELDS,
    DEFAULT_RECIPE,
    Recipe,
    resolve_recipes,
)
from offaug.pipeline.schema.rollout_section import RolloutModel
from offaug.pipeline.schema.run_sections import (
    ClusterModel,
    DiagnosticsModel,
    EvaluationModel,
    PublishModel,
    ReportModel,
)
from offaug.pipeline.schema.sections import BCConfigModel, SourceConfig, StrictSection, TrainModel
from offaug.pipeline.schema.validation import (
    Problem,
    WorkflowError,
    line_of,
    nested_problems,
    problems,
)


class RecipeOverrides(StrictSection):
    """One named arm: partial overrides of the workflow's ``bc``, ``rollout`` and ``train``
    sections (any of their fields; nested mappings merge key by key)."""

    bc: dict[str, Any] = Field(default_factory=dict, description="Overrides of bc.")
    rollout: dict[str, Any] = Field(default_factory=dict, description="Overrides of rollout.")
    train: dict[str, Any] = Field(default_factory=dict, description="Overrides of train.")


class Workflow(StrictSection):
    """An augmentation workflow: source, BC, rollouts, train, diagnose, report, publish."""

    name: str = Field(description="A name for the run.")
    seed: int = Field(
        0, description="Seed of every stage; the stages of this seed keep their plain names."
    )
    seeds: tuple[int, ...] = Field(
        (),
        description="Training seeds: every recipe and learner is trained once per seed (default"
        " [seed]); BC and rollouts are made once per seed.",
    )
    source: SourceConfig
    bc: BCConfigModel = Field(default_factory=BCConfigModel)
    rollout: RolloutModel = Field(default_factory=RolloutModel)
    train: TrainModel = Field(default_factory=TrainModel)
    recipes: dict[str, RecipeOverrides] | None = Field(
        None,
        description="Named arms, each overriding parts of bc, rollout and train (default: one"
        f" recipe {DEFAULT_RECIPE!r}, the sections as written; none when a grid is given).",
    )
    grid: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Dotted fields (rollout.noise, train.mixing, train.configs.cql.alpha) with"
        " values to try: each combination is one more recipe, named from its values.",
    )
    evaluation: EvaluationModel = Field(default_factory=EvaluationModel)
    diagnostics: DiagnosticsModel = Field(default_factory=DiagnosticsModel)
    publish: PublishModel | None = Field(None, description="Publish the result (omit to skip).")
    report: ReportModel = Field(default_factory=ReportModel)
    cluster: ClusterModel = Field(default_factory=ClusterModel)
    shards: str | None = Field(
        None, description="Directory for shards every worker can reach (default RUN_DIR/shards)."
    )

    @model_validator(mode="before")
    @classmethod
    def _seeds_default_to_seed(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("seeds"):
            return {**data, "seeds": [data.get("seed", 0)]}
        return data

    @field_validator("seeds")
    @classmethod
    def _seeds_distinct(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"seeds must be distinct, got {list(value)}")
        return value

    @model_validator(mode="after")
    def _recipes_valid(self) -> Workflow:
        found: list[Problem] = []
        self._resolve(found)
        if found:
            raise nested_problems(found)
        return self

    def arms(self) -> dict[str, Recipe]:
        """The recipes trained on augmented data (or with train-level augmentation), by name:
        ``recipes`` and then the grid's points."""
        return self._resolve([])

    @property
    def plain_train(self) -> TrainModel:
        """The train section of the plain baseline: the workflow's own, with the fields only
        augmented arms use (:data:`AUGMENTING_TRAIN_FIELDS`: state noise, the start from the
        plain run) back at their defaults."""
        fields = TrainModel.model_fields
        plain = {n: fields[n].default for n in AUGMENTING_TRAIN_FIELDS if n in fields}
        return self.train.model_copy(update=plain) if plain else self.train

    def _resolve(self, found: list[Problem]) -> dict[str, Recipe]:
        base = {"bc": self.bc, "rollout": self.rollout, "train": self.train}
        recipes = None
        if self.recipes is not None:
            recipes = {name: r.model_dump() for name, r in self.recipes.items()}
        return resolve_recipes(base, recipes, self.grid, found)

    def digest(self) -> str:
        """A stable hash of the resolved workflow."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


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
        for loc, message in problems(exc, Workflow):
            field = ".".join(str(p) for p in loc) or "(top level)"
            line = line_of(node, loc)
            where = f"{file}:{line}" if line else str(file)
            lines.append(f"{where}: {field}: {message}")
        raise WorkflowError("\n".join(lines)) from exc
