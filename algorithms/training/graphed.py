"""Training steps as one compiled, captured program: the device sampler, the noise and the
graph-safe step, N at a time.

:class:`GraphedUpdates` drives a :class:`~offaug.algorithms.fused.graph_step.GraphStep` (K
members; K = 1 for a single-seed run) with batches from a
:class:`~offaug.algorithms.training.device_sampler.DeviceSampler`, in one of three modes:

* ``eager``: each step's sampling, noise and update as plain torch calls;
* ``compiled``: the update compiled by ``torch.compile(fullgraph=True)`` (Inductor); sampling
  and noise stay eager (Dynamo does not trace generators). The CPU's compiled step;
* ``captured`` (CUDA): ``steps_per_call`` whole steps (sampling and noise included) of the
  compiled update recorded once in a ``torch.cuda.CUDAGraph`` and replayed: one launch per
  ``steps_per_call`` steps instead of hundreds of kernels each. The members' generators are
  registered with the graph, so every replay draws new rows and noise.

Compiling and capturing happen in :meth:`GraphedUpdates.build`, on warm-up steps whose effects
(parameters, moments, counters, generators) are undone afterwards. When either fails, it warns
once (:class:`GraphFallbackWarning`, naming the cause) and is left in ``eager`` mode, with nothing
changed; the training loops then go on with the learner's own update.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from offaug.algorithms.base import Trainer, reads_sources
from offaug.algorithms.fused.graph_step import GraphStep, phase_pattern
from offaug.algorithms.fused.trainer import FusedTrainer
from offaug.algorithms.training.device_sampler import DeviceSampler
from offaug.datasets.sampler import MixtureSampler

StepMode = Literal["eager", "compiled", "captured"]

SAMPLER_SEED_OFFSET = 7_919
"""Added to a member's seed to seed its device sampler's generator (apart from its noise's)."""

RESUMED_STREAM = 1_000_003
"""Times the steps already taken, also added to that seed: a resumed run's rows are new."""

WARMUP_CALLS = 2
"""Calls run (and undone) before capturing: they compile, and settle the allocator."""


class GraphFallbackWarning(RuntimeWarning):
    """Compiling or capturing the graph-safe step failed; training goes on eagerly."""


class GraphedUpdates:
    """The steps of a graph-safe run (see the module). Build with :meth:`build`."""

    def __init__(self, step: GraphStep, sampler: DeviceSampler, steps_per_call: int) -> None:
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be positive, not {steps_per_call}")
        self.step = step
        self.sampler = sampler
        self.steps_per_call = steps_per_call
        self.mode: StepMode = "eager"
        self._update: Callable[..., None] = step.__call__
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @classmethod
    def build(
        cls,
        step: GraphStep,
        samplers: Sequence[MixtureSampler],
        *,
        mode: StepMode,
        steps_per_call: int = 4,
        compile_update: bool = True,
    ) -> GraphedUpdates:
        """The device sampler of the members' data (their ``samplers``' sets and shares, each
        member drawing from a generator seeded from its seed), then ``mode``'s preparation.

        ``compile_update=False`` captures the eager update (``captured`` only): no compile
        time, every kernel of the step recorded as it is.
        """
        fused = step.fused
        # A resumed run draws other rows than the steps before it drew.
        generators = [
            torch.Generator(device=fused.device).manual_seed(
                seed + SAMPLER_SEED_OFFSET + RESUMED_STREAM * fused.steps
            )
            for seed in fused.seeds
        ]
        sampler = DeviceSampler(
            samplers, generators, fused.device, with_sources=reads_sources(fused.trainers[0])
        )
        updates = cls(step, sampler, steps_per_call)
        if mode != "eager":
            updates._prepare(mode, compile_update or mode == "compiled")
        return updates

    # -- running -------------------------------------------------------------------------------

    def run(self, steps: int) -> None:
        """``steps`` steps of every member: whole calls of ``steps_per_call``, then single steps."""
        calls, rest = divmod(steps, self.steps_per_call)
        for call in range(calls):
            self._call(self.steps_per_call, call * self.steps_per_call)
        for extra in range(rest):
            self._call(1, calls * self.steps_per_call + extra)
        self.step.sync_host(steps)

    def flush_metrics(self) -> dict[str, torch.Tensor]:
        """Each metric's mean ``(K,)`` since the last flush (:meth:`GraphStep.flush_metrics`)."""
        return self.step.flush_metrics()

    def _call(self, steps: int, done: int) -> None:
        # A shorter call than the captured one (before a log line) runs uncaptured.
        graph = self._graphs.get(steps)
        if graph is not None:
            graph.replay()
        else:
            self._unrolled(steps, done=done)

    def _unrolled(self, steps: int, *, done: int = 0) -> None:
        """``steps`` steps, ``done`` after the host's count; uncaptured ones leave out the phases
        that do not run (compiled: one graph per pattern), captured ones mask them."""
        capturing = self.mode == "captured"
        for number in range(steps):
            fields = self.sampler.sample()
            noise = self.step.draw(self.sampler.batch_size)
            host_step = self.step.fused.steps + done + number
            pattern = None if capturing else phase_pattern(self.step.spec, host_step)
            self._update(fields, noise, pattern)

    # -- compiling and capturing ---------------------------------------------------------------

    def _prepare(self, mode: StepMode, compile_update: bool) -> None:
        saved = self._snapshot()
        try:
            if mode == "captured" and self.step.fused.device.type != "cuda":
                raise RuntimeError(f"capture needs a CUDA device, not {self.step.fused.device}")
            if compile_update:
                self._update = torch.compile(self.step.__call__, fullgraph=True, dynamic=False)
            self.mode = mode
            if mode == "captured":
                # Capturing undoes its warm-up itself and records without computing.
                self._graphs[self.steps_per_call] = self._capture(self.steps_per_call)
            else:
                self._unrolled(1)  # compiles
                self._restore(saved)
        except Exception as exc:  # compiling and capturing raise many types; all mean "eager"
            self._restore(saved)
            reason = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            warnings.warn(
                f"the graph-safe step could not be {mode} ({type(exc).__name__}: {reason[:400]});"
                " training goes on eagerly",
                GraphFallbackWarning,
                stacklevel=3,
            )
            self._update = self.step.__call__
            self.mode = "eager"
            self._graphs.clear()

    def _capture(self, steps: int) -> torch.cuda.CUDAGraph:
        """``steps`` steps recorded in one CUDA graph, after warm-up calls on a side stream
        (their effects undone) that compile the update and settle the allocator."""
        saved = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self._unrolled(steps)
        torch.cuda.current_stream().wait_stream(side)
        self._restore(saved)
        graph = torch.cuda.CUDAGraph()
        for generator in (*self.sampler.generators, *self.step.fused.generators):
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph):
            self._unrolled(steps)
        return graph

    def _state(self) -> list[torch.Tensor]:
        """Every tensor a step writes."""
        fused, step = self.step.fused, self.step
        tensors = [flat.flat for flat in fused.flats.values()]
        for adam in fused.adams.values():
            tensors += [adam.exp_avg, adam.exp_avg_sq, adam.steps]
        tensors += [fused.active, fused.member_steps, step.step, step.metric_count]
        tensors += [*fused.carried.values(), *step.metric_sums.values()]
        return tensors

    def _generators(self) -> list[torch.Generator]:
        return [*self.sampler.generators, *self.step.fused.generators]

    def _snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        with torch.no_grad():
            tensors = [t.clone() for t in self._state()]
        return tensors, [g.get_state() for g in self._generators()]

    def _restore(self, saved: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        tensors, states = saved
        with torch.no_grad():
            for tensor, value in zip(self._state(), tensors, strict=True):
                tensor.copy_(value)
        for generator, state in zip(self._generators(), states, strict=True):
            generator.set_state(state)


def graphed_updates(
    trainers: Sequence[Trainer],
    generators: Sequence[torch.Generator],
    seeds: Sequence[int],
    samplers: Sequence[MixtureSampler],
    *,
    mode: StepMode,
    steps_per_call: int = 4,
    compile_update: bool = True,
) -> GraphedUpdates:
    """The graph-safe steps of ``trainers`` (one for a single-seed run), built and prepared as
    single-seed or fused runs build them, their generators continuing their noise streams."""
    fused = FusedTrainer(trainers, generators, seeds, looped=False)
    return GraphedUpdates.build(
        GraphStep(fused),
        samplers,
        mode=mode,
        steps_per_call=steps_per_call,
        compile_update=compile_update,
    )
