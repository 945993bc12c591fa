"""Where a workflow's validation problems are: the field's path, its line in the file, the fix.

:func:`problems` turns a pydantic ``ValidationError`` into (path in the document, message) pairs;
an unknown key's message lists the keys allowed there (:func:`allowed_fields`). A validator that
checks a nested document itself (a learner's config, a recipe's overrides) reports several
problems at once as one error whose context carries them under ``"problems"`` (see
:func:`nested_problems`); each becomes a line of its own. :func:`line_of` finds a path's line in
the parsed YAML.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

Problem = tuple[tuple[Any, ...], str]
"""A problem: the path of the field in the document (keys and list indices), and a message."""

NESTED_PROBLEMS = "nested_problems"
"""The pydantic error type of :func:`nested_problems`."""


class WorkflowError(ValueError):
    """A workflow file that cannot be used; one line per problem, each with field and line."""


def nested_problems(found: Sequence[Problem]) -> PydanticCustomError:
    """One pydantic error standing for ``found``, each problem with its own path and message.

    Raised by a validator, its problems' paths are taken relative to where the validator runs
    (the top level for a model validator of the workflow).
    """
    summary = "; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in found)
    return PydanticCustomError(
        NESTED_PROBLEMS, "{summary}", {"summary": summary, "problems": list(found)}
    )


def problems(exc: ValidationError, root: type[BaseModel]) -> list[Problem]:
    """Each validation error of a ``root`` document as (its path, a message naming what is
    allowed); an error that carries several problems (``ctx["problems"]``) gives each one."""
    found: list[Problem] = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        message = error["msg"]
        nested = (error.get("ctx") or {}).get("problems")
        if nested is not None:
            found.extend((loc + tuple(where), text) for where, text in nested)
            continue
        if error["type"] == "extra_forbidden":
            message = f"unknown key; allowed here: {', '.join(allowed_fields(root, loc[:-1]))}"
        found.append((loc, message))
    return found


def allowed_fields(root: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The field names of the model at ``loc`` inside ``root`` ([] where there is none)."""
    model: Any = root
    for part in loc:
        fields = getattr(model, "model_fields", None)
        field = fields.get(str(part)) if fields is not None else None
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


def line_of(node: yaml.Node | None, loc: Sequence[Any]) -> int | None:
    """The 1-based line of the YAML node at ``loc`` (the deepest key that exists)."""
    line = None if node is None else node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = next(
                ((k, v) for k, v in node.value if getattr(k, "value", None) == str(part)), None
            )
            if found is None:
                break
            key, node = found
            line = key.start_mark.line + 1
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
