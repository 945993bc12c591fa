"""Offline learners by name; each is imported only when asked for."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from offaug.algorithms.base import (
    Spaces,
    Trainer,
    config_from_json,
    has_policy_density,
    has_state_value,
)
from offaug.algorithms.names import LEARNERS, Learner


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """Where a learner lives: module, trainer class and config class."""

    module: str
    trainer: str
    config: str
    discrete: bool


_WHERE: dict[Learner, AlgorithmSpec] = {
    "bc": AlgorithmSpec("offaug.algorithms.learners.bc", "BC", "BCConfig", discrete=False),
    "cql": AlgorithmSpec("offaug.algorithms.learners.cql", "CQL", "CQLConfig", discrete=False),
    "discrete_cql": AlgorithmSpec(
        "offaug.algorithms.learners.discrete_cql", "DiscreteCQL", "DiscreteCQLConfig", discrete=True
    ),
    "bcq": AlgorithmSpec("offaug.algorithms.learners.bcq", "BCQ", "BCQConfig", discrete=False),
    "discrete_bcq": AlgorithmSpec(
        "offaug.algorithms.learners.discrete_bcq", "DiscreteBCQ", "DiscreteBCQConfig", discrete=True
    ),
    "iql": AlgorithmSpec("offaug.algorithms.learners.iql", "IQL", "IQLConfig", discrete=False),
    "td3bc": AlgorithmSpec(
        "offaug.algorithms.learners.td3bc", "TD3BC", "TD3BCConfig", discrete=False
    ),
    "rebrac": AlgorithmSpec(
        "offaug.algorithms.learners.rebrac", "ReBRAC", "ReBRACConfig", discrete=False
    ),
    # Online SAC (dataset levels); offline it is plain off-policy SAC without a constraint.
    "sac": AlgorithmSpec("offaug.algorithms.learners.sac", "SAC", "SACConfig", discrete=False),
}
ALGORITHMS: dict[str, AlgorithmSpec] = {name: _WHERE[name] for name in LEARNERS}
"""Where each learner of :data:`~offaug.algorithms.names.LEARNERS` lives, in that order (the
type checker refuses a spec under another name; a learner without one fails at import)."""


def available() -> list[str]:
    """Names of the learners whose modules are present."""
    names = []
    for name, spec in ALGORITHMS.items():
        if importlib.util.find_spec(spec.module) is not None:
            names.append(name)
    return names


def config_type(name: str) -> type[Any]:
    """The config dataclass of learner ``name``."""
    spec = _spec(name)
    config: type[Any] = getattr(importlib.import_module(spec.module), spec.config)
    return config


def trainer_type(name: str) -> type[Any]:
    """The trainer class of learner ``name``."""
    spec = _spec(name)
    trainer: type[Any] = getattr(importlib.import_module(spec.module), spec.trainer)
    return trainer


def policy_weighting_refusal(name: str, config: Mapping[str, Any] | None = None) -> str | None:
    """Why learner ``name`` with ``config`` cannot weight rows by pi/mu, or None when it can.

    ``weighting: policy`` recomputes pi_theta(a|s) / mu(a|s) from the learner's current policy,
    which needs a policy with a density (:class:`~offaug.algorithms.base.PolicyDensity`). An
    unknown config field is not reported here (the config check names it).
    """
    try:
        config_obj = config_from_json(config_type(name), dict(config or {}))
    except (TypeError, ValueError):
        return None
    kind = trainer_type(name)
    if has_policy_density(kind, config_obj):
        return None
    able = [n for n in ALGORITHMS if has_policy_density(trainer_type(n), config_type(n)())]
    why = " with this config" if callable(getattr(kind, "policy_log_prob", None)) else ""
    return (
        f"weighting 'policy' needs a learner whose policy has a density (pi/mu is computed from "
        f"it); {name}'s policy has no density{why}. Use weighting 'behaviour' or 'none', or one "
        f"of: {', '.join(able)}"
    )


def state_value_refusal(name: str, use: str = "filter 'value'") -> str | None:
    """Why learner ``name`` cannot give ``use`` its value, or None when it can.

    ``rollout.filter: value`` adds ``gamma^H V(s_H)`` of the rollout policy's own value
    (:class:`~offaug.algorithms.base.StateValue`) to a branch's discounted return; MOBILE's
    penalty (``dynamics.penalty: mobile``) takes the std of ``r + gamma V(s')`` over a dynamics
    ensemble's members.
    """
    if has_state_value(trainer_type(name)):
        return None
    able = [n for n in ALGORITHMS if has_state_value(trainer_type(n))]
    return (
        f"{use} needs a rollout policy with a value of its own (V(s), or its critics at"
        f" its action); {name} has none. Use one of: {', '.join(able)}"
    )


def build(
    name: str, spaces: Spaces, config: dict[str, Any] | None = None, *, device: str | None = None
) -> Trainer:
    """A fresh trainer for learner ``name`` with ``config`` overriding its defaults.

    Raises:
        ValueError: an unknown learner, an unknown config field, or a learner that does not fit
            the action space (e.g. ``cql`` on discrete actions: use ``discrete_cql``).
    """
    spec = _spec(name)
    if name != "bc" and spec.discrete != spaces.discrete:
        kind = "discrete" if spaces.discrete else "continuous"
        fitting = [n for n, s in ALGORITHMS.items() if s.discrete == spaces.discrete]
        raise ValueError(f"{name} does not learn {kind} actions; use one of {fitting}")
    module = importlib.import_module(spec.module)
    config_obj = config_from_json(getattr(module, spec.config), config or {})
    trainer: Trainer = getattr(module, spec.trainer)(spaces, config_obj, device=device)
    return trainer


def _spec(name: str) -> AlgorithmSpec:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(ALGORITHMS)}") from None
