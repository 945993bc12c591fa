"""The BC policy as numpy matrices: what every rollout and the diagnostics call per step.

For a rollout step's small batch, numpy's per-call overhead is half of torch's, and the loop
never leaves numpy; :class:`BCRolloutPolicy` copies a trained BC network's linear layers and
the action normaliser's affine map out of torch once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


class BCRolloutPolicy:
    """Adapts an offaug BC trainer (Gaussian policy, or categorical for discrete actions).

    Satisfies :class:`offaug.pipeline.behaviour.RolloutPolicy`.
    """

    def __init__(self, trainer: Any) -> None:
        # torch is imported here, not at module level: the pipeline's stage module imports this
        # one, and a Dask worker should not pay for torch before a stage that needs it.
        import torch

        from offaug.algorithms.bc import BC
        from offaug.algorithms.networks import LOG_STD_MAX, LOG_STD_MIN, TruncatedGaussianActor

        self._log_std_bounds = (LOG_STD_MIN, LOG_STD_MAX)

        if not isinstance(trainer, BC):
            raise TypeError("rollouts need a BC policy (offaug train bc ...)")
        if not trainer.spaces.discrete and not isinstance(trainer.policy, TruncatedGaussianActor):
            raise TypeError(
                "rollouts need a Gaussian BC policy (its log-probabilities weight the data)"
            )
        self.trainer = trainer
        self.discrete: bool = trainer.spaces.discrete
        network = trainer.policy if self.discrete else trainer.policy.net
        assert isinstance(network, torch.nn.Module)
        self._layers = [
            (
                m.weight.detach().cpu().numpy().T.astype(np.float32).copy(),
                m.bias.detach().cpu().numpy().astype(np.float32),
            )
            for m in network.modules()
            if isinstance(m, torch.nn.Linear)
        ]
        self._scale = trainer.normaliser.scale.cpu().numpy().astype(np.float64)
        self._offset = trainer.normaliser.offset.cpu().numpy().astype(np.float64)

    def __call__(
        self, observations: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None]:
        x = np.asarray(observations, dtype=np.float32)
        last = len(self._layers) - 1
        for k, (weight, bias) in enumerate(self._layers):
            x = x @ weight + bias
            if k < last:
                np.maximum(x, 0.0, out=x)
        out = x.astype(np.float64)
        if self.discrete:
            return out, None
        mean, log_std = np.split(out, 2, axis=-1)
        return np.tanh(mean), np.clip(log_std, *self._log_std_bounds)

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        if self.discrete:
            return actions
        return ((actions - self._offset) / self._scale).astype(np.float32)

    @property
    def log_abs_det(self) -> float:
        return 0.0 if self.discrete else float(self.trainer.normaliser.log_abs_det)
