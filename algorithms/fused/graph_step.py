"""A learner's update as a graph-safe step: no host syncs, no Python branches on tensor values.

:class:`GraphStep` runs the update a learner describes as a
:class:`~offaug.algorithms.fusing.FusedSpec` on the state of a
:class:`~offaug.algorithms.fused.trainer.FusedTrainer` of K members (K = 1 for a single-seed
run): the ``(K, P)`` parameter buffers, the Adam moments and step counts, the frozen-member mask
and the carried metrics. Every tensor it writes is written in place, and it reads nothing from
the host, so the same call can be compiled by ``torch.compile(fullgraph=True)``, unrolled N
times and captured in one CUDA graph (:mod:`offaug.algorithms.training.graphed` does both).

What changes against :meth:`FusedTrainer.update <offaug.algorithms.fused.trainer.FusedTrainer.
update>`, which it otherwise follows line by line:

* the step counter is a device tensor. A phase that does not run every step (TD3+BC's delayed
  actor, BCQ's warm start) runs its loss every step and multiplies its update by a 0/1 mask of
  ``step % every == 0 and step >= start``: its Adam step, its moments, its Polyak update and
  its carried metrics change only where the mask is 1. Schedules (IQL's cosine rate, CQL's
  behaviour-cloning warm start) take that tensor as their step;
* gradients come from ``torch.func.grad`` of the summed member losses with respect to the
  trained ``(K, P)`` buffers, not from ``backward``, so the whole step is one traceable function;
* Adam is written out (:func:`masked_adam`), masked per member and per phase;
* the step's noise is an argument: drawn by :meth:`GraphStep.draw` from the members'
  generators outside the traced function (Dynamo does not trace generators), every step the
  draws a step on which every phase runs reads;
* metrics are summed on the device; :meth:`GraphStep.flush_metrics` reads them (one sync).

Given the same batch and noise, a step equals the learner's ``update`` to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.func import functional_call, vmap

from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.fused.stacking import FlatAdam
from offaug.algorithms.fused.trainer import FusedTrainer
from offaug.algorithms.fusing import Draws, FusedSpec, Phase


def every_phase_step(spec: FusedSpec) -> int:
    """The first step on which every phase of ``spec`` runs: the draws the graph step makes."""
    period = math.lcm(*(phase.every for phase in spec.phases))
    start = max(phase.start for phase in spec.phases)
    return -(-start // period) * period


def masked_adam(adam: FlatAdam, grad: torch.Tensor, lr: torch.Tensor, mask: torch.Tensor) -> None:
    """One Adam step of the members where ``mask`` ``(K, 1)`` (bool), in place; torch's Adam
    formula (bias corrections from float64 step counts), the others' tensors unchanged."""
    steps = adam.steps + mask
    dtype = adam.group.flat.dtype
    step_size = (lr[:, None] / (1.0 - adam.beta1**steps)).to(dtype)
    correction = (1.0 - adam.beta2**steps).sqrt().to(dtype)
    flat, exp_avg, exp_avg_sq = adam.group.flat, adam.exp_avg, adam.exp_avg_sq
    new_avg = torch.lerp(exp_avg, grad, 1.0 - adam.beta1)
    new_sq = exp_avg_sq * adam.beta2 + (1.0 - adam.beta2) * grad * grad
    denom = new_sq.sqrt() / correction + adam.eps
    updated = flat - new_avg * step_size / denom
    flat.copy_(torch.where(mask, updated, flat))
    exp_avg.copy_(torch.where(mask, new_avg, exp_avg))
    exp_avg_sq.copy_(torch.where(mask, new_sq, exp_avg_sq))
    adam.steps.copy_(steps)


class GraphStep:
    """The update of a fused trainer's K members as one graph-safe call (see the module).

    Args:
        fused: The members' state; it is updated in place, so ``fused.member(k)`` and its
            checkpoints see every step taken here. Call :meth:`sync_host` after a run of calls.
    """

    def __init__(self, fused: FusedTrainer) -> None:
        self.fused = fused
        self.spec = spec = fused.spec
        self.members = fused.members
        device = fused.device
        self.step = torch.tensor(fused.steps, dtype=torch.int64, device=device)
        """The device's step counter (the host's is ``fused.steps``, moved by :meth:`sync_host`)."""
        self.metric_sums = {name: torch.zeros(self.members, device=device) for name in spec.metrics}
        self.metric_count = torch.zeros((), device=device)
        self.draw_step = every_phase_step(spec)
        # Each optimiser's Adam steps must be counted on the device from here on.
        for adam in fused.adams.values():
            adam.steps_may_differ()
        self._buffers = fused.loss_buffers

    # -- inputs --------------------------------------------------------------------------------

    def draw(self, batch_size: int) -> dict[str, torch.Tensor]:
        """One step's noise for every member ``(K, ...)``, from each member's generator (eager:
        generators are not traced; a captured graph replays them)."""
        if self.spec.noise is None:
            return {}
        fused = self.fused
        draws = [
            self.spec.noise(batch_size, Draws(fused.device, g, step=self.draw_step))
            for g in fused.generators
        ]
        return {name: torch.stack([d[name] for d in draws]) for name in draws[0]}

    # -- the step ------------------------------------------------------------------------------

    def __call__(
        self,
        fields: Mapping[str, torch.Tensor],
        noise: Mapping[str, torch.Tensor],
        pattern: tuple[bool, ...] | None = None,
    ) -> None:
        """One update of every member on its rows of ``fields`` (``TorchBatch`` fields,
        ``(K, B, ...)``) with ``noise`` (:meth:`draw`'s), in place.

        ``pattern``: which phases run at this step, when the caller knows it on the host
        (:func:`phase_pattern`): a phase that does not run is left out rather than masked, and
        a compiled step is one graph per pattern. None: every phase masked by the device's
        counter, one graph for every step (what a captured graph replays).
        """
        fused, spec = self.fused, self.spec
        step = self.step
        hyper: dict[str, Any] = dict(fused.hyper)
        if spec.schedule is not None:
            hyper.update(spec.schedule(step, hyper))
        metrics: dict[str, torch.Tensor] = dict(fused.carried)
        for number, phase in enumerate(spec.phases):
            if pattern is not None and not pattern[number]:
                continue
            on = _runs(phase, step) if pattern is None else None
            loss, phase_metrics, grads = self._phase(phase, dict(fields), dict(noise), hyper)
            with torch.no_grad():
                finite = torch.isfinite(loss)
                active = fused.active & (finite if on is None else finite | ~on)
                fused.active.copy_(active)
                mask = active if on is None else active & on
                for name in phase.optimizers:
                    option = spec.optimizers[name]
                    masked_adam(
                        fused.adams[name],
                        grads[option.module],
                        hyper[option.learning_rate],
                        mask[:, None],
                    )
                for target in phase.targets:
                    weight = (hyper[spec.tau] * mask)[:, None]
                    source = fused.flats[spec.targets[target]].flat
                    fused.flats[target].flat.lerp_(source, weight)
                for name, value in phase_metrics.items():
                    if name in fused.carried:
                        carried = value if on is None else torch.where(on, value, metrics[name])
                        fused.carried[name].copy_(carried)
                        metrics[name] = carried
                    else:
                        metrics[name] = value
        with torch.no_grad():
            for name, total in self.metric_sums.items():
                total.add_(metrics[name].float())
            self.metric_count.add_(1.0)
            fused.member_steps.add_(fused.active)
            step.add_(1)

    def _phase(
        self,
        phase: Phase,
        fields: dict[str, torch.Tensor],
        noise: dict[str, torch.Tensor],
        hyper: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every member's loss ``(K,)`` and metrics, and the gradient ``(K, P)`` of each module
        the phase trains, from one ``torch.func.grad`` of the summed losses."""
        fused = self.fused
        trained = {self.spec.optimizers[o].module for o in phase.optimizers}

        def total(flats: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
            tensors = dict(self._buffers)
            for module, group in fused.flats.items():
                views = group.split(flats[module]) if module in flats else group.views
                tensors.update({f"parts.{module}.{name}": t for name, t in views.items()})
            loss, metrics = self._losses(phase, tensors, fields, noise, hyper)
            return loss.sum(), (loss.detach(), metrics)

        grad_of = torch.func.grad(total, has_aux=True)
        grads, (loss, metrics) = grad_of({m: fused.flats[m].flat for m in sorted(trained)})
        return loss, {k: v.detach() for k, v in metrics.items()}, grads

    def _losses(
        self,
        phase: Phase,
        tensors: dict[str, torch.Tensor],
        fields: dict[str, torch.Tensor],
        noise: dict[str, torch.Tensor],
        hyper: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The members' losses and metrics ``(K,)``: once on the stacked tensors, member 0's
        alone (K = 1), or under ``vmap``."""
        container = self.fused.container

        def member(
            tensors: dict[str, torch.Tensor],
            fields: dict[str, torch.Tensor],
            noise: dict[str, torch.Tensor],
            hyper: dict[str, Any],
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            batch = TorchBatch(**fields)
            output: tuple[torch.Tensor, dict[str, torch.Tensor]] = functional_call(
                container, tensors, (phase, batch, noise, hyper), strict=False, tie_weights=False
            )
            return output

        if self.fused.stacked:
            return member(tensors, fields, noise, hyper)
        if self.members == 1:
            row = _row_zero((tensors, fields, noise, hyper))
            loss, metrics = member(*row)
            return loss.unsqueeze(0), {k: v.unsqueeze(0) for k, v in metrics.items()}
        batched: tuple[torch.Tensor, dict[str, torch.Tensor]] = vmap(member, randomness="error")(
            tensors, fields, noise, hyper
        )
        return batched

    # -- the host's view -----------------------------------------------------------------------

    def sync_host(self, steps: int) -> None:
        """Count ``steps`` calls on the host (``fused.steps``), as the device counted them."""
        self.fused.steps += steps

    def flush_metrics(self) -> dict[str, torch.Tensor]:
        """Each metric's mean ``(K,)`` over the calls since the last flush, then reset
        (one host sync when the caller reads them)."""
        count = self.metric_count.clamp_min(1.0)
        means = {name: total / count for name, total in self.metric_sums.items()}
        means = {name: value.clone() for name, value in means.items()}
        for total in self.metric_sums.values():
            total.zero_()
        self.metric_count.zero_()
        return means


def phase_pattern(spec: FusedSpec, step: int) -> tuple[bool, ...]:
    """Which of ``spec``'s phases run at ``step`` (counted from 0), as the host counts it."""
    return tuple(step >= p.start and step % p.every == 0 for p in spec.phases)


def _runs(phase: Phase, step: torch.Tensor) -> torch.Tensor | None:
    """Whether ``phase`` runs at ``step``, a 0-d bool tensor; None where it runs every step."""
    on: torch.Tensor | None = None
    if phase.every > 1:
        on = torch.remainder(step, phase.every) == 0
    if phase.start > 0:
        late = step >= phase.start
        on = late if on is None else on & late
    return on


def _row_zero(tree: Any) -> Any:
    """Member 0's row of every tensor in ``tree`` (a 0-d hyperparameter stays as it is)."""
    if isinstance(tree, torch.Tensor):
        return tree[0] if tree.dim() else tree
    if isinstance(tree, dict):
        return {k: _row_zero(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_row_zero(v) for v in tree)
    return tree
