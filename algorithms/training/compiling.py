"""``torch.compile`` for the parts of a learner where it was measured to pay.

A learner opts in by naming methods in ``compile_targets()``: pure functions of a batch (a
loss), which :func:`compile_trainer` replaces on that one trainer with a compiled version.
Only Gaussian BC's loss does: a truncated-normal log-density, some thirty small element-wise
ops and their backward, which Inductor fuses. Deterministic BC, CQL and SAC declare no targets:
their steps are bound by matrix multiplies that compiling does not change (BCQ's candidate pass
is tiled by hand in :mod:`offaug.algorithms.nn.kernels`). The measured gains and compile times are
in ``benchmarks/RESULTS.md`` (``train_bc_gaussian_compiled_*``).

Compiling happens at the first call. When it fails (no C++ compiler on a CPU machine, an
unsupported backend), the trainer warns once and goes on eagerly, as without the option.
Compiled code may round differently from eager code (fused element-wise ops), so a compiled
run matches an eager one to float precision, not bit for bit; a compiled run repeats exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

Backend = str | Callable[..., Any]


class CompileFallbackWarning(RuntimeWarning):
    """``torch.compile`` failed for a learner's method; it runs eagerly instead."""


class _CompiledOrEager:
    """A method compiled on first use; eager for good if that first compile fails."""

    def __init__(self, eager: Callable[..., Any], label: str, backend: Backend) -> None:
        self._eager = eager
        self._compiled: Callable[..., Any] | None = torch.compile(
            eager, backend=backend, dynamic=False
        )
        self._label = label
        self._proven = False

    @property
    def compiled(self) -> bool:
        """Whether calls go through the compiled version (False after a failed compile)."""
        return self._compiled is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            return self._eager(*args, **kwargs)
        if self._proven:
            return self._compiled(*args, **kwargs)
        try:
            result = self._compiled(*args, **kwargs)
        except Exception as exc:  # compiling raises many types; any of them means "run eager"
            reason = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            warnings.warn(
                f"torch.compile of {self._label} failed ({type(exc).__name__}: {reason[:300]});"
                " training goes on uncompiled. On a CPU, Inductor needs a C++ compiler (e.g."
                " apt install g++); drop the compile option to silence this.",
                CompileFallbackWarning,
                stacklevel=2,
            )
            self._compiled = None
            # The targets are pure functions of their inputs, so the eager call repeats the
            # failed one exactly.
            return self._eager(*args, **kwargs)
        self._proven = True
        return result


def compile_trainer(trainer: Any, *, backend: Backend = "inductor") -> tuple[str, ...]:
    """Compile ``trainer``'s declared targets in place; returns the names it compiled.

    A trainer without ``compile_targets`` (or with none for its config) is left as it is.
    """
    targets_of = getattr(trainer, "compile_targets", None)
    names: tuple[str, ...] = tuple(targets_of()) if callable(targets_of) else ()
    for name in names:
        eager = getattr(trainer, name)
        label = f"{type(trainer).__name__}.{name}"
        setattr(trainer, name, _CompiledOrEager(eager, label, backend))
    return names
