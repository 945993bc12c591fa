"""How a learner describes its update so that K copies of it can train as one batched network.

A learner that trains fused (:class:`offaug.algorithms.fused.trainer.FusedTrainer`) exposes
``fused_spec() -> FusedSpec``: its modules, its optimisers, its target networks and its update
as a sequence of :class:`Phase` s, each a loss that is a pure function of the modules'
parameters, a batch, the step's random draws and the hyperparameters. The same loss methods
serve the learner's own ``update``, which calls them with its config's floats and draws its
noise from the global torch generator; fused, they run once for all members under
``torch.func.vmap`` with each member's parameters, batch, draws and hyperparameters (``(K,)``
tensors where the members differ).

A loss must therefore not draw random numbers itself (it takes them from ``noise``, which the
spec's ``noise`` function draws through :class:`Draws`), must read
every hyperparameter that may differ between members from ``hyper``, and must not toggle
``requires_grad`` (the fused trainer passes the parameters of modules a phase does not train
without a gradient).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from offaug.algorithms.batch import TorchBatch

Hyper = Mapping[str, Any]
"""Hyperparameters a loss reads: floats in a single run, 0-d tensors inside the fused ``vmap``."""

Randn = Callable[[tuple[int, ...]], torch.Tensor]
"""Draws standard normal noise of a shape (from the global generator, or a member's own)."""


class Draws:
    """A step's random draws from one generator, as a learner's ``noise`` asks for them.

    Called with a shape, standard normal noise (a :data:`Randn`); :meth:`uniform`, uniform
    noise. ``generator=None`` draws from the global generator of ``device``, as a single-seed
    run does; a member's generator draws on its own device and the noise moves to ``device``.
    ``step`` is the step the draws are for (counted from 0): a learner whose phases do not all
    run every step draws only what that step's phases read.
    """

    def __init__(
        self, device: torch.device, generator: torch.Generator | None = None, *, step: int = 0
    ) -> None:
        self.device = device
        self.generator = generator
        self.step = step
        self._source = device if generator is None else generator.device

    def __call__(self, shape: tuple[int, ...]) -> torch.Tensor:
        noise = torch.randn(shape, generator=self.generator, device=self._source)
        return noise.to(self.device)

    def uniform(self, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        """Noise uniform on ``[low, high)`` (``Tensor.uniform_``'s draw)."""
        noise = torch.empty(shape, device=self._source)
        return noise.uniform_(low, high, generator=self.generator).to(self.device)


PhaseLoss = Callable[
    [TorchBatch, Mapping[str, torch.Tensor], Hyper], tuple[torch.Tensor, dict[str, torch.Tensor]]
]
"""``(batch, noise, hyper) -> (scalar loss, detached scalar metrics)``."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """One gradient step of some of a learner's optimisers, then Polyak updates of targets."""

    loss: PhaseLoss
    """The loss whose gradient the phase's optimisers follow (their modules' parameters only)."""
    optimizers: tuple[str, ...]
    """Names in :attr:`FusedSpec.optimizers` stepped on this loss."""
    every: int = 1
    """The phase runs on the steps ``s`` (counted from 0) with ``s % every == 0``..."""
    start: int = 0
    """... and ``s >= start`` (a phase that waits for another's warm start)."""
    targets: tuple[str, ...] = ()
    """Target modules (keys of :attr:`FusedSpec.targets`) averaged towards their sources after."""
    looped_loss: PhaseLoss | None = None
    """The same loss for members run one after another (``FusedTrainer.looped``), where it may
    reuse buffers between members that ``vmap`` cannot; None: :attr:`loss`."""


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An Adam optimiser of one module, and the hyperparameter that is its learning rate."""

    optimizer: torch.optim.Optimizer
    module: str
    """Key in :attr:`FusedSpec.modules` of the module whose parameters it steps."""
    learning_rate: str
    """Key in :attr:`FusedSpec.hyperparameters` holding its learning rate."""


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """Everything a fused trainer needs to run one learner's update for K members at once."""

    modules: Mapping[str, nn.Module]
    """Every module a loss reads: trained ones, targets and normalisers (buffers)."""
    optimizers: Mapping[str, OptimizerSpec]
    targets: Mapping[str, str]
    """Target module -> the module it follows (same architecture), by Polyak rate ``tau``."""
    phases: tuple[Phase, ...]
    hyperparameters: Mapping[str, float]
    """The values of the learner's :attr:`fused_hyperparameters` (and data statistics)."""
    metrics: tuple[str, ...]
    """Metric names in the order the learner's ``update`` reports them."""
    noise: Callable[[int, Draws], dict[str, torch.Tensor]] | None = None
    """``(batch_size, draws) -> noise`` of one step, drawn in the order the learner's update
    draws it (a :data:`Randn` suffices for learners that draw normal noise only)."""
    carried: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Metrics of phases that do not run every step, as the learner last reported them."""
    schedule: Callable[[Any, Hyper], dict[str, Any]] | None = None
    """``(step, hyper) -> overridden hyperparameters`` of that step (learning-rate schedules).
    ``step`` is an int, or a 0-d int64 device tensor in a graph-safe step
    (:mod:`offaug.algorithms.fused.graph_step`), which a schedule must not read on the host."""
    tau: str = "tau"
    """Key in :attr:`hyperparameters` of the Polyak rate."""
    restore: Callable[[Mapping[str, torch.Tensor]], None] | None = None
    """Sets the learner's carried metrics from the fused trainer's (``steps`` is set for it)."""
    stacked: bool = False
    """Whether the phases' losses are member-agnostic, so that they also run once on all K
    members' stacked parameters without ``vmap``
    (:class:`~offaug.algorithms.fused.trainer.FusedTrainer` ``stacked``): every trained or target
    module then holds its parameters with a leading member axis (its networks' layers run as
    ``baddbmm`` over it), the batch and noise carry that axis too, every hyperparameter is a
    ``(K,)`` tensor, and the losses and metrics come out ``(K,)``. Such a loss reduces over the
    batch with ``mean(-1)`` (the batch is the last axis of a per-row vector), indexes critics from
    the end (``(..., E, B)``) and broadcasts a hyperparameter against rows with
    :func:`per_member`."""


def per_member(value: Any, like: torch.Tensor) -> Any:
    """A hyperparameter shaped to broadcast against ``like``, member by member.

    A float (a single-seed run) or a 0-d tensor (a member inside ``vmap``) as it is; a stacked
    run's ``(K,)`` tensor as ``(K, 1, ..., 1)`` with ``like``'s number of axes, so that member
    ``k``'s value meets member ``k``'s rows of a ``(K, B, ...)`` tensor.
    """
    if not torch.is_tensor(value) or value.dim() == 0:
        return value
    return value.view(value.shape[0], *([1] * (like.dim() - 1)))


def config_hyperparameters(config: Any, names: tuple[str, ...]) -> dict[str, float]:
    """The fields ``names`` of a config dataclass as floats (a learner's ``hyper`` mapping)."""
    return {name: float(getattr(config, name)) for name in names}


TARGET_COPY = "target_copy"
"""The Polyak-rate key of learners whose targets are hard copies (:func:`hard_copy_schedule`)."""


def hard_copy_schedule(copies: Callable[[int], bool]) -> Callable[[int, Hyper], dict[str, Any]]:
    """A :attr:`FusedSpec.schedule` whose :data:`TARGET_COPY` rate is 1 on the steps where
    ``copies(step)`` and 0 on the others: with ``tau=TARGET_COPY`` a phase's Polyak update is
    then a hard copy of its source or nothing (``lerp`` with weight 1 gives its end exactly)."""

    def schedule(step: int, hyper: Hyper) -> dict[str, Any]:
        rate = float(copies(step))
        gamma = hyper["gamma"]  # every learner has a discount: one value per member, fused
        return {TARGET_COPY: torch.full_like(gamma, rate) if torch.is_tensor(gamma) else rate}

    return schedule


def hard_copy_spec(
    modules: tuple[str, str],
    network: nn.Module,
    target: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: PhaseLoss,
    hyperparameters: Mapping[str, float],
    metrics: tuple[str, ...],
    copies: Callable[[int], bool],
) -> FusedSpec:
    """The spec of a learner with one trained network (``modules[0]``, stepped by ``optimizer``
    on ``loss`` with learning rate ``learning_rate``) and a target (``modules[1]``) copied from it
    on the steps where ``copies(step)``: DQN-style discrete learners."""
    name, target_name = modules
    return FusedSpec(
        modules={name: network, target_name: target},
        optimizers={name: OptimizerSpec(optimizer, name, "learning_rate")},
        targets={target_name: name},
        phases=(Phase(loss, (name,), targets=(target_name,)),),
        hyperparameters=hyperparameters,
        metrics=metrics,
        schedule=hard_copy_schedule(copies),
        tau=TARGET_COPY,
    )
