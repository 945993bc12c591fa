"""The names offaug's choices are made by: learners, weightings, dataset-making policies and
levels; the one list of each.

:mod:`offaug.algorithms.registry` says where each learner lives, the workflow schema
(:mod:`offaug.pipeline.schema.sections`) accepts these names, and the command line offers them.
This module imports nothing heavy (no torch): the schema and the CLI read it on the client.
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

GeneratingPolicy = Literal["random", "sac"]
"""The policy that collects a made dataset: uniform random, or SAC trained online
(:mod:`offaug.algorithms.online.making`)."""
Level = Literal["random", "medium", "expert", "medium-replay"]
"""The D4RL dataset levels SAC's runs give: the random policy's, a medium policy's, the expert's,
and the replay buffer up to the medium policy (:mod:`offaug.algorithms.online.levels`)."""
