"""The fixed sizes of the diagnostics that the workflow does not set."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DiagnosticsSettings:
    """Fixed sizes of the diagnostics that the workflow does not set (documented defaults)."""

    evaluation_episodes: int = 3
    """Fresh episodes per trained policy (reset seeds ``seed + 20_000 + i``)."""
    histogram_bins: int = 30
    """Bins of every histogram."""
    scatter_points: int = 300
    """Points kept per Q-vs-MC scatter."""
    fqe_steps: int = 500
    """Adam steps of fitted-Q evaluation."""
    fqe_hidden: tuple[int, ...] = (64, 64)
    """Hidden widths of the FQE network."""
    fqe_learning_rate: float = 1e-3
    """Adam learning rate of FQE."""
    fqe_batch_size: int = 256
    """Transitions per FQE step."""
    fqe_tau: float = 0.1
    """Polyak rate of the FQE target network."""
    target_sigma: float = 0.2
    """Std (normalised box) of the Gaussian standing in for a deterministic policy in WPDIS."""
    target_epsilon: float = 0.1
    """Epsilon of the epsilon-greedy policy standing in for a discrete greedy one in WPDIS."""
