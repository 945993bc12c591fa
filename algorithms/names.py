"""The names of offaug's learners and of its weightings: the one list of each.

:mod:`offaug.algorithms.registry` says where each learner lives, the workflow schema
(:mod:`offaug.pipeline.schema.sections`) accepts these names, and ``offaug train`` lists them in
its help. This module imports nothing heavy (no torch): the schema reads it on the client.
"""

from __future__ import annotations

import typing
from typing import Literal

OfflineLearner = Literal[
    "cql", "bcq", "bc", "discrete_cql", "discrete_bcq", "iql", "td3bc", "rebrac"
]
"""The offline learners a workflow trains."""
Learner = Literal[OfflineLearner, "sac"]
"""Every learner ``offaug train`` trains: the offline ones, and SAC (online SAC makes the dataset
levels; offline it is plain off-policy SAC without a constraint, a reference)."""
OFFLINE_LEARNERS: tuple[OfflineLearner, ...] = typing.get_args(OfflineLearner)
LEARNERS: tuple[Learner, ...] = typing.get_args(Learner)

Weighting = Literal["none", "behaviour", "policy"]
"""How augmented rows are weighted in the losses: not at all, by their recorded importance weight
beta_hat/mu, or by pi/mu from the learner's current policy
(:mod:`offaug.algorithms.training.weighting`)."""
WEIGHTINGS: tuple[Weighting, ...] = typing.get_args(Weighting)
