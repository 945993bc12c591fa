"""State noise inside the loss, as in S4RL (Sinha, Mandlekar and Garg 2021, arXiv:2103.06326).

Every sampled row's observation and next observation get their own independent noise, scaled
per dimension by that dimension's standard deviation ``sigma_d`` over the original data
(computed once, before training):

* ``gaussian``: ``s_d + scale * sigma_d * N(0, 1)``;
* ``uniform``: ``s_d + scale * sigma_d * U(-1, 1)``.

The training loop perturbs the batch just before ``update``, on the batch's device, from a
generator of its own seeded by the run's seed (and saved in checkpoints), so a run repeats
exactly and the learner's own random draws are untouched. Evaluation and diagnostics see the
observations as they are. Only vector (Box, or flattened Dict) observations take noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from offaug.algorithms.batch import TorchBatch
from offaug.datasets.transitions import Transitions

NoiseKind = Literal["gaussian", "uniform"]
NOISE_KINDS: tuple[NoiseKind, ...] = ("gaussian", "uniform")


@dataclasses.dataclass(frozen=True)
class StateNoise:
    """S4RL state noise: a distribution and its scale in units of each dimension's std."""

    kind: NoiseKind
    """``gaussian`` (N(0, 1)) or ``uniform`` (U(-1, 1)) noise, times ``scale * sigma_d``."""
    scale: float
    """Noise size in units of each observation dimension's std over the original data."""

    def __post_init__(self) -> None:
        if self.kind not in NOISE_KINDS:
            raise ValueError(f"state noise kind {self.kind!r}: one of {', '.join(NOISE_KINDS)}")
        if not self.scale > 0:
            raise ValueError(f"state noise scale must be positive, not {self.scale}")

    @classmethod
    def parse(cls, text: str) -> StateNoise:
        """``KIND:SCALE``, e.g. ``gaussian:0.003`` or ``uniform:0.01``.

        Raises:
            ValueError: not of that form (the message names what is allowed).
        """
        kind, _, scale = text.partition(":")
        try:
            value = float(scale)
        except ValueError:
            value = float("nan")
        if kind not in NOISE_KINDS or not value > 0:
            raise ValueError(
                f"state noise {text!r}: KIND:SCALE with KIND one of {', '.join(NOISE_KINDS)} "
                "and a positive SCALE (in units of each dimension's std), e.g. gaussian:0.003"
            )
        return cls(kind, value)


def observation_std(parts: Iterable[Transitions]) -> npt.NDArray[np.float64]:
    """Each observation dimension's std over all rows of ``parts`` (e.g. a shard set's shards).

    Pooled in float64 shard by shard (Chan et al.'s parallel variance), so a memory-mapped set
    is read once and never held whole.

    Raises:
        ValueError: discrete or image observations (noise needs a vector of floats per row),
            or no rows.
    """
    rows, mean, squares = 0, np.zeros(0), np.zeros(0)
    for part in parts:
        observations = part.observations
        if observations.dtype.kind != "f":
            raise ValueError(
                "state noise needs Box (float) observations; these are discrete "
                f"({observations.dtype})"
            )
        if observations.ndim != 2:
            raise ValueError(
                "state noise needs vector observations (Box or flattened Dict), not shape "
                f"{observations.shape[1:]} (images take no state noise)"
            )
        n = len(observations)
        if n == 0:
            continue
        part_mean = observations.mean(0, dtype=np.float64)
        part_squares = ((observations - part_mean) ** 2).sum(0, dtype=np.float64)
        if rows == 0:
            rows, mean, squares = n, part_mean, part_squares
            continue
        delta = part_mean - mean
        total = rows + n
        squares = squares + part_squares + delta**2 * rows * n / total
        mean = mean + delta * n / total
        rows = total
    if rows == 0:
        raise ValueError("state noise needs the original data's rows to scale it; there are none")
    std: npt.NDArray[np.float64] = np.sqrt(squares / rows)
    return std


class StateNoiser:
    """Adds :class:`StateNoise` to batches, from its own seeded generator on their device."""

    def __init__(
        self,
        noise: StateNoise,
        std: npt.NDArray[np.floating[Any]],
        device: torch.device,
        seed: int,
    ) -> None:
        self.noise = noise
        self.device = device
        self._scale = torch.tensor(noise.scale * np.asarray(std), dtype=torch.float32).to(device)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, batch: TorchBatch) -> TorchBatch:
        """``batch`` with independent noise on its observations and next observations."""
        return dataclasses.replace(
            batch,
            observations=batch.observations + self._draw(batch.observations.shape),
            next_observations=batch.next_observations + self._draw(batch.next_observations.shape),
        )

    def _draw(self, shape: torch.Size) -> torch.Tensor:
        if self.noise.kind == "gaussian":
            unit = torch.randn(shape, generator=self.generator, device=self.device)
        else:
            unit = torch.rand(shape, generator=self.generator, device=self.device) * 2.0 - 1.0
        return unit * self._scale

    def get_state(self) -> torch.Tensor:
        """The generator's state, for exact resumption."""
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        """Restore :meth:`get_state`."""
        self.generator.set_state(state)


def noisy_copy(data: Transitions, noise: StateNoise, seed: int) -> Transitions:
    """``data`` with one draw of the noise :class:`StateNoiser` adds, on every row: the
    transitions a learner sees under S4RL noise (the quality report checks them).

    Scaled by ``data``'s own observation std; its recorded states (``infos/*``) are dropped, as
    they no longer describe the noisy observations.
    """
    noiser = StateNoiser(noise, observation_std([data]), torch.device("cpu"), seed)

    def perturb(observations: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        array = np.asarray(observations, dtype=np.float32)
        return array + noiser._draw(torch.Size(array.shape)).numpy()

    extras = {k: v for k, v in data.extras.items() if not k.startswith("infos/")}
    return dataclasses.replace(
        data,
        observations=perturb(data.observations),
        next_observations=perturb(data.next_observations),
        extras=extras,
    )
