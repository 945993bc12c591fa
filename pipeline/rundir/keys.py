"""Stage keys and the JSON form of stage results.

A stage's key (:class:`~offaug.pipeline.engine.stage_plan.Plan` gives each stage one) is a hash of
its function, its part of the workflow and the keys of its inputs: equal configs give equal keys
however their YAML orders mapping keys, and changing one parameter changes the key of that stage
and of everything downstream. Results (the small frozen records of
:mod:`offaug.pipeline.rundir.run_layout`) are stored as JSON objects that carry their type's name
under ``"__type__"`` so they decode back to the same dataclass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from pydantic import BaseModel

from offaug.datasets.shards import ShardRef
from offaug.pipeline.contracts import (
    STAGE_KEY_CONTEXT,
    AugmentedRef,
    DatasetRef,
    FilterRecord,
    ModelRef,
    RolloutShard,
)
from offaug.pipeline.rollouts.calibration import NoiseCalibration
from offaug.pipeline.rollouts.noise import Component, NoiseSpec

RESULT_TYPES: dict[str, type[Any]] = {
    "DatasetRef": DatasetRef,
    "ModelRef": ModelRef,
    "AugmentedRef": AugmentedRef,
    "RolloutShard": RolloutShard,
    "FilterRecord": FilterRecord,
    "ShardRef": ShardRef,
    "NoiseCalibration": NoiseCalibration,
    "NoiseSpec": NoiseSpec,
    "Component": Component,
}
"""The result dataclasses a stage record can hold, by the name stored in ``"__type__"``."""


def stage_key(*parts: Any) -> str:
    """A stage key: the same for equal configs however their YAML orders mapping keys."""
    text = json.dumps(parts, sort_keys=True, default=_key_default)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _key_default(value: Any) -> Any:
    # A pydantic model hashes by its JSON dump, never by str(): str() keeps the insertion order
    # of nested dicts, so the same workflow loaded from a key-sorted YAML got another key and
    # reran stages that had finished.
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", context={STAGE_KEY_CONTEXT: True})
    return str(value)


def to_json(value: Any) -> Any:
    """``value`` as JSON data; a dataclass becomes its fields plus ``"__type__"``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "__type__": type(value).__name__,
            **{f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return value


def from_json(value: Any) -> Any:
    """The inverse of :func:`to_json` for the types of :data:`RESULT_TYPES`.

    An object whose ``"__type__"`` is not one of them decodes to a plain dict of its fields.
    """
    if isinstance(value, dict) and "__type__" in value:
        kind = RESULT_TYPES.get(value["__type__"])
        fields = {k: from_json(v) for k, v in value.items() if k != "__type__"}
        if kind is None:
            return fields
        # JSON has no tuples: restore the dataclass fields that are tuples.
        for field in dataclasses.fields(kind):
            if isinstance(fields.get(field.name), list) and "tuple" in str(field.type):
                fields[field.name] = tuple(fields[field.name])
        return kind(**fields)
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    return value
