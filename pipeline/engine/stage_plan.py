"""A plan's stages before Dask: what each runs, on which inputs, and which are the same stage.

A stage's inputs are the stages its arguments name (:class:`Ref`, :class:`RefList`): they are
read off its arguments, never listed beside them. Each stage has one *key*: a hash of its
function, its config (seed included) and the keys of its inputs, never of its name. The key
decides both sharing and skipping. A stage whose key is already planned is not planned again;
whoever asks for it gets the first one's name: so there is one BC per (bc config, seed), one
rollout (tasks and merge) per (rollout config, BC, rollout policy, seed), and recipes that differ
only in how they train (``train.mixing``) share their rollouts. And a finished stage whose
recorded key equals its planned one is not run again (:mod:`offaug.pipeline.engine.scheduler`):
changing one parameter changes the key of that stage and of everything downstream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable
from typing import Any

from offaug.pipeline.contracts import RunIndex
from offaug.pipeline.rundir.keys import stage_key, to_json


@dataclasses.dataclass(frozen=True)
class Ref:
    """An argument that is another stage's result."""

    name: str
    """The stage whose result it is."""


@dataclasses.dataclass(frozen=True)
class RefList:
    """An argument that is the list of several stages' results."""

    names: tuple[str, ...]
    """The stages whose results it lists, in order."""


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One stage: ``function(*args)`` once the stages its arguments name have finished."""

    name: str
    """The stage's name in ``stages.json``, the run index and ``--force``."""
    function: Callable[..., Any]
    """A plain function of :mod:`offaug.pipeline.stages` (no Dask inside)."""
    config: Any
    """What the stage's key hashes besides its function and its inputs' keys (seed included)."""
    args: tuple[Any, ...]
    """Arguments; :class:`Ref` and :class:`RefList` ones name other stages (its inputs)."""
    resources: dict[str, float] | None = None
    """Dask resources a worker must offer to run it (``{"GPU": 1}``)."""
    aliases: tuple[str, ...] = ()
    """Other names that force this stage (a fused training's per-seed stages)."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The stages its arguments name, in order, each once."""
        names: list[str] = []
        for arg in self.args:
            if isinstance(arg, Ref):
                names.append(arg.name)
            elif isinstance(arg, RefList):
                names.extend(arg.names)
        return tuple(dict.fromkeys(names))


@dataclasses.dataclass
class Plan:
    """The planned stages, in dispatch order, and where each run's results are."""

    stages: dict[str, StageSpec] = dataclasses.field(default_factory=dict)
    keys: dict[str, str] = dataclasses.field(default_factory=dict)
    """Stage name -> key."""
    by_key: dict[str, str] = dataclasses.field(default_factory=dict)
    """Key -> the stage name that has it."""
    index: RunIndex = dataclasses.field(
        default_factory=lambda: RunIndex(primary_seed=0, seeds=[], runs=[], recipes={})
    )

    def add(self, spec: StageSpec) -> str:
        """Plan ``spec`` unless a stage of the same key is planned; return the name used.

        Raises:
            KeyError: an argument names a stage not planned yet (stages are planned in
                dispatch order, inputs first).
        """
        missing = [name for name in spec.inputs if name not in self.keys]
        if missing:
            raise KeyError(f"stage {spec.name!r} takes stages not planned before it: {missing}")
        function = getattr(spec.function, "func", spec.function)  # a partial's function
        key = stage_key(
            f"{function.__module__}.{function.__qualname__}",
            to_json(spec.config),
            [self.keys[name] for name in spec.inputs],
        )
        if key in self.by_key:
            return self.by_key[key]
        if spec.name in self.stages:
            raise ValueError(f"two different stages are both named {spec.name!r}")
        self.stages[spec.name] = spec
        self.keys[spec.name] = key
        self.by_key[key] = spec.name
        return spec.name

    @property
    def names(self) -> list[str]:
        return list(self.stages)


def path_name(text: str) -> str:
    """``text`` as a file name: characters other than letters, digits and ``._=,@+-[]``
    become ``_``, with a short hash of ``text`` appended when any did (so names stay apart)."""
    safe = re.sub(r"[^A-Za-z0-9._=,@+\-\[\]]", "_", text)
    if safe == text:
        return text
    return f"{safe}-{hashlib.sha256(text.encode()).hexdigest()[:6]}"
