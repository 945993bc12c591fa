"""Generated transitions: a diffusion model of the dataset's transitions, sampled N times (SynthER).

Lu et al. 2023, "Synthetic Experience Replay" (arXiv:2303.06614). A denoiser learns the joint
distribution of whole transitions ``x = (s, a, r, s', terminal)``, each dimension but the
terminal standardised over the dataset (SynthER leaves the 0/1 terminal as it is), with the EDM
objective of Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative
Models": ``log sigma ~ N(P_mean, P_std^2)``, ``D(x + sigma n; sigma) = c_skip x_noisy + c_out
F(c_in x_noisy, c_noise)``, loss ``lambda(sigma) |D - x|^2`` with ``lambda = (sigma^2 +
sigma_data^2) / (sigma sigma_data)^2``. Sampling integrates from ``sigma_max`` noise to 0.

The noise schedule (Karras sigmas), the preconditioning (``c_in``, ``c_skip``, ``c_out``,
``c_noise``) and the sampler are diffusers' :class:`~diffusers.EDMDPMSolverMultistepScheduler`
(DPM-Solver++(2M), a deterministic second-order solver); only the training sigma draw and the
loss weight are written here, which diffusers leaves to the trainer. Why that scheduler and not
diffusers' EDM Euler one or SynthER's stochastic Heun sampler: docs/rollouts.md.

The denoiser is SynthER's residual MLP: the input projected to ``time_dim`` plus a time
embedding (random Fourier features of ``c_noise`` through a two-layer MLP), then a linear layer
to ``width``, ``blocks`` residual blocks ``h + Linear(ReLU(Linear(LayerNorm(h))))`` (SynthER's
own block has the one Linear after the ReLU), a LayerNorm, ReLU and a linear read-out.

A generated row (:func:`generate`) is its own one-step episode:

* ``observations``, ``actions``, ``rewards``, ``next_observations``: the sample, un-standardised;
  actions clipped to the action box (observations are not clipped: the data's range is not a
  bound of the state space);
* ``terminals``: the sample's terminal coordinate >= 0.5; ``timeouts``: every row that is not
  terminal (the episode "ends" after its one step without termination, so learners bootstrap
  through it);
* ``importance_weight`` 1 and no ``rollout_log_prob`` or ``behaviour_log_prob``: no policy chose
  the action, so there is no mu to weight by or to divide by. Behaviour weighting reads the 1s;
  policy weighting gives a set without ``rollout_log_prob`` weight 1, as it does the original
  data;
* ``source`` :attr:`~offaug.datasets.transitions.Source.GENERATED`;
* no simulator state (nothing to branch from or replay), no successor row (ReBRAC's next
  dataset action at a generated row is the row's own, as at the last row of any episode).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.nn import functional as F

from offaug.algorithms.base import (
    Spaces,
    adam,
    config_from_json,
    load_checkpoint,
    save_checkpoint,
    spaces_from_transitions,
)
from offaug.algorithms.runtime import choose_device
from offaug.datasets.transitions import SPACE_META_KEYS, Source, Transitions

SIGMA_MIN = 0.002
"""Smallest noise level of the sampling schedule (EDM, SynthER)."""
SIGMA_MAX = 80.0
"""Largest noise level; sampling starts from N(0, SIGMA_MAX^2) (EDM, SynthER)."""
SIGMA_DATA = 1.0
"""The data's standard deviation in the preconditioning: 1 after standardising (SynthER)."""
RHO = 7.0
"""Curvature of the Karras schedule (EDM)."""
P_MEAN, P_STD = -1.2, 1.2
"""Training noise levels: log sigma ~ N(P_MEAN, P_STD^2) (EDM, SynthER)."""
TERMINAL_THRESHOLD = 0.5
"""A sampled terminal coordinate at or above this is a termination (SynthER)."""
_FOURIER_FEATURES = 16
"""Random Fourier features of the time embedding (SynthER's ``learned_sinusoidal_dim``)."""


@dataclasses.dataclass(frozen=True)
class DiffusionConfig:
    """The denoiser's size, its training and its sampler.

    The defaults train in minutes on two CPU cores. SynthER's own (for a GPU): width 2048,
    6 blocks, 100,000 steps of batch 1024 at learning rate 3e-4, 128 sampler steps.
    """

    width: int = 256
    """Width of the residual blocks (SynthER: 2048)."""
    blocks: int = 3
    """Residual blocks (SynthER: 6)."""
    time_dim: int = 128
    """Width of the input projection and time embedding (SynthER's ``dim_t``)."""
    steps: int = 30_000
    """Gradient steps (SynthER: 100,000), under a cosine learning-rate decay."""
    batch_size: int = 256
    """Transitions per step (SynthER: 1024)."""
    learning_rate: float = 3e-4
    """Adam's initial learning rate (SynthER: 3e-4)."""
    sampler_steps: int = 32
    """Solver steps from SIGMA_MAX to 0 per sample (SynthER: 128 Heun steps)."""
    next_state: Literal["absolute", "delta"] = "delta"
    """How ``s'`` is modelled: ``absolute`` (SynthER) or ``delta``, the change ``s' - s``
    standardised on its own (as dynamics models predict it), so an error of the denoiser in that
    coordinate is one of the change, not of the state's whole spread."""
    seed: int = 0
    """Seed of the initialisation, the batches and the training noise."""


class _Block(nn.Module):
    """``h + Linear(ReLU(Linear(LayerNorm(h))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.outer(F.relu(self.inner(self.norm(h))))


class ResidualDenoiser(nn.Module):
    """SynthER's residual-MLP denoiser F(x, c_noise): ``(B, d), (B,) -> (B, d)``."""

    frequencies: torch.Tensor

    def __init__(self, dim: int, width: int, blocks: int, time_dim: int) -> None:
        super().__init__()
        # Fixed random frequencies (SynthER's random_fourier_features): a buffer, not trained.
        self.register_buffer("frequencies", torch.randn(_FOURIER_FEATURES // 2))
        self.time = nn.Sequential(
            nn.Linear(_FOURIER_FEATURES + 1, time_dim), nn.SiLU(), nn.Linear(time_dim, time_dim)
        )
        self.project = nn.Linear(dim, time_dim)
        self.body = nn.Sequential(
            nn.Linear(time_dim, width), *[_Block(width) for _ in range(blocks)], nn.LayerNorm(width)
        )
        self.read_out = nn.Linear(width, dim)

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor) -> torch.Tensor:
        t = c_noise.reshape(-1, 1)  # (B,) -> (B, 1)
        angles = 2 * math.pi * t * self.frequencies  # (B, features / 2)
        fourier = torch.cat([t, angles.sin(), angles.cos()], -1)  # (B, features + 1)
        h = self.project(x) + self.time(fourier)
        return self.read_out(F.relu(self.body(h)))


def _scheduler(config: DiffusionConfig) -> Any:
    # diffusers is imported with torch, when a model is built: not when a Dask worker unpickles
    # the stage module that imports this one lazily.
    from diffusers import EDMDPMSolverMultistepScheduler

    return EDMDPMSolverMultistepScheduler(
        sigma_min=SIGMA_MIN,
        sigma_max=SIGMA_MAX,
        sigma_data=SIGMA_DATA,
        sigma_schedule="karras",
        rho=RHO,
        prediction_type="epsilon",  # F as in EDM: D = c_skip x + c_out F
        algorithm_type="dpmsolver++",
        solver_order=2,
        final_sigmas_type="zero",
    )


@dataclasses.dataclass(frozen=True, eq=False)
class TransitionLayout:
    """Where each part of a transition sits in the flat vector, and its standardisation."""

    observation_dim: int
    action_dim: int
    mean: npt.NDArray[np.float32]
    """(d,) per-dimension mean; 0 at the terminal."""
    std: npt.NDArray[np.float32]
    """(d,) per-dimension standard deviation (1 where the data is constant); 1 at the terminal."""
    delta: bool = False
    """The ``s'`` block holds ``s' - s`` (``DiffusionConfig.next_state: delta``)."""

    @property
    def dim(self) -> int:
        """Length of the flat vector: ``2 * obs + act + 2``."""
        return 2 * self.observation_dim + self.action_dim + 2

    @classmethod
    def of(cls, data: Transitions, delta: bool = False) -> TransitionLayout:
        """The layout and statistics of ``data``'s transitions (``delta``: of ``s' - s``)."""
        flat = _flatten(data, delta).astype(np.float64)
        mean, std = flat.mean(0), flat.std(0)
        std = np.where(std > 1e-6, std, 1.0)
        mean[-1], std[-1] = 0.0, 1.0  # the terminal stays 0/1 (SynthER)
        return cls(
            int(np.prod(data.observation_shape)),
            int(np.prod(data.action_shape)),
            mean.astype(np.float32),
            std.astype(np.float32),
            delta,
        )

    def standardise(self, data: Transitions) -> npt.NDArray[np.float32]:
        """``(N, d)`` standardised vectors of ``data``'s transitions."""
        return ((_flatten(data, self.delta) - self.mean) / self.std).astype(np.float32)

    def split(self, vectors: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.float32], ...]:
        """Standardised ``(N, d)`` back to observations, actions, rewards, next observations and
        the raw terminal coordinate, in the data's units."""
        raw = vectors * self.std + self.mean
        o, a = self.observation_dim, self.action_dim
        observations, next_block = raw[:, :o], raw[:, o + a + 1 : -1]
        next_observations = observations + next_block if self.delta else next_block
        return observations, raw[:, o : o + a], raw[:, o + a], next_observations, raw[:, -1]


def _flatten(data: Transitions, delta: bool = False) -> npt.NDArray[np.float32]:
    n = len(data)
    observations = np.asarray(data.observations, np.float32).reshape(n, -1)
    next_observations = np.asarray(data.next_observations, np.float32).reshape(n, -1)
    return np.concatenate(
        [
            observations,
            np.asarray(data.actions, np.float32).reshape(n, -1),
            np.asarray(data.rewards, np.float32)[:, None],
            next_observations - observations if delta else next_observations,
            np.asarray(data.terminals, np.float32)[:, None],
        ],
        1,
    )


class Diffusion:
    """An EDM diffusion model of ``dim``-vectors (standardised), its training and sampling.

    ``device``: where the network trains and samples (None: CUDA when present).
    """

    def __init__(
        self, dim: int, config: DiffusionConfig, device: str | torch.device | None = None
    ) -> None:
        self.dim = dim
        self.config = config
        self.device = choose_device(None if device is None else str(device))
        torch.manual_seed(config.seed)
        net = ResidualDenoiser(dim, config.width, config.blocks, config.time_dim)
        self.net = net.to(self.device)
        self.scheduler = _scheduler(config)

    def denoise(self, noisy: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """F's raw output at ``noisy`` ``(B, d)`` and noise levels ``sigma`` ``(B, 1)``."""
        scheduler = self.scheduler
        return self.net(
            scheduler.precondition_inputs(noisy, sigma), scheduler.precondition_noise(sigma)
        )

    def loss(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """EDM's weighted denoising loss on a batch ``x`` ``(B, d)``."""
        sigma = torch.exp(
            P_MEAN + P_STD * torch.randn(len(x), 1, generator=generator, device=x.device)
        )
        noisy = x + sigma * torch.randn(x.shape, generator=generator, device=x.device)
        denoised = self.scheduler.precondition_outputs(noisy, self.denoise(noisy, sigma), sigma)
        weight = (sigma**2 + SIGMA_DATA**2) / (sigma * SIGMA_DATA) ** 2
        return (weight * (denoised - x) ** 2).mean()

    def fit(self, vectors: npt.ArrayLike) -> dict[str, float]:
        """Train on ``vectors`` ``(N, d)``; returns the mean loss of the last tenth of the
        steps (``train_loss``)."""
        config = self.config
        # A copy: the data may be a read-only memory map, which torch must not wrap.
        data = torch.tensor(np.asarray(vectors, dtype=np.float32), device=self.device)
        rng = np.random.default_rng(config.seed)
        generator = torch.Generator(self.device).manual_seed(config.seed)
        optimizer = adam(self.net.parameters(), config.learning_rate)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.steps)
        tail = max(1, config.steps // 10)
        losses = torch.zeros(tail, device=self.device)
        self.net.train()
        for step in range(config.steps):
            rows = torch.as_tensor(
                rng.integers(0, len(data), size=config.batch_size), device=self.device
            )
            loss = self.loss(data[rows], generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses[step % tail] = loss.detach()
        self.net.eval()
        return {"train_loss": float(losses.mean())}

    @torch.no_grad()
    def sample(self, n: int, seed: int, chunk: int = 16_384) -> npt.NDArray[np.float32]:
        """``(n, d)`` vectors from noise of seed ``seed``, ``chunk`` rows at a time (the noise
        is drawn on the CPU, so a seed gives the same start on every device)."""
        generator = torch.Generator().manual_seed(seed)
        out = [np.zeros((0, self.dim), np.float32)]
        for start in range(0, n, chunk):
            scheduler = _scheduler(self.config)  # the multistep solver keeps state: one per chunk
            scheduler.set_timesteps(self.config.sampler_steps)
            x = torch.randn(min(chunk, n - start), self.dim, generator=generator)
            x = x.to(self.device) * scheduler.sigmas[0]
            for index, timestep in enumerate(scheduler.timesteps):
                sigma = scheduler.sigmas[index].to(self.device).expand(len(x), 1)
                x = scheduler.step(self.denoise(x, sigma), timestep, x).prev_sample
            out.append(x.cpu().numpy())
        return np.concatenate(out)


@dataclasses.dataclass(frozen=True, eq=False)
class TransitionDiffusion:
    """A diffusion model of a dataset's transitions: the model, its layout, the action box."""

    diffusion: Diffusion
    layout: TransitionLayout
    spaces: Spaces

    def state_dict(self) -> dict[str, Any]:
        """Weights and the layout's statistics."""
        return {
            "net": self.diffusion.net.state_dict(),
            "mean": torch.as_tensor(self.layout.mean),
            "std": torch.as_tensor(self.layout.std),
        }


def train_diffusion(
    data: Transitions, config: DiffusionConfig | None = None, device: str | None = None
) -> tuple[TransitionDiffusion, dict[str, float]]:
    """Fit a denoiser to ``data``'s transitions (continuous actions, flat observations) on
    ``device`` (None: CUDA when present).

    Returns the model and its metrics: ``train_loss`` and ``train_seconds``.
    """
    config = config or DiffusionConfig()
    if data.is_discrete_action or len(data.observation_shape) != 1:
        raise ValueError("the diffusion backend needs continuous actions and flat observations")
    if data.observations.dtype != np.float32:
        raise ValueError("the diffusion backend needs continuous (Box) observations")
    if config.next_state not in ("absolute", "delta"):
        raise ValueError(f"next_state must be 'absolute' or 'delta', not {config.next_state!r}")
    layout = TransitionLayout.of(data, delta=config.next_state == "delta")
    spaces = spaces_from_transitions(data.meta, data.observation_shape[0], data.actions)
    model = TransitionDiffusion(Diffusion(layout.dim, config, device), layout, spaces)
    started = time.perf_counter()
    metrics = model.diffusion.fit(layout.standardise(data))
    return model, {**metrics, "train_seconds": time.perf_counter() - started}


def generate(
    model: TransitionDiffusion, n: int, seed: int, meta: Mapping[str, Any] | None = None
) -> Transitions:
    """``n`` generated transitions, each its own one-step episode (see the module docstring).

    ``meta``: the source's (its spaces and env are kept).
    """
    observations, actions, rewards, next_observations, terminal = model.layout.split(
        model.diffusion.sample(n, seed)
    )
    low = np.asarray(model.spaces.action_low, np.float32)
    high = np.asarray(model.spaces.action_high, np.float32)
    terminals = terminal >= TERMINAL_THRESHOLD
    source_meta = dict(meta or {})
    return Transitions(
        observations=np.ascontiguousarray(observations, dtype=np.float32),
        actions=np.clip(actions, low, high).astype(np.float32),
        rewards=np.ascontiguousarray(rewards, dtype=np.float32),
        next_observations=np.ascontiguousarray(next_observations, dtype=np.float32),
        terminals=terminals,
        timeouts=~terminals,
        episode_ids=np.arange(n, dtype=np.int64),
        importance_weight=np.ones(n, dtype=np.float32),
        source=np.full(n, Source.GENERATED, dtype=np.int8),
        meta={
            **{key: source_meta.get(key) for key in SPACE_META_KEYS},
            "format": "offaug-diffusion-sample",
        },
    )


def save_diffusion(model: TransitionDiffusion, path: str | Path) -> Path:
    """Write the model as a checkpoint that loads without pickle."""
    return save_checkpoint(
        path,
        algorithm="diffusion",
        config=model.diffusion.config,
        spaces=model.spaces,
        state=model.state_dict(),
    )


def load_diffusion(path: str | Path, device: str | None = None) -> TransitionDiffusion:
    """Load :func:`save_diffusion`'s checkpoint onto ``device`` (None: CUDA when present)."""
    checkpoint = load_checkpoint(path)
    if checkpoint.algorithm != "diffusion":
        raise ValueError(f"{path}: a {checkpoint.algorithm} checkpoint, not a diffusion model")
    spaces = checkpoint.spaces
    # A checkpoint written before next_state existed modelled s' itself.
    config = config_from_json(DiffusionConfig, {"next_state": "absolute", **checkpoint.config})
    layout = TransitionLayout(
        spaces.observation_dim,
        spaces.action_dim,
        checkpoint.state["mean"].numpy(),
        checkpoint.state["std"].numpy(),
        config.next_state == "delta",
    )
    diffusion = Diffusion(layout.dim, config, device)
    diffusion.net.load_state_dict(checkpoint.state["net"])
    diffusion.net.eval()
    return TransitionDiffusion(diffusion, layout, spaces)
