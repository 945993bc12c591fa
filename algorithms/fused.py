"""K independent learners trained in one process as one batched network.

:class:`FusedTrainer` takes K trainers of one learner, built exactly as K single-seed runs build
them (each from its own seed, so with the same initial parameters), and trains them together:
every module's parameters and buffers are stacked along a leading member axis, the learner's own
loss code (its :class:`~offaug.algorithms.fusing.FusedSpec`'s phases) runs once for all members
under ``torch.func.vmap`` with each member's parameters swapped in, one backward pass of the summed
losses gives every member its own gradient (their parameters are disjoint), and one Adam step
over the stacked tensors, with a learning rate per member, moves them all.

Each optimiser's parameters live end to end in one flat buffer (``(P,)``, every parameter's
``(K, ...)`` block contiguous), so an Adam step or a Polyak update is a handful of element-wise
operations whatever the network's depth. Random draws come from one generator per member, each
continuing the stream its single-seed run would draw from, so member ``k`` sees the noise that
run sees. A member whose loss turns NaN or infinite is frozen: from that step on its parameters,
moments and targets stop changing (:attr:`FusedTrainer.frozen` names them) and the others go on.

Learners whose losses are member-agnostic (:attr:`~offaug.algorithms.fusing.FusedSpec.stacked`)
skip ``vmap``: their losses run once on the
stacked parameters, each layer one ``baddbmm`` over the member axis. Under ``vmap`` the same
loss costs about twice the operations (a linear layer becomes a batched multiply, an expand and
an add; every op goes through a batching rule), which at 64x64 is most of a step.

Batched and single matrix multiplies round differently, so a member agrees with its single-seed
run to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from offaug.algorithms.base import Trainer
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.fusing import Draws, FusedSpec, Phase


class _Flat:
    """One module's parameters in all K members: a ``(K, P)`` buffer, member ``k``'s in row ``k``.

    Per-member scalars (learning rates, Polyak rates, the frozen mask) broadcast as ``(K, 1)``.
    """

    def __init__(self, modules: Sequence[nn.Module], device: torch.device) -> None:
        named = [dict(m.named_parameters()) for m in modules]
        self.names = list(named[0])
        self.flat = torch.stack(
            [torch.cat([p[name].detach().reshape(-1) for name in self.names]) for p in named]
        ).to(device)
        self.shapes = {name: (len(modules), *named[0][name].shape) for name in self.names}
        self.slices: dict[str, slice] = {}
        offset = 0
        for name in self.names:
            size = named[0][name].numel()
            self.slices[name] = slice(offset, offset + size)
            offset += size
        self.views = self.split(self.flat)
        # Leaves that share the buffer's storage: autograd differentiates them, updates of the
        # buffer (in place, without a gradient) show through them.
        self.leaves = {
            name: view.detach().requires_grad_(True) for name, view in self.views.items()
        }

    def split(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter's ``(K, ...)`` view of a ``(K, P)`` buffer laid out as :attr:`flat`."""
        return {name: buffer[:, self.slices[name]].view(self.shapes[name]) for name in self.names}

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-parameter ``(K, ...)`` tensors (in :attr:`names` order) as one ``(K, P)``."""
        return torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)

    def write(self, module: nn.Module, member: int) -> None:
        """Copy member ``member``'s parameters into ``module``."""
        with torch.no_grad():
            for name, parameter in module.named_parameters():
                parameter.copy_(self.views[name][member])


class _Adam:
    """Adam over a :class:`_Flat` buffer: K optimisers at once, each with its own learning rate."""

    def __init__(
        self,
        group: _Flat,
        optimizers: Sequence[torch.optim.Optimizer],
        modules: Sequence[nn.Module],
    ) -> None:
        settings = optimizers[0].param_groups[0]
        self.beta1, self.beta2 = (float(b) for b in settings["betas"])
        self.eps = float(settings["eps"])
        self.group = group
        self.exp_avg = torch.zeros_like(group.flat)
        self.exp_avg_sq = torch.zeros_like(group.flat)
        self.steps = torch.zeros(len(modules), 1, dtype=torch.float64, device=group.flat.device)
        self._moments = (group.split(self.exp_avg), group.split(self.exp_avg_sq))
        # The step count as torch's fused kernel reads it, while every member's is the same.
        self._kernel_step = torch.zeros((), device=group.flat.device)
        # A resumed member's optimiser state (torch's Adam layout) continues here.
        for k, (optimizer, module) in enumerate(zip(optimizers, modules, strict=True)):
            for name, parameter in module.named_parameters():
                state = optimizer.state.get(parameter)
                if state:
                    self._moments[0][name][k].copy_(state["exp_avg"])
                    self._moments[1][name][k].copy_(state["exp_avg_sq"])
                    self.steps[k] = float(state["step"])

        self._steps_agree = bool((self.steps == self.steps[0]).all())
        self._kernel_step.fill_(float(self.steps[0, 0]))

    @torch.no_grad()
    def step(
        self,
        grad: torch.Tensor,
        lr: torch.Tensor,
        active: torch.Tensor,
        all_active: bool,
        uniform_lr: float | None = None,
    ) -> None:
        """One Adam step of the members where ``active`` (``(K, 1)`` bool); the others stay.

        ``all_active`` (known without a device sync) takes the in-place path; with
        ``uniform_lr`` (every member's rate, when they are one number) and step counts that
        agree, torch's fused Adam kernel, as the single-seed runs' optimisers step.
        """
        if not all_active:
            self._steps_agree = False
        else:
            self._kernel_step += 1
        if all_active and uniform_lr is not None and self._steps_agree:
            self.steps += 1
            torch._fused_adam_(
                [self.group.flat],
                [grad],
                [self.exp_avg],
                [self.exp_avg_sq],
                [],
                [self._kernel_step],
                amsgrad=False,
                lr=uniform_lr,
                beta1=self.beta1,
                beta2=self.beta2,
                weight_decay=0.0,
                eps=self.eps,
                maximize=False,
            )
            return
        self.steps = self.steps + active
        # Bias corrections in float64, as torch's Adam takes them on the host.
        dtype = self.group.flat.dtype
        step_size = (lr[:, None] / (1.0 - self.beta1**self.steps)).to(dtype)
        correction = (1.0 - self.beta2**self.steps).sqrt().to(dtype)
        flat, exp_avg, exp_avg_sq = self.group.flat, self.exp_avg, self.exp_avg_sq
        if all_active:
            exp_avg.lerp_(grad, 1.0 - self.beta1)
            exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
            denom = exp_avg_sq.sqrt().div_(correction).add_(self.eps)
            flat.addcdiv_(exp_avg * step_size, denom, value=-1.0)
            return
        new_avg = torch.lerp(exp_avg, grad, 1.0 - self.beta1)
        new_sq = (exp_avg_sq * self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
        denom = (new_sq.sqrt() / correction).add_(self.eps)
        updated = torch.addcdiv(flat, new_avg * step_size, denom, value=-1.0)
        flat.copy_(torch.where(active, updated, flat))
        exp_avg.copy_(torch.where(active, new_avg, exp_avg))
        exp_avg_sq.copy_(torch.where(active, new_sq, exp_avg_sq))

    def write(self, optimizer: torch.optim.Optimizer, module: nn.Module, member: int) -> None:
        """Member ``member``'s moments into ``optimizer``'s state, in torch's Adam layout."""
        for name, parameter in module.named_parameters():
            optimizer.state[parameter] = {
                "step": self.steps[member, 0].detach().float().cpu(),
                "exp_avg": self._moments[0][name][member].clone(),
                "exp_avg_sq": self._moments[1][name][member].clone(),
            }


class _Slots:
    """Every parameter and buffer of a module tree by dotted name: the dict that holds it.

    :meth:`swapped` puts other tensors in their place for a call, as ``functional_call`` does,
    at a fraction of its cost per call (it walks the tree and checks for tied weights each
    time; at 64x64 that was about a tenth of a fused BC step).
    """

    def __init__(self, root: nn.Module) -> None:
        self._stores: dict[str, tuple[dict[str, Any], str]] = {}
        for path, module in root.named_modules():
            prefix = f"{path}." if path else ""
            for store in (module._parameters, module._buffers):
                for key in store:
                    self._stores[prefix + key] = (cast(dict[str, Any], store), key)

    @contextlib.contextmanager
    def swapped(self, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """The tree with ``tensors`` in place of its own, restored afterwards."""
        places = [self._stores[name] for name in tensors]
        saved = [store[key] for store, key in places]
        try:
            for (store, key), tensor in zip(places, tensors.values(), strict=True):
                store[key] = tensor
            yield
        finally:
            for (store, key), tensor in zip(places, saved, strict=True):
                store[key] = tensor


class _Members(nn.Module):
    """The template learner's modules under one root, whose tensors :class:`_Slots` swaps."""

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
        looped: Run the members' losses one after another instead of under ``vmap`` (the
            parameters, the backward pass and the optimiser steps stay fused). None: on the CPU
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
        specs: list[FusedSpec] = [_spec(t) for t in trainers]
        self.spec = spec = specs[0]
        self.device: torch.device = getattr(trainers[0], "device", torch.device("cpu"))
        device = self.device
        if looped is None:
            looped = device.type == "cpu" and not getattr(trainers[0], "fuses_on_cpu", True)
        self.looped = looped
        parametrised = {*spec.targets, *(o.module for o in spec.optimizers.values())}
        self.flats = {
            name: _Flat([s.modules[name] for s in specs], device) for name in sorted(parametrised)
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
            name: _Adam(
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
        self._slots = _Slots(self._container)
        self._inputs = [self._phase_inputs(phase) for phase in spec.phases]

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
            loss, phase_metrics = self._losses(phase, tensors, fields, noise, hyper)
            metrics.update(phase_metrics)
            self.active = self.active & torch.isfinite(loss)
            self._step(phase, tensors, loss, hyper)
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
        """Every member's loss and metrics, stacked: ``(K,)`` each."""
        if self.stacked:
            return self._member_loss(phase)(tensors, fields, noise, hyper)
        if not self.looped:
            member_loss = self._member_loss(phase)
            return vmap(member_loss, randomness="error")(tensors, fields, noise, hyper)
        if phase.looped_loss is not None:
            phase = dataclasses.replace(phase, loss=phase.looped_loss)
        member_loss = self._member_loss(phase)
        # Each member's slice of every input (unbind's backward is one stack per leaf), its
        # loss as a single-seed run computes it, then the outputs stacked as vmap stacks them.
        leaves, layout = tree_flatten((tensors, fields, noise, hyper))
        slices = [leaf.unbind(0) for leaf in leaves]
        outputs = [
            tree_flatten(member_loss(*tree_unflatten([s[k] for s in slices], layout)))
            for k in range(self.members)
        ]
        stacked = [torch.stack(parts) for parts in zip(*(o[0] for o in outputs), strict=True)]
        return tree_unflatten(stacked, outputs[0][1])

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

    def _step(
        self, phase: Phase, tensors: dict[str, torch.Tensor], loss: torch.Tensor, hyper: Any
    ) -> None:
        groups = [self.flats[self.spec.optimizers[o].module] for o in phase.optimizers]
        leaves = [leaf for group in groups for leaf in group.leaves.values()]
        grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
        parts = [
            torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves, strict=True)
        ]
        active = self.active[:, None]
        # On the CPU the mask is read for free; elsewhere the masked path avoids a device sync.
        all_active = self.device.type == "cpu" and bool(self.active.all())
        start = 0
        for name, group in zip(phase.optimizers, groups, strict=True):
            count = len(group.names)
            grad = group.join(parts[start : start + count])
            start += count
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
        trainer, spec = self.trainers[index], _spec(self.trainers[index])
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


def _spec(trainer: Trainer) -> FusedSpec:
    make = getattr(trainer, "fused_spec", None)
    if not callable(make):
        raise ValueError(f"{type(trainer).__name__} does not train fused")
    spec: FusedSpec = make()
    return spec


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
    that device's generator, which :func:`~offaug.algorithms.base.seed_everything` seeded.
    """
    if device.type == "cpu":
        generator = torch.Generator()
        generator.set_state(torch.get_rng_state())
        return generator
    return torch.Generator(device=device).manual_seed(seed)
