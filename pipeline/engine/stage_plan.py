"""A plan's stages before Dask: what each runs, on which inputs, and which are the same stage.

Each stage has an *identity*: a hash of its function, its config (seed included)
and the identities of its inputs, never of its name. A stage whose identity is already planned
is not planned again; whoever asks for it gets the first one's name. So there is one BC per
(bc config, seed), one rollout (tasks and merge) per (rollout config, BC, rollout policy, seed),
and recipes that differ only in how they train (``train.mixing``) share their rollouts.
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
class StageSpec:
    """One stage to add to the scheduler: ``function(*args)`` once ``inputs`` have finished."""

    name: str
    function: Callable[..., Any]
    config: Any
    """What the stage's key hashes besides its inputs' keys (seed included)."""
    inputs: tuple[str, ...]
    args: tuple[Any, ...]
    """Arguments; :class:`~offaug.pipeline.engine.scheduler.Ref` ones name other stages."""
    resources: dict[str, float] | None = None
    aliases: tuple[str, ...] = ()
    """Other names that force this stage (a fused training's per-seed stages)."""


@dataclasses.dataclass
class Plan:
    """The planned stages, in dispatch order, and where each run's results are."""

    stages: dict[str, StageSpec] = dataclasses.field(default_factory=dict)
    identities: dict[str, str] = dataclasses.field(default_factory=dict)
    """Stage name -> identity."""
    by_identity: dict[str, str] = dataclasses.field(default_factory=dict)
    """Identity -> the stage name that has it."""
    index: RunIndex = dataclasses.field(
        default_factory=lambda: RunIndex(primary_seed=0, seeds=[], runs=[], recipes={})
    )

    def add(self, spec: StageSpec) -> str:
        """Plan ``spec`` unless a stage of the same identity is planned; return the name used."""
        function = getattr(spec.function, "func", spec.function)  # a partial's function
        identity = stage_key(
            f"{function.__module__}.{function.__qualname__}",
            to_json(spec.config),
            [self.identities[i] for i in spec.inputs],
        )
        if identity in self.by_identity:
            return self.by_identity[identity]
        if spec.name in self.stages:
            raise ValueError(f"two different stages are both named {spec.name!r}")
        self.stages[spec.name] = spec
        self.identities[spec.name] = identity
        self.by_identity[identity] = spec.name
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
