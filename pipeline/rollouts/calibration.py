"""Rollout noise chosen against the episode filter: the largest Gaussian sigma that survives it.

How much noise a rollout policy can take before its episodes earn less than the data depends on
the task far more than on anything else: Pendulum-v1's episodes stay above its data under
sigma 0.1, while a TD3+BC policy on Hopper-v5 that earns 1,400-2,000 per episode without noise
falls near step 300 under 0.03, so the filter drops every episode and the recipe adds nothing
(benchmarks/LOG.md). ``rollout.noise_calibration`` probes each sigma, largest first, with a
few episodes through the same filter, and keeps the first whose kept share reaches ``keep``.
The probes use their own seeds, apart from the rollout's, and run in memory: nothing is written.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from offaug.pipeline.rollouts.noise import NoiseSpec, parse_noise
from offaug.pipeline.rollouts.tasks import RolloutTask, rollout_results

_PROBE_SEED_OFFSET = 7_919
"""Added to the rollout's seed: the probes' resets and noise are not the rollout's own."""


class CalibrationSettings(Protocol):
    """What calibration reads from the workflow's ``rollout.noise_calibration``."""

    @property
    def scales(self) -> tuple[float, ...]: ...
    @property
    def episodes(self) -> int: ...
    @property
    def keep(self) -> float: ...


@dataclasses.dataclass(frozen=True)
class NoiseCalibration:
    """What calibration chose, handed to every rollout task and the merge as it is."""

    noise: NoiseSpec
    """The noise to roll out with: the first sigma whose probes kept at least ``keep`` of their
    episodes, else the smallest tried."""
    keep: float
    """The share of probe episodes the filter had to keep."""
    trials: tuple[dict[str, Any], ...]
    """Every probe, in order: ``{"noise": text, "episodes", "kept"}``."""

    def to_json(self) -> dict[str, Any]:
        """``{"noise": text, "keep", "trials"}``, for the manifest and the report."""
        return {"noise": self.noise.text, "keep": self.keep, "trials": list(self.trials)}


def calibrate_noise(task: RolloutTask, calibration: CalibrationSettings) -> NoiseCalibration:
    """Probe ``calibration.scales`` (largest first) on ``task``'s policy, env and filter."""
    if task.config.filter == "none":
        raise ValueError("noise_calibration needs a rollout.filter: nothing to probe against")
    noises = [parse_noise(f"gaussian:{sigma:g}") for sigma in calibration.scales]
    probes = (
        dataclasses.replace(
            task.config,
            episodes=calibration.episodes,
            simulator_steps=None,
            noise=noise,
            seed=task.config.seed + _PROBE_SEED_OFFSET,
        )
        for noise in noises
    )
    trials: list[dict[str, Any]] = []
    chosen = noises[0]
    # Lazy: the data, policy and filter load once, and no probe runs past the first that passes.
    for chosen, result in zip(noises, rollout_results(task, probes), strict=False):
        kept = len(result.episode_returns)
        trials.append({"noise": chosen.text, "episodes": calibration.episodes, "kept": kept})
        if kept >= calibration.keep * calibration.episodes:
            break
    return NoiseCalibration(chosen, calibration.keep, tuple(trials))
