"""Recipes as partial overrides of a workflow's sections, and the grid that makes more of them.

Words used here:

* *section*: one of the workflow's ``bc``, ``rollout`` and ``train`` sections, a pydantic model;
* *overrides*: a partial document of a section, merged key by key into the workflow's own
  (nested mappings are merged, anything else is replaced) and validated by the section's model,
  so an override is checked exactly as the section itself is;
* *grid*: dotted fields (``rollout.noise``, ``train.configs.cql.alpha``) with a list of values
  each; every combination of values is one *grid point*, named from its values
  (``noise=gaussian:0.3,start=reset``).

:func:`resolve_recipes` resolves a workflow's recipes and grid into :class:`Recipe` records;
:mod:`offaug.pipeline.schema.workflow` passes its sections in.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from offaug.pipeline.contracts import is_plain
from offaug.pipeline.schema.rollout_section import RolloutModel
from offaug.pipeline.schema.sections import BCConfigModel, TrainModel
from offaug.pipeline.schema.validation import Problem, problems

Model = TypeVar("Model", bound=BaseModel)

DEFAULT_RECIPE = "augmented"
"""The recipe of a workflow without ``recipes`` and ``grid``: its own sections."""

SECTIONS = ("bc", "rollout", "train")
"""The sections a recipe or a grid key overrides."""

AUGMENTING_TRAIN_FIELDS = ("state_noise", "init")
"""Fields of the train section that only augmented arms use (the augmentation inside the loss,
the start from the plain run): at their defaults for the baseline."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One arm resolved: the workflow's sections with the recipe's overrides applied."""

    name: str
    bc: BCConfigModel
    rollout: RolloutModel
    train: TrainModel

    @property
    def has_rollouts(self) -> bool:
        """Whether it makes augmented data (backend ``none`` trains on the original only)."""
        return self.rollout.backend in ("simulator", "model", "diffusion")

    @property
    def rolls_out_a_policy(self) -> bool:
        """Whether its augmented data comes from a policy's rollouts (it needs the BC clone)."""
        return self.rollout.backend in ("simulator", "model")

    @property
    def final_policy_learner(self) -> str:
        """The learner whose policy the last rollout round rolls out: ``rounds_learner`` after
        the first round, else ``rollout.policy`` (``bc``: the clone, retrained as learner bc)."""
        rollout = self.rollout
        if rollout.rounds > 1 and rollout.rounds_learner is not None:
            return rollout.rounds_learner
        return rollout.policy


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in: nested mappings key by key, other values replaced."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(base: Model, overrides: Mapping[str, Any]) -> Model:
    """``base`` with ``overrides`` applied, validated by ``base``'s model.

    Raises:
        pydantic.ValidationError: the overridden section is invalid (paths inside the section).
    """
    if not overrides:
        return base
    return type(base).model_validate(merged(base.model_dump(mode="json"), overrides))


def nested(path: Sequence[str], value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for the path ``("a", "b")``."""
    out: Any = value
    for part in reversed(path):
        out = {part: out}
    result: dict[str, Any] = out
    return result


def grid_key_problem(key: str, sections: Mapping[str, type[BaseModel]]) -> str | None:
    """Why the dotted grid key ``key`` names no field of ``sections``, or None if it does.

    The path is followed through nested models; below a mapping-valued field (such as
    ``train.configs``) any key is accepted here and checked when the values are validated.
    """
    section, _, rest = key.partition(".")
    if section not in sections or not rest:
        return f"a grid key is SECTION.FIELD with SECTION one of {', '.join(sections)}"
    model: Any = sections[section]
    where = section
    for part in rest.split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None:
            return None  # below a mapping: checked with the values
        if part not in fields:
            return f"{where} has no field {part!r}; allowed here: {', '.join(sorted(fields))}"
        annotation = fields[part].annotation
        models = [
            a
            for a in getattr(annotation, "__args__", (annotation,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        model = models[0] if models else dict
        where = f"{where}.{part}"
    return None


def value_text(value: Any) -> str:
    """A grid value as it appears in a recipe name: strings as they are, others as JSON."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _labels(keys: Sequence[str]) -> dict[str, str]:
    """Each key's label in recipe names: its last part, or the whole key where that is shared."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {
        key: (short if last.count(short) == 1 else key)
        for key, short in zip(keys, last, strict=True)
    }


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """Every combination of the grid's values as (recipe name, overrides per section).

    Combinations come in the order of the keys and their values (the last key varies fastest).
    """
    keys = list(grid)
    labels = _labels(keys)
    points = []
    for values in itertools.product(*(grid[key] for key in keys)):
        name = ",".join(
            f"{labels[key]}={value_text(v)}" for key, v in zip(keys, values, strict=True)
        )
        overrides: dict[str, dict[str, Any]] = {}
        for key, value in zip(keys, values, strict=True):
            section, *path = key.split(".")
            overrides[section] = merged(overrides.get(section, {}), nested(path, value))
        points.append((name, overrides))
    return points


Overrides = Mapping[str, Mapping[str, Any]]
"""A recipe's overrides per section."""


def resolve_recipes(
    base: Mapping[str, BaseModel],
    recipes: Mapping[str, Overrides] | None,
    grid: Mapping[str, Sequence[Any]],
    found: list[Problem],
) -> dict[str, Recipe]:
    """The named recipes, then the grid's points, resolved against the sections ``base``.

    Without ``recipes`` and ``grid`` there is one recipe, :data:`DEFAULT_RECIPE`. Problems go
    to ``found`` with their paths from the top of the workflow: ``recipes.NAME.SECTION.FIELD``,
    ``grid.KEY`` (a key that names no field) and ``grid.KEY.INDEX`` (a value that does not
    validate); a recipe with a problem is left out.
    """
    sections = {name: type(model) for name, model in base.items()}
    wanted: list[tuple[tuple[Any, ...], str, Overrides]] = []
    if recipes is None and not grid:
        wanted.append((("recipes",), DEFAULT_RECIPE, {}))
    wanted.extend((("recipes", name), name, r) for name, r in (recipes or {}).items())
    grid_found = len(found)
    for key, values in grid.items():
        problem = grid_key_problem(key, sections)
        if problem is None and not values:
            problem = "give at least one value"
        if problem is not None:
            found.append((("grid", key), problem))
            continue
        section, *path = key.split(".")
        for index, value in enumerate(values):
            _recipe(base, key, {section: nested(path, value)}, ("grid", key, index), found)
    if grid and len(found) == grid_found:
        wanted.extend((("grid",), name, point) for name, point in grid_points(grid))
    resolved: dict[str, Recipe] = {}
    for where, name, overrides in wanted:
        if is_plain(name) or name in resolved:
            what = "a plain baseline's" if is_plain(name) else "another recipe's"
            found.append((where, f"recipe name {name!r} is {what}"))
            continue
        recipe = _recipe(base, name, overrides, where, found)
        if recipe is not None:
            resolved[name] = recipe
    return resolved


def _recipe(
    base: Mapping[str, BaseModel],
    name: str,
    overrides: Overrides,
    where: tuple[Any, ...],
    found: list[Problem],
) -> Recipe | None:
    parts: dict[str, Any] = {}
    for section, model in base.items():
        try:
            parts[section] = apply_overrides(model, overrides.get(section, {}))
        except ValidationError as exc:
            for loc, message in problems(exc, type(model)):
                if where[0] == "recipes":
                    found.append(((*where, section, *loc), message))
                else:  # a grid value (where ends in its index), or a combination of values
                    field = ".".join(map(str, (section, *loc)))
                    found.append(
                        (where, message if len(where) > 1 else f"{name}: {field}: {message}")
                    )
    if len(parts) < len(base):
        return None
    recipe = Recipe(name, parts["bc"], parts["rollout"], parts["train"])
    train = recipe.train
    if train.init == "policy" and (
        not recipe.rolls_out_a_policy or recipe.final_policy_learner not in train.algorithms
    ):
        found.append(
            (
                (*where, "train", "init") if where[0] == "recipes" else where,
                f"init 'policy' continues the learner that rolls out: it needs backend"
                f" simulator or model and the last round's learner"
                f" ({recipe.final_policy_learner}) among train.algorithms"
                f" {list(train.algorithms)}",
            )
        )
        return None
    return recipe
