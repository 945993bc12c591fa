"""What every offaug learner shares: the trainer protocol, checkpoints, small helpers.

Process set-up (threads, denormals, malloc, seeding, the device) is
:mod:`offaug.algorithms.runtime`'s.

A learner is one file with a frozen config dataclass (one documented field each), small pure
loss functions, and a trainer class with ``update(batch) -> metrics``, ``state_dict()``,
``load_state_dict()`` and ``act(observations)``. Metrics are returned as detached tensors so
that a training step never waits for a host sync; the training loop turns them into numbers
only when it logs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import gymnasium as gym
import numpy as np
import numpy.typing as npt
import torch
from minari.serialization import deserialize_space
from torch import nn

from offaug.algorithms.batch import TorchBatch
from offaug.datasets.atomic import atomic_path

CHECKPOINT_FORMAT = 1

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@dataclasses.dataclass(frozen=True)
class Spaces:
    """What a learner needs to know about the data it learns from."""

    observation_dim: int
    """Length of a (flattened) observation."""
    action_dim: int
    """Length of a continuous action, or the number of discrete actions."""
    discrete: bool = False
    """Whether actions are discrete indices."""
    action_low: tuple[float, ...] = ()
    """Lower bounds of a Box action space (continuous only)."""
    action_high: tuple[float, ...] = ()
    """Upper bounds of a Box action space (continuous only)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Spaces:
        """Inverse of :meth:`to_json`."""
        return cls(
            observation_dim=int(data["observation_dim"]),
            action_dim=int(data["action_dim"]),
            discrete=bool(data.get("discrete", False)),
            action_low=tuple(float(x) for x in data.get("action_low", ())),
            action_high=tuple(float(x) for x in data.get("action_high", ())),
        )


@runtime_checkable
class Trainer(Protocol):
    """The interface every learner implements."""

    spaces: Spaces
    config: Any

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One gradient step on ``batch``; returns detached scalar metrics."""

    def state_dict(self) -> dict[str, Any]:
        """Networks, optimisers and counters: everything needed to resume."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """Greedy actions for a batch of observations, in the environment's action space."""


@runtime_checkable
class PolicyDensity(Protocol):
    """The optional capability of a learner whose policy has a density (BC's Gaussian, SAC's
    and CQL's tanh-Gaussian): what ``weighting: policy`` needs to weight rows by pi/mu.

    A learner has it when its class defines :meth:`policy_log_prob`; a learner whose density
    depends on its config (BC: Gaussian or deterministic) also defines a static
    ``has_density(config) -> bool`` (:func:`has_policy_density` asks both).
    """

    def policy_log_prob(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``log pi_theta(a|s)`` of the current policy: ``(B, obs), (B, act) -> (B,)``.

        ``actions`` are in the environment's units and the density is over the environment's
        action box, the convention of ``rollout_log_prob``: the density over the normalised box
        ``[-1, 1]^d`` plus :attr:`ActionNormaliser.log_abs_det` (discrete: the log-probability
        of the action index). No gradient is needed or kept.
        """


def has_policy_density(trainer_type: type[Any], config: Any) -> bool:
    """Whether a trainer of ``trainer_type`` built with ``config`` has :class:`PolicyDensity`."""
    if not callable(getattr(trainer_type, "policy_log_prob", None)):
        return False
    has_density = getattr(trainer_type, "has_density", None)
    return True if has_density is None else bool(has_density(config))


@runtime_checkable
class StateValue(Protocol):
    """The optional capability of a learner with a value of its own policy (IQL's V; TD3+BC's,
    ReBRAC's and CQL's critics at the policy's action): what ``rollout.filter: value`` needs to
    bootstrap a short branch's return.

    A learner has it when its class defines :meth:`state_values`; the discount it learned
    with is its config's ``gamma``.
    """

    def state_values(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """``V(s)`` in the data's reward units: ``(B, obs) -> (B,)``."""


def has_state_value(trainer_type: type[Any]) -> bool:
    """Whether trainers of ``trainer_type`` have :class:`StateValue`."""
    return callable(getattr(trainer_type, "state_values", None))


def reads_sources(trainer: object) -> bool:
    """Whether ``trainer``'s losses read each row's source (``TorchBatch.set_index``), so that
    its batches must be converted ``with_sources`` (CQL with ``conservative_rows: original``)."""
    return bool(getattr(trainer, "reads_sources", False))


def weighted_mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``mean(weights * values)`` over the batch; with ``None`` or all-ones weights the plain mean.

    Training weights are normalised within each source (each source's weights sum to its row
    count: :func:`offaug.datasets.sampler.normalise_source`), so this mean is
    ``sum_s (n_s / B) * sum_{i in s} w_i l_i / sum_{i in s} w_i``.

    The batch is the last axis: ``(B,) -> ()``, and a stacked fused run's ``(K, B) -> (K,)``.
    """
    if weights is None:
        return values.mean(-1)
    return (values * weights).mean(-1)


@torch.no_grad()
def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Polyak averaging ``target <- (1 - tau) * target + tau * source`` in one fused call."""
    target_params: list[torch.Tensor] = list(target.parameters())
    source_params: list[torch.Tensor] = list(source.parameters())
    torch._foreach_lerp_(target_params, source_params, tau)


@torch.no_grad()
def hard_update(target: nn.Module, source: nn.Module) -> None:
    """Copy ``source``'s parameters into ``target`` in one fused call (DQN-style targets)."""
    target_params: list[torch.Tensor] = list(target.parameters())
    source_params: list[torch.Tensor] = list(source.parameters())
    torch._foreach_copy_(target_params, source_params)


def frozen_copy(module: ModuleT) -> ModuleT:
    """A deep copy of ``module`` that takes no gradient: a target network."""
    return copy.deepcopy(module).requires_grad_(False)


def adam(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Adam:
    """Adam with the fused kernel (one kernel for all parameters) where the device has it."""
    params = list(params)
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.Adam(params, lr=lr, fused=fused)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load an optimiser's state from a copy.

    ``Optimizer.load_state_dict`` keeps the moment tensors it is given: loading another live
    trainer's state would make both advance the same Adam moments.
    """
    optimizer.load_state_dict(copy.deepcopy(dict(state)))


def config_to_json(config: Any) -> dict[str, Any]:
    """A frozen config dataclass as a JSON-ready dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def config_from_json(config_type: type[Any], data: Mapping[str, Any]) -> Any:
    """Build ``config_type`` from a dict, refusing unknown keys by name."""
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown {config_type.__name__} fields {unknown}; allowed: {sorted(fields)}"
        )
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return config_type(**values)


def save_checkpoint(
    path: str | Path,
    *,
    algorithm: str,
    config: Any,
    spaces: Spaces,
    state: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint that loads without pickle (``torch.load(weights_only=True)``).

    Written to a temporary name and renamed, so a crash never leaves half a checkpoint.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "algorithm": algorithm,
        "config": json.dumps(config_to_json(config)),
        "spaces": json.dumps(spaces.to_json()),
        "extra": json.dumps(dict(extra or {})),
        "state": dict(state),
    }
    with atomic_path(final) as tmp:
        torch.save(payload, tmp)
    return final


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint."""

    algorithm: str
    config: dict[str, Any]
    spaces: Spaces
    state: dict[str, Any]
    extra: dict[str, Any]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded safely."""


def load_checkpoint(
    path: str | os.PathLike[str], map_location: str | torch.device = "cpu"
) -> Checkpoint:
    """Load a checkpoint with ``weights_only=True``: a pickled object payload is refused.

    Raises:
        CheckpointError: the file is not an offaug checkpoint or holds anything but tensors
            and plain containers.
    """
    file = Path(path)
    try:
        payload = torch.load(file, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{file}: cannot load safely ({exc})") from exc
    except Exception as exc:
        # weights_only refusals surface as pickle.UnpicklingError (or its subclasses).
        raise CheckpointError(f"{file}: refused: not a plain weights file ({exc})") from exc
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{file}: not an offaug checkpoint (format {CHECKPOINT_FORMAT})")
    return Checkpoint(
        algorithm=str(payload["algorithm"]),
        config=json.loads(payload["config"]),
        spaces=Spaces.from_json(json.loads(payload["spaces"])),
        state=payload["state"],
        extra=json.loads(payload["extra"]),
    )


def spaces_from_transitions(meta: Mapping[str, Any], observation_dim: int, actions: Any) -> Spaces:
    """Derive :class:`Spaces` from a dataset's ``meta`` (serialised spaces) and its actions."""
    serialised = meta.get("action_space")
    if isinstance(serialised, str):
        space = deserialize_space(serialised)
        if isinstance(space, gym.spaces.Discrete):
            return Spaces(observation_dim, int(space.n), discrete=True)
        if isinstance(space, gym.spaces.Box):
            low = np.broadcast_to(space.low, space.shape).reshape(-1)
            high = np.broadcast_to(space.high, space.shape).reshape(-1)
            finite = np.isfinite(low).all() and np.isfinite(high).all()
            if finite:
                return Spaces(
                    observation_dim,
                    int(np.prod(space.shape)),
                    action_low=tuple(float(x) for x in low),
                    action_high=tuple(float(x) for x in high),
                )
    array = np.asarray(actions)
    if array.dtype.kind in "iu":
        return Spaces(observation_dim, int(array.max()) + 1, discrete=True)
    # Without a recorded space, use the data's own range (D4RL locomotion actions are [-1, 1]).
    low = np.minimum(array.min(axis=0), -1.0)
    high = np.maximum(array.max(axis=0), 1.0)
    return Spaces(
        observation_dim,
        int(array.shape[1]),
        action_low=tuple(float(x) for x in low),
        action_high=tuple(float(x) for x in high),
    )
