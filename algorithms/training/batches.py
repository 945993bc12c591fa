"""What training draws and applies to every batch: the sampler over one or many sources and
the batch preparation (importance weights, state noise) a run's options ask for."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from offaug.algorithms.base import (
    PolicyDensity,
    Trainer,
    reads_sources,
)
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.training.options import TrainOptions
from offaug.algorithms.training.state_noise import StateNoiser, observation_std
from offaug.algorithms.training.weighting import (
    DEFAULT_MAX_WEIGHT,
    PolicyWeights,
    WeightUsage,
)
from offaug.datasets.sampler import MixtureSampler
from offaug.datasets.shards import ShardSet
from offaug.datasets.transitions import Transitions


class BatchPreparation:
    """What happens to a sampled batch before ``update``: conversion to torch, policy weights,
    counting the weights used, state noise (in that order: pi/mu belongs to the clean state)."""

    def __init__(
        self,
        trainer: Trainer,
        sampler: MixtureSampler,
        datasets: Sequence[Transitions | ShardSet],
        options: TrainOptions,
        device: torch.device,
    ) -> None:
        self.device = device
        self.policy_weights: PolicyWeights | None = None
        self.usage: WeightUsage | None = None
        if options.weighting == "policy":
            if not isinstance(trainer, PolicyDensity):
                raise ValueError(f"{type(trainer).__name__} has no policy_log_prob")
            max_weights = [_max_weight(d, options.max_weight) for d in datasets]
            self.policy_weights = PolicyWeights(
                trainer, max_weights, device, normalise=options.normalise_weights
            )
            self.usage = WeightUsage(sampler.sets_with_log_probs, device)
        elif options.weighting == "behaviour":
            self.usage = WeightUsage(sampler.weighted_sets, device)
        self.with_sources = self.usage is not None or reads_sources(trainer)
        self.noiser: StateNoiser | None = None
        if options.state_noise is not None:
            std = observation_std(_parts(datasets[0]))
            self.noiser = StateNoiser(options.state_noise, std, device, options.seed)

    def __call__(self, sampler: MixtureSampler) -> TorchBatch:
        batch = TorchBatch.from_batch(sampler.sample(), self.device, with_sources=self.with_sources)
        clipped = None
        if self.policy_weights is not None:
            batch, clipped = self.policy_weights(batch)
        if self.usage is not None:
            assert batch.set_index is not None  # converted with_sources
            self.usage.add(batch.weights, batch.set_index, clipped)
        if self.noiser is not None:
            batch = self.noiser(batch)
        return batch

    def flush_metrics(self) -> dict[str, float]:
        """The weights' figures since the last call (one host sync)."""
        if self.usage is None:
            return {}
        return self.usage.flush(clipping=self.policy_weights is not None)


def _max_weight(data: Transitions | ShardSet, override: float | None) -> float:
    if override is not None:
        return override
    recorded = data.params.get("max_weight") if isinstance(data, ShardSet) else None
    return float(recorded) if recorded is not None else DEFAULT_MAX_WEIGHT


def _parts(data: Transitions | ShardSet) -> Iterable[Transitions]:
    return data.iter_shards() if isinstance(data, ShardSet) else [data]


def make_sampler(
    trainer: Trainer,
    sets: Sequence[Transitions | ShardSet],
    *,
    mixing: Sequence[float] | None = None,
    use_weights: bool = False,
    normalise_weights: bool = True,
    rollout_log_prob: bool = False,
    seed: int = 0,
) -> MixtureSampler:
    """The sampler ``trainer`` trains from, with the trainer prepared on its data.

    Batches carry ``next_actions`` for a trainer that ``uses_next_actions`` (ReBRAC); a trainer
    with ``prepare(sampler)`` (TD3+BC, ReBRAC, IQL) takes its data statistics from it here. A
    resumed run then loads the statistics its checkpoint stored.
    """
    sampler = MixtureSampler(
        sets,
        trainer.config.batch_size,
        mixing=mixing,
        use_weights=use_weights,
        normalise_weights=normalise_weights,
        rollout_log_prob=rollout_log_prob,
        seed=seed,
        next_actions=bool(getattr(trainer, "uses_next_actions", False)),
    )
    prepare = getattr(trainer, "prepare", None)
    if callable(prepare):
        prepare(sampler)
    return sampler
