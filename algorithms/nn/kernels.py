"""Hand-written forward passes that beat the modules' own on the CPU, kept in one place.

Every function here computes exactly what a module of :mod:`offaug.algorithms.nn.networks` would
on the same parameters (tests check each against its module); they differ only in how the work
is laid out:

* :func:`batched_affine`: ``E`` affine layers on ``E`` row batches (``baddbmm``'s map) with a
  backward pass that picks, per layer shape, the orientation of each product that MKL's batched
  multiply runs fast;
* :func:`affine_mlp` and :func:`ensemble_mlp`: the hand-written MLP forwards, one row batch
  (``addmm`` per layer, optional output buffers) or ``E`` members at once
  (:func:`batched_affine` per layer, what :class:`EnsembleMLP` runs), ReLUs in place;
* :func:`tiled_mlp`: an MLP of ``[state, extra]`` for ``n`` extras per state, with the state's
  share of the first layer computed once (BCQ's candidate pass), writing into a
  :class:`Workspace` of buffers reused between steps.

Reading a module's layers as affine maps, and ``Q_e(s, a)`` of a critic ensemble member by member
on blocks of rows (CQL's critic pass), belong to the modules: :mod:`offaug.algorithms.nn.networks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Affine = tuple[torch.Tensor, torch.Tensor]
"""One affine layer as ``(weight (in, out), bias (out,))``: ``x @ weight + bias``."""


def affine_mlp(
    affines: Sequence[Affine],
    hidden: torch.Tensor,
    *,
    relu_input: bool = False,
    out: Callable[[int, int], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """A ReLU MLP on ``(N, in)`` rows: ``addmm`` per layer, ReLU in place between layers.

    ``relu_input`` applies the ReLU to ``hidden`` first (it is a hidden layer's output).
    ``out(depth, width)`` gives the buffer each layer writes into (no autograd then); without
    it every layer allocates. ReLUs run in place: a multiply's backward needs its input, not
    its output, so no activation is allocated twice.
    """
    for depth, (weight, bias) in enumerate(affines):
        if depth or relu_input:
            hidden = hidden.relu_()
        buffer = None if out is None else out(depth, weight.shape[1])
        hidden = torch.addmm(bias, hidden, weight, out=buffer)
    return hidden


class _BatchedAffine(torch.autograd.Function):
    """``baddbmm(bias, x, weight)`` whose products are laid out for the batched multiply.

    A batched multiply ``(m, k) @ (k, n)`` with a small ``n`` or ``k`` runs far below the
    CPU's arithmetic rate (MKL's batched kernels are built for wide outputs; a plain ``mm``
    does not suffer so), which made a critic's one-unit output layer cost about as much as a
    hidden layer (docs/performance.md, "Many seeds in one process"). For a layer that narrows
    (``out < in``, the only kind :func:`batched_affine` sends here) each product is taken the
    way round whose output is widest: the weight's gradient ``x^T g`` as ``(g^T x)^T``, a
    one-unit layer's output as ``(w^T x^T)^T``, its input gradient as a broadcast product.
    Same arithmetic, other rounding order.
    """

    # The forward takes ``ctx`` (no separate ``setup_context``): with one, ``apply`` binds
    # the arguments through ``inspect.signature`` on every call, a good share of the saving.
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        if weight.shape[-1] == 1:
            # (E, 1, in) @ (E, in, B) -> (E, 1, B), the same memory as (E, B, 1); cloned, as
            # autograd forbids in-place changes to a view a custom function returns.
            row = torch.baddbmm(bias, weight.transpose(1, 2), x.transpose(1, 2))
            return row.transpose(1, 2).clone()
        return torch.baddbmm(bias, x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        outputs = weight.shape[-1]
        if ctx.needs_input_grad[0]:
            if outputs == 1:
                grad_x = grad * weight.transpose(1, 2)
            else:
                grad_x = torch.bmm(grad, weight.transpose(1, 2))
        if ctx.needs_input_grad[1]:
            # (E, out, B) @ (E, B, in): the product is as wide as the layer's input.
            grad_weight = torch.bmm(grad.transpose(1, 2), x).transpose(1, 2)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(1, keepdim=True)
        return grad_x, grad_weight, grad_bias


def batched_affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``E`` affine layers at once: ``x (E, B, in) @ weight (E, in, out) + bias (E, 1, out)``.

    The map of ``torch.baddbmm(bias, x, weight)``; a layer that narrows (``out < in``) runs
    as :class:`_BatchedAffine`, whose products are laid out the fast way round. ``weight`` may
    be a transposed view (an ``nn.Linear``-layout ``(E, out, in)`` stack).
    """
    inputs, outputs = weight.shape[-2:]
    if (
        outputs >= inputs
        or torch.compiler.is_compiling()
        or torch._C._functorch.maybe_current_level() is not None
    ):
        # A widening layer's products are already wide; under vmap or grad (a fused run's
        # vmapped losses, the graph-safe step) the custom function has no functorch rule, and
        # compiled, Inductor lays the products out itself: baddbmm's serves.
        return torch.baddbmm(bias, x, weight)
    out: torch.Tensor = _BatchedAffine.apply(x, weight, bias)
    return out


def ensemble_mlp(layers: Sequence[Affine], hidden: torch.Tensor) -> torch.Tensor:
    """``E`` ReLU MLPs at once: ``(E, B, in) -> (E, B, out)``, one :func:`batched_affine` per
    layer.

    ``layers`` hold ``(weight (E, in, out), bias (E, 1, out))``. Each ReLU runs in place on
    its multiply's fresh output.
    """
    last = len(layers) - 1
    for depth, (weight, bias) in enumerate(layers):
        hidden = batched_affine(hidden, weight, bias)
        if depth < last:
            hidden = hidden.relu_()
    return hidden


class Workspace:
    """Output buffers of :func:`tiled_mlp`, kept between steps and keyed by name and shape.

    Scoring ``n * B`` candidates makes about ten activations of ``n * B`` rows per step. On the
    CPU, glibc hands large allocations back to the kernel and page-faults them in again on the
    next step (a sizeable share of a small network's step), so the pass writes into these
    buffers instead.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised buffer of ``shape`` (dtype and device of ``like``)."""
        buffer = self._buffers.get((name, shape))
        if buffer is None or buffer.device != like.device or buffer.dtype != like.dtype:
            buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._buffers[(name, shape)] = buffer
        return buffer


@torch.no_grad()
def tiled_mlp(
    affines: Sequence[Affine],
    states: torch.Tensor,
    extras: torch.Tensor,
    workspace: Workspace | None,
    name: str,
) -> torch.Tensor:
    """A ReLU MLP of ``[state, extra]`` for ``n`` extras per state.

    Shapes: ``states (B, s)``, ``extras (n, B, d)`` -> ``(n, B, out)``.

    The same function as ``mlp(cat([states repeated n times, extras], -1))``, cheaper: the
    state's share of the first layer is computed once per state instead of once per candidate,
    no input is concatenated, each ReLU runs in place, and every layer writes into a buffer of
    ``workspace``. The result lives in the buffer ``name``, valid until the next call with the
    same name. With ``workspace=None`` every layer allocates its output instead: the form
    ``torch.func.vmap`` can batch (a fused run's members), same arithmetic.
    """
    n, batch, extra_dim = extras.shape
    state_dim = states.shape[-1]
    last = len(affines) - 1

    def buffer(depth: int, width: int) -> torch.Tensor | None:
        if workspace is None:
            return None
        # Hidden layers alternate between two buffers shared by every MLP of the pass (a
        # small working set stays in cache); the output has its own, named buffer.
        key = f"{name}.out" if depth == last else f"hidden{depth % 2}"
        return workspace.get(key, (n * batch, width), states)

    (weight, bias), *rest = affines
    # (n * B, d) @ (d, h), plus the state's share (B, h) broadcast over n.
    hidden = torch.mm(
        extras.reshape(n * batch, extra_dim), weight[state_dim:], out=buffer(0, weight.shape[1])
    )
    hidden.view(n, batch, -1).add_(torch.addmm(bias, states, weight[:state_dim]))
    hidden = affine_mlp(
        rest, hidden, relu_input=True, out=lambda depth, width: buffer(depth + 1, width)
    )
    return hidden.view(n, batch, -1)
