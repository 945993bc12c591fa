"""Where a learner's fused update is described (:class:`~offaug.algorithms.fusing.FusedSpec`).

Most learners describe their own, in their file, as a ``fused_spec()`` method. CQL's and BCQ's
fused updates need a module of their own (:mod:`offaug.algorithms.fused.cql`,
:mod:`offaug.algorithms.fused.bcq`), which import the learner; this table finds them by trainer
class, so no learner imports the fused package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from offaug.algorithms.fused.bcq import bcq_fused_spec
from offaug.algorithms.fused.cql import cql_fused_spec
from offaug.algorithms.fusing import FusedSpec
from offaug.algorithms.learners.bcq import BCQ
from offaug.algorithms.learners.cql import CQL

_SEPARATE_SPECS: dict[type[Any], Callable[[Any], FusedSpec]] = {
    CQL: cql_fused_spec,
    BCQ: bcq_fused_spec,
}


def has_fused_spec(trainer_type: type[Any]) -> bool:
    """Whether trainers of ``trainer_type`` can train fused."""
    return trainer_type in _SEPARATE_SPECS or callable(getattr(trainer_type, "fused_spec", None))


def fused_spec(trainer: Any) -> FusedSpec:
    """``trainer``'s update as a :class:`FusedSpec`."""
    separate = _SEPARATE_SPECS.get(type(trainer))
    if separate is not None:
        return separate(trainer)
    make = getattr(trainer, "fused_spec", None)
    if not callable(make):
        raise ValueError(f"{type(trainer).__name__} does not train fused")
    spec: FusedSpec = make()
    return spec
