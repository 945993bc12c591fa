"""Importance weights as training uses them: the weighting choice, pi/mu from the learner's
current policy, the per-source normalisation and the ESS/N of the weights actually used.

``TrainOptions.weighting`` (:data:`offaug.algorithms.names.Weighting`):

* ``none``: every row weighs 1.
* ``behaviour``: the stored ``importance_weight`` beta_hat/mu of augmented rows (clipped when
  they were rolled out); the sampler normalises it within each source
  (:func:`offaug.datasets.sampler.normalise_source`).
* ``policy``: pi_theta(a|s) / mu(a|s), recomputed before every step from the learner's current
  policy density (:class:`~offaug.algorithms.base.PolicyDensity`) and the stored
  ``rollout_log_prob``, clipped at the source's ``max_weight``, then normalised within each
  source (:func:`normalise_per_source`). Rows of sources without ``rollout_log_prob`` (the
  original data) weigh 1. The weights carry no gradient: they reweight the losses, they are
  not a term the policy optimises.

Normalised within each source, the ``n_s`` rows of source ``s`` in a batch weigh
``w_i * n_s / sum_{j in s} w_j``, so ``mean(w * l)`` over the batch is
``sum_s (n_s / B) * sum_{i in s} w_i l_i / sum_{i in s} w_i``: the mixing ratio is what the
batch holds, whatever the weights' spread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from offaug.algorithms.base import PolicyDensity
from offaug.algorithms.batch import TorchBatch
from offaug.datasets.weights import effective_sample_size_from_sums

DEFAULT_MAX_WEIGHT = 100.0
"""Where pi/mu is clipped for a source that records no ``max_weight`` (the rollouts' default)."""


def normalise_per_source(weights: torch.Tensor, set_index: torch.Tensor, sets: int) -> torch.Tensor:
    """``w_i * n_s / sum_{j in s} w_j`` for the rows of each source ``s``: ``(B,) -> (B,)``.

    ``set_index`` ``(B,)`` int64 in ``[0, sets)``. A source whose rows all weigh 0 keeps them
    at 0 (as the sampler does), with no division by zero and no sync with the host.
    """
    totals = torch.zeros(sets, dtype=weights.dtype, device=weights.device)
    totals = totals.index_add_(0, set_index, weights)
    counts = torch.bincount(set_index, minlength=sets).to(weights.dtype)
    scale = torch.where(totals > 0, counts / totals, torch.zeros_like(totals))
    return weights * scale[set_index]


def clipped_policy_weights(
    log_pi: torch.Tensor, rollout_log_prob: torch.Tensor, log_max_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(min(log pi - log mu, log max_weight))``, 1 where ``rollout_log_prob`` is NaN.

    All ``(B,)``; returns the weights and where they were clipped.
    """
    log_ratio = log_pi - rollout_log_prob
    has_log_prob = ~torch.isnan(rollout_log_prob)
    clipped = has_log_prob & (log_ratio > log_max_weight)
    weights = torch.exp(torch.minimum(log_ratio, log_max_weight))
    return torch.where(has_log_prob, weights, torch.ones_like(weights)), clipped


class PolicyWeights:
    """Replaces a batch's weights by pi_theta/mu under the trainer's current policy."""

    def __init__(
        self,
        trainer: PolicyDensity,
        max_weights: Sequence[float],
        device: torch.device,
        *,
        normalise: bool = True,
    ) -> None:
        self.trainer = trainer
        self.sets = len(max_weights)
        self.normalise = normalise
        self._log_max_weight = torch.tensor(
            [math.log(w) for w in max_weights], dtype=torch.float32, device=device
        )

    def __call__(self, batch: TorchBatch) -> tuple[TorchBatch, torch.Tensor]:
        """The batch with its new weights, and where they were clipped ``(B,)``."""
        if batch.set_index is None or batch.rollout_log_prob is None:
            raise ValueError("policy weights need a batch converted with_sources")
        log_pi = self.trainer.policy_log_prob(batch.observations, batch.actions)
        weights, clipped = clipped_policy_weights(
            log_pi, batch.rollout_log_prob, self._log_max_weight[batch.set_index]
        )
        if self.normalise:
            weights = normalise_per_source(weights, batch.set_index, self.sets)
        return dataclasses.replace(batch, weights=weights.detach()), clipped


class WeightUsage:
    """Running sums of the weights training used on the rows of weighted sources.

    ``add`` stays on the device; :meth:`flush` syncs once per log interval and reports
    ``weight_ess_fraction`` (ESS/N over the interval's weighted rows), ``weight_ess_fraction_run``
    (over every weighted row since the run began) and, for ``policy`` weights,
    ``weight_clipped_fraction`` (share of weighted rows whose pi/mu was clipped).
    """

    def __init__(self, weighted_sets: Sequence[bool], device: torch.device) -> None:
        self._weighted = torch.tensor(list(weighted_sets), dtype=torch.bool, device=device)
        # sum w, sum w^2, rows, clipped rows: over this interval (device) and the run (host).
        self._interval = torch.zeros(4, dtype=torch.float32, device=device)
        self.run_totals = [0.0, 0.0, 0.0, 0.0]

    def add(
        self, weights: torch.Tensor, set_index: torch.Tensor, clipped: torch.Tensor | None
    ) -> None:
        """Count one batch's weights ``(B,)`` (``set_index`` and ``clipped`` ``(B,)`` too)."""
        weighted = self._weighted[set_index]
        used = torch.where(weighted, weights, torch.zeros_like(weights))
        clipped_rows = (clipped & weighted).sum() if clipped is not None else weighted.new_zeros(())
        self._interval += torch.stack(
            [used.sum(), used.square().sum(), weighted.sum(), clipped_rows]
        ).float()

    def flush(self, *, clipping: bool) -> dict[str, float]:
        """The interval's and the run's figures (empty before any weighted row)."""
        interval = self._interval.tolist()
        self._interval.zero_()
        self.run_totals = [a + b for a, b in zip(self.run_totals, interval, strict=True)]
        if self.run_totals[2] == 0:
            return {}
        metrics = {"weight_ess_fraction_run": _ess_fraction(*self.run_totals[:3])}
        if interval[2] > 0:
            metrics["weight_ess_fraction"] = _ess_fraction(*interval[:3])
        if clipping:
            metrics["weight_clipped_fraction"] = self.run_totals[3] / self.run_totals[2]
        return metrics

    def ess_fraction(self) -> float | None:
        """ESS/N over every weighted row so far (None before any)."""
        if self.run_totals[2] == 0:
            return None
        return _ess_fraction(*self.run_totals[:3])


def _ess_fraction(total: float, total_squared: float, rows: float) -> float:
    return effective_sample_size_from_sums(total, total_squared) / rows
