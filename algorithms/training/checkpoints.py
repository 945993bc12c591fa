"""A training run's checkpoints: writing them (learner, optimisers, the batch preparation's
random state), resuming from one, and loading a trained learner back."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from offaug.algorithms import registry
from offaug.algorithms.base import (
    Spaces,
    Trainer,
    load_checkpoint,
    save_checkpoint,
)
from offaug.algorithms.training.batches import BatchPreparation
from offaug.datasets.atomic import write_bytes_atomic
from offaug.datasets.sampler import MixtureSampler


def write_checkpoint(
    trainer: Trainer,
    sampler: MixtureSampler,
    prepare: BatchPreparation,
    algorithm: str,
    config: Any,
    spaces: Spaces,
    step: int,
    run_dir: Path,
    torch_rng: torch.Tensor | None = None,
) -> None:
    """Write ``run_dir/checkpoints/step_<step>.pt`` and copy it to ``run_dir/checkpoint.pt``.

    Beside the trainer's state it records what a resumed run needs to continue as if never
    stopped: the sampler's and the state noise's generators, the weights used so far, and
    ``torch_rng`` (default torch's global generator state).
    """
    extra: dict[str, Any] = {
        "step": step,
        "sampler_rng": sampler.rng_state(),
    }
    rng = torch.get_rng_state() if torch_rng is None else torch_rng
    state = {**trainer.state_dict(), "torch_rng": rng}
    if prepare.usage is not None:
        extra["weight_usage"] = prepare.usage.run_totals
    if prepare.noiser is not None:
        state[_STATE_NOISE_RNG] = prepare.noiser.get_state()
    path = save_checkpoint(
        run_dir / "checkpoints" / f"step_{step}.pt",
        algorithm=algorithm,
        config=config,
        spaces=spaces,
        state=state,
        extra=extra,
    )
    # The latest checkpoint is a copy under a fixed name, replaced atomically.
    write_bytes_atomic(run_dir / "checkpoint.pt", path.read_bytes())


_STATE_NOISE_RNG = "state_noise_rng"
"""Checkpoint state key of the state-noise generator (beside ``torch_rng``, not the learner's)."""


def resume_from_checkpoint(
    trainer: Trainer,
    sampler: MixtureSampler,
    prepare: BatchPreparation,
    path: Path,
    algorithm: str,
) -> int:
    """Restore what :func:`write_checkpoint` wrote at ``path``; return the step it was at."""
    checkpoint = load_checkpoint(path)
    if checkpoint.algorithm != algorithm:
        raise ValueError(f"{path}: a {checkpoint.algorithm} checkpoint cannot resume {algorithm}")
    state = dict(checkpoint.state)
    torch.set_rng_state(state.pop("torch_rng"))
    noise_state = state.pop(_STATE_NOISE_RNG, None)
    if prepare.noiser is not None and noise_state is not None:
        prepare.noiser.set_state(noise_state)
    trainer.load_state_dict(state)
    sampler.set_rng_state(checkpoint.extra["sampler_rng"])
    if prepare.usage is not None and "weight_usage" in checkpoint.extra:
        prepare.usage.run_totals = [float(x) for x in checkpoint.extra["weight_usage"]]
    return int(checkpoint.extra["step"])


def load_weights(trainer: Trainer, path: str | os.PathLike[str], algorithm: str) -> None:
    """Load the learner state of the checkpoint at ``path`` into ``trainer`` (not the
    generators a resumed run restores: the run that starts from it draws its own)."""
    checkpoint = load_checkpoint(path)
    if checkpoint.algorithm != algorithm:
        raise ValueError(f"{path}: a {checkpoint.algorithm} checkpoint cannot start {algorithm}")
    try:
        trainer.load_state_dict(_learner_state(checkpoint.state))
    except RuntimeError as exc:  # torch's size mismatch: a checkpoint of other network sizes
        raise ValueError(
            f"{path}: its {algorithm} weights do not fit this run's {algorithm} config (give"
            f" both the same network sizes): {exc}"
        ) from exc


def _learner_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in ("torch_rng", _STATE_NOISE_RNG)}


def load_trainer(path: str | os.PathLike[str], *, device: str | None = None) -> Trainer:
    """A trainer restored from a checkpoint (for ``act`` and ``log_prob``)."""
    checkpoint = load_checkpoint(path)
    trainer = registry.build(
        checkpoint.algorithm, checkpoint.spaces, checkpoint.config, device=device
    )
    trainer.load_state_dict(_learner_state(checkpoint.state))
    return trainer
