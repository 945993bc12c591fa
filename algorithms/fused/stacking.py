"""How a fused run holds its K members' tensors
(:class:`~offaug.algorithms.fused.trainer.FusedTrainer`).

* :class:`FlatParameters`: one module's parameters in all K members as one ``(K, P)`` buffer,
  with each parameter's ``(K, ...)`` view of it and the leaves autograd differentiates;
* :class:`FlatAdam`: Adam over such a buffer, K optimisers at once with a rate per member;
* :class:`TensorSlots`: the template modules' parameter and buffer slots, to swap a member's (or
  the stacked) tensors in for a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn


class FlatParameters:
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


class FlatAdam:
    """Adam over a :class:`FlatParameters` buffer: K optimisers at once, a rate per member."""

    def __init__(
        self,
        group: FlatParameters,
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
        # A resumed member's optimiser state (torch's Adam layout) continues here.
        for k, (optimizer, module) in enumerate(zip(optimizers, modules, strict=True)):
            for name, parameter in module.named_parameters():
                state = optimizer.state.get(parameter)
                if state:
                    self._moments[0][name][k].copy_(state["exp_avg"])
                    self._moments[1][name][k].copy_(state["exp_avg_sq"])
                    self.steps[k] = float(state["step"])
        # Until a member is frozen, every member has taken the same steps.
        self._steps_agree = bool((self.steps == self.steps[0]).all())

    def steps_may_differ(self) -> None:
        """From now on the members' step counts may differ (another stepper, such as the
        graph-safe step's masked Adam, moves them): no fused-kernel shortcut."""
        self._steps_agree = False

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
        self._steps_agree = self._steps_agree and all_active
        if uniform_lr is not None and self._steps_agree:
            self.steps += 1
            torch._fused_adam_(
                [self.group.flat],
                [grad],
                [self.exp_avg],
                [self.exp_avg_sq],
                [],
                [self.steps[0, 0].float()],  # the kernel reads the step already taken
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


class TensorSlots:
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
