"""K independent learners trained in one process as one batched network.

:class:`FusedTrainer` takes K trainers of one learner, built exactly as K single-seed runs build
them (each from its own seed, so with the same initial parameters), and trains them together:
every module's parameters and buffers are stacked along a leading member axis, the learner's own
loss code (its :class:`~offaug.algorithms.fusing.FusedSpec`'s phases) runs once for all members
under ``torch.func.vmap`` with each member's parameters swapped in, one backward pass of the summed
losses gives every member its own gradient (their parameters are disjoint), and one Adam step
over the stacked tensors, with a learning rate per member, moves them all.

Each optimiser's parameters live in one ``(K, P)`` buffer (member ``k``'s end to end in row
``k``, :mod:`~offaug.algorithms.fused.stacking`), so an Adam step or a Polyak update is one fused
kernel or a handful of element-wise operations whatever the network's depth. Random draws come
from one generator per member, each continuing the stream its single-seed run would draw from,
so member ``k`` sees the noise that run sees. A member whose loss turns NaN or infinite is
frozen: from that step on its parameters, moments and targets stop changing
(:attr:`FusedTrainer.frozen` names them) and the others go on.

Learners whose losses are member-agnostic (:attr:`~offaug.algorithms.fusing.FusedSpec.stacked`)
skip ``vmap``: their losses run once on the stacked parameters, each layer one ``baddbmm`` over
the member axis. Under ``vmap`` the same loss costs about twice the operations (a linear layer
becomes a batched multiply, an expand and an add; every op goes through a batching rule), which
at 64x64 is most of a step. Looped learners (CQL and BCQ on a CPU, :attr:`FusedTrainer.looped`)
run each member's loss and its backward pass in turn on that member's row of the buffers, so one
member's activations are live at a time; only the Adam step and the Polyak update are fused.

Batched and single matrix multiplies round differently, so a member agrees with its single-seed
run to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from offaug.algorithms.base import Trainer
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.fused.specs import fused_spec
from offaug.algorithms.fused.stacking import FlatAdam, FlatParameters, TensorSlots
from offaug.algorithms.fusing import Draws, FusedSpec, Phase


class _Members(nn.Module):
    """The template learner's modules under one root, whose tensors :class:`TensorSlots` swaps."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(dict(modules))

    def forward(self, phase: Phase, batch: TorchBatch, noise: Any, hyper: Any) -> Any:
        return phase.loss(batch, noise, hyper)


class FusedTrainer:
    """K trainers of one learner trained as one batched network.

    Args:
        trainers: The members, built (and prepared on their data) as single-seed runs build
            them; their configs may differ only in the learner's ``fused_hyperparameters``.
        generators: Each member's torch generator, continuing the stream its single-seed run
            draws noise from (see :func:`member_generator`).
        seeds: Each member's seed, to name frozen members by.
        looped: Run each member's loss and backward pass in turn instead of under ``vmap``
            (the parameters and the optimiser steps stay fused). None: on the CPU
            for learners that set ``fuses_on_cpu = False`` (CQL, BCQ), whose multiplies are
            large enough that K plain ones beat the batched one ``vmap`` makes of them.
        stacked: Run the losses once on the stacked parameters, without ``vmap`` (see the
            module's docstring). None: wherever the learner's spec allows it, the members'
            buffers (normalisers' statistics) are equal and the losses are not looped.
    """

    def __init__(
        self,
        trainers: Sequence[Trainer],
        generators: Sequence[torch.Generator],
        seeds: Sequence[int],
        *,
        looped: bool | None = None,
        stacked: bool | None = None,
    ) -> None:
        if not trainers or len({len(trainers), len(generators), len(seeds)}) != 1:
            raise ValueError("one generator and one seed per trainer, at least one trainer")
        self.trainers = list(trainers)
        self.generators = list(generators)
        self.seeds = list(seeds)
        self.members = len(trainers)
        specs: list[FusedSpec] = [fused_spec(t) for t in trainers]
        self.spec = spec = specs[0]
        self.device: torch.device = getattr(trainers[0], "device", torch.device("cpu"))
        device = self.device
        if looped is None:
            looped = device.type == "cpu" and not getattr(trainers[0], "fuses_on_cpu", True)
        self.looped = looped
        parametrised = {*spec.targets, *(o.module for o in spec.optimizers.values())}
        self.flats = {
            name: FlatParameters([s.modules[name] for s in specs], device)
            for name in sorted(parametrised)
        }
        self.buffers: dict[str, torch.Tensor] = {}
        for name in spec.modules:
            for key, _ in spec.modules[name].named_buffers():
                values = [dict(s.modules[name].named_buffers())[key] for s in specs]
                self.buffers[f"parts.{name}.{key}"] = torch.stack(values).to(device)
            if name in parametrised:
                continue
            # Parameters no optimiser steps are constants, stacked as buffers are.
            for key, parameter in spec.modules[name].named_parameters():
                if parameter.requires_grad:
                    raise ValueError(f"module {name!r} has parameters but no optimiser or source")
                values = [dict(s.modules[name].named_parameters())[key] for s in specs]
                self.buffers[f"parts.{name}.{key}"] = torch.stack(values).detach().to(device)
        self.adams = {
            name: FlatAdam(
                self.flats[o.module],
                [s.optimizers[name].optimizer for s in specs],
                [s.modules[o.module] for s in specs],
            )
            for name, o in spec.optimizers.items()
        }
        self.hyper = {
            name: torch.tensor([s.hyperparameters[name] for s in specs], device=device)
            for name in spec.hyperparameters
        }
        self._hyper_values = [dict(s.hyperparameters) for s in specs]
        self._uniform_rates = {
            o.learning_rate: len({s.hyperparameters[o.learning_rate] for s in specs}) == 1
            for o in spec.optimizers.values()
        }
        self.carried = {
            name: torch.stack([s.carried[name] for s in specs]).to(device) for name in spec.carried
        }
        self._row_buffers = _row_buffers(self.buffers)
        can_stack = spec.stacked and not looped and self._row_buffers is not None
        if stacked is None:
            stacked = can_stack
        if stacked and not can_stack:
            raise ValueError(
                f"{type(trainers[0]).__name__} cannot train stacked here: its losses are not"
                " member-agnostic, they are looped, or its members' scalar buffers differ"
            )
        self.stacked = stacked
        self.active = torch.ones(self.members, dtype=torch.bool, device=device)
        self.steps = int(getattr(trainers[0], "steps", 0))
        self.member_steps = torch.full((self.members,), self.steps, device=device)
        self._container = _Members(spec.modules)
        self._slots = TensorSlots(self._container)
        self._inputs = [self._phase_inputs(phase) for phase in spec.phases]

    @property
    def container(self) -> nn.Module:
        """The template learner's modules under one root (``parts.<module>.<tensor>``), whose
        ``forward(phase, batch, noise, hyper)`` runs a phase's loss."""
        return self._container

    @property
    def loss_buffers(self) -> dict[str, torch.Tensor]:
        """The stacked buffers as the losses read them: one row per buffer when stacked."""
        rows = self._row_buffers
        return dict(rows if self.stacked and rows is not None else self.buffers)

    def _phase_inputs(self, phase: Phase) -> dict[str, torch.Tensor]:
        trained = {self.spec.optimizers[o].module for o in phase.optimizers}
        rows = self._row_buffers
        tensors = dict(rows if self.stacked and rows is not None else self.buffers)
        for module, flat in self.flats.items():
            source = flat.leaves if module in trained else flat.views
            tensors.update({f"parts.{module}.{name}": t for name, t in source.items()})
        return tensors

    # -- one step ------------------------------------------------------------------------------

    def update(self, batches: TorchBatch | Sequence[TorchBatch]) -> dict[str, torch.Tensor]:
        """One step of every member on its own batch; metrics ``(K,)`` each, detached.

        ``batches``: one batch per member, or their fields stacked along a leading member axis.
        """
        batch = batches if isinstance(batches, TorchBatch) else stack_batches(batches)
        fields = {k: v for k, v in vars(batch).items() if v is not None}
        hyper: dict[str, Any] = dict(self.hyper)
        if self.spec.schedule is not None:
            hyper.update(self.spec.schedule(self.steps, hyper))
        noise = self._draw(int(batch.rewards.shape[1]))
        metrics: dict[str, torch.Tensor] = dict(self.carried)
        for phase, tensors in zip(self.spec.phases, self._inputs, strict=True):
            if self.steps < phase.start or self.steps % phase.every:
                continue
            if self.looped:
                loss, phase_metrics, grads = self._looped(phase, tensors, fields, noise, hyper)
            else:
                loss, phase_metrics = self._losses(phase, tensors, fields, noise, hyper)
                grads = self._gradients(phase, loss)
            metrics.update(phase_metrics)
            self.active = self.active & torch.isfinite(loss)
            self._step(phase, grads, hyper)
            for name in self.carried.keys() & phase_metrics.keys():
                self.carried[name] = phase_metrics[name]
        self.member_steps += self.active
        self.steps += 1
        return {name: metrics[name] for name in self.spec.metrics}

    def _losses(
        self,
        phase: Phase,
        tensors: dict[str, torch.Tensor],
        fields: dict[str, torch.Tensor],
        noise: Any,
        hyper: Any,
    ) -> Any:
        """Every member's loss and metrics, stacked: ``(K,)`` each (stacked or under vmap)."""
        if self.stacked:
            return self._member_loss(phase)(tensors, fields, noise, hyper)
        member_loss = self._member_loss(phase)
        return vmap(member_loss, randomness="error")(tensors, fields, noise, hyper)

    def _looped(
        self,
        phase: Phase,
        tensors: dict[str, torch.Tensor],
        fields: dict[str, torch.Tensor],
        noise: Any,
        hyper: Any,
    ) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]:
        """Members one after another: each member's loss as its single-seed run computes it and
        its backward pass right after, so one member's activations are live at a time (K graphs
        held for one backward pass outgrow the cache at CQL's sizes). Returns the stacked losses
        and metrics, as vmap stacks them, and each trained module's ``(K, P)`` gradient."""
        if phase.looped_loss is not None:
            phase = dataclasses.replace(phase, loss=phase.looped_loss)
        member_loss = self._member_loss(phase)
        modules = [self.spec.optimizers[o].module for o in phase.optimizers]
        grads = {m: torch.zeros_like(self.flats[m].flat) for m in modules}
        trained = [(m, name, f"parts.{m}.{name}") for m in modules for name in self.flats[m].names]
        own_keys = [key for _, _, key in trained]
        leaves, layout = tree_flatten((fields, noise, hyper))
        outputs = []
        for k in range(self.members):
            # The member's own leaves: row k of each trained parameter, detached, so its
            # backward pass reaches only its own slice and frees its graph before the next.
            own = [tensors[key][k].detach().requires_grad_(True) for _, _, key in trained]
            inputs = {key: t[k] for key, t in tensors.items() if key not in own_keys}
            inputs.update(zip(own_keys, own, strict=True))
            rest = tree_unflatten([leaf[k] for leaf in leaves], layout)
            output = member_loss(inputs, *rest)
            parts = torch.autograd.grad(output[0], own, allow_unused=True)
            with torch.no_grad():
                for (module, name, _), part in zip(trained, parts, strict=True):
                    if part is not None:
                        grads[module][k, self.flats[module].slices[name]] = part.reshape(-1)
            outputs.append(tree_flatten(tree_map(_detached, output)))
        stacked = [torch.stack(parts) for parts in zip(*(o[0] for o in outputs), strict=True)]
        loss, metrics = tree_unflatten(stacked, outputs[0][1])
        return loss, metrics, grads

    def _member_loss(self, phase: Phase) -> Any:
        def member(
            tensors: dict[str, torch.Tensor],
            fields: dict[str, torch.Tensor],
            noise: Any,
            hyper: Any,
        ) -> Any:
            batch = TorchBatch(**fields)
            with self._slots.swapped(tensors):
                return self._container(phase, batch, noise, hyper)

        return member

    def _gradients(self, phase: Phase, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each trained module's ``(K, P)`` gradient from one backward pass of the summed losses
        (the members' parameters are disjoint, so each row is its member's own gradient)."""
        modules = [self.spec.optimizers[o].module for o in phase.optimizers]
        leaves = [leaf for m in modules for leaf in self.flats[m].leaves.values()]
        grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
        parts = [
            torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves, strict=True)
        ]
        joined: dict[str, torch.Tensor] = {}
        start = 0
        for module in modules:
            count = len(self.flats[module].names)
            joined[module] = self.flats[module].join(parts[start : start + count])
            start += count
        return joined

    def _step(self, phase: Phase, grads: Mapping[str, torch.Tensor], hyper: Any) -> None:
        active = self.active[:, None]
        # On the CPU the mask is read for free; elsewhere the masked path avoids a device sync.
        all_active = self.device.type == "cpu" and bool(self.active.all())
        for name in phase.optimizers:
            grad = grads[self.spec.optimizers[name].module]
            key = self.spec.optimizers[name].learning_rate
            lr = hyper[key]
            # Members with one rate (the same config, the same schedule) take the fused kernel.
            uniform = float(lr[0]) if all_active and self._uniform_rates[key] else None
            self.adams[name].step(grad, lr, active, all_active, uniform)
        with torch.no_grad():
            for target in phase.targets:
                weight = (hyper[self.spec.tau] * self.active)[:, None]
                self.flats[target].flat.lerp_(self.flats[self.spec.targets[target]].flat, weight)

    def _draw(self, batch_size: int) -> dict[str, torch.Tensor]:
        if self.spec.noise is None:
            return {}
        draws = [
            self.spec.noise(batch_size, Draws(self.device, g, step=self.steps))
            for g in self.generators
        ]
        return {name: torch.stack([d[name] for d in draws]) for name in draws[0]}

    # -- members -------------------------------------------------------------------------------

    @property
    def frozen(self) -> list[int]:
        """Seeds of the members stopped because a loss turned NaN or infinite."""
        return [seed for seed, on in zip(self.seeds, self.active.tolist(), strict=True) if not on]

    def member(self, index: int) -> Trainer:
        """Member ``index`` as a single-seed trainer (its networks, optimisers and counters)."""
        trainer, spec = self.trainers[index], fused_spec(self.trainers[index])
        for name, flat in self.flats.items():
            flat.write(spec.modules[name], index)
        with torch.no_grad():
            for name, module in spec.modules.items():
                for key, buffer in module.named_buffers():
                    buffer.copy_(self.buffers[f"parts.{name}.{key}"][index])
        hyper: dict[str, Any] = dict(self._hyper_values[index])
        if self.spec.schedule is not None and self.steps:
            # The rate the member's optimiser last stepped with, as the learner's update leaves it.
            hyper.update(self.spec.schedule(self.steps - 1, hyper))
        for name, option in spec.optimizers.items():
            self.adams[name].write(option.optimizer, spec.modules[option.module], index)
            for group in option.optimizer.param_groups:
                group["lr"] = float(hyper[option.learning_rate])
        if hasattr(trainer, "steps"):
            trainer.steps = int(self.member_steps[index])
        if spec.restore is not None:
            spec.restore({name: value[index].clone() for name, value in self.carried.items()})
        return trainer

    def member_state_dict(self, index: int) -> dict[str, Any]:
        """What member ``index``'s single-seed trainer's ``state_dict`` would be."""
        state: dict[str, Any] = self.member(index).state_dict()
        return state


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _row_buffers(buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The stacked buffers ``(K, ...)`` as a stacked loss reads them: one copy where every
    member's is the same (normalisers of one dataset), else ``(K, 1, ...)``, which meets
    member ``k``'s rows of a ``(K, B, ...)`` batch (the statistics of each seed's own data);
    None if a per-member scalar differs (it would meet the rows' axis, not the members')."""
    rows: dict[str, torch.Tensor] = {}
    for key, value in buffers.items():
        if all(torch.equal(value[0], other) for other in value[1:]):
            rows[key] = value[0]
        elif value.dim() > 1:
            rows[key] = value.unsqueeze(1)
        else:
            return None
    return rows


def stack_batches(batches: Sequence[TorchBatch]) -> TorchBatch:
    """Member batches stacked along a leading axis: ``K x (B, ...) -> (K, B, ...)``."""
    fields: dict[str, Any] = {}
    for name, value in vars(batches[0]).items():
        fields[name] = None if value is None else torch.stack([vars(b)[name] for b in batches])
    return TorchBatch(**fields)


def member_generator(seed: int, device: torch.device) -> torch.Generator:
    """The generator a single-seed run draws its training noise from, as of now.

    Call it right after building and preparing that member (which draw from the global
    generator): on the CPU it continues the global stream; on another device the run draws from
    that device's generator, which :func:`~offaug.algorithms.runtime.seed_everything` seeded.
    """
    if device.type == "cpu":
        generator = torch.Generator()
        generator.set_state(torch.get_rng_state())
        return generator
    return torch.Generator(device=device).manual_seed(seed)
