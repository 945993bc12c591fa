"""Rollout policies: the BC policy as numpy matrices, and a trained learner around it.

For a rollout step's small batch, numpy's per-call overhead is below torch's, and the loop
never leaves numpy; :class:`BCRolloutPolicy` copies a trained BC network's linear layers and
the action normaliser's affine map (:class:`offaug.datasets.action_box.ActionBox`) out of
torch once. :class:`LearnerRolloutPolicy` rolls out a trained offline learner instead: the noise is
centred on the learner's deterministic action, and beta_hat is still the BC policy's density.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.action_box import ActionBox
from offaug.pipeline.rollouts.references import DiscountedValue


class BCRolloutPolicy:
    """Adapts an offaug BC trainer (Gaussian policy, or categorical for discrete actions).

    Satisfies :class:`offaug.pipeline.rollouts.behaviour.RolloutPolicy`.
    """

    def __init__(self, trainer: Any) -> None:
        # torch is imported here, not at module level: the pipeline's stage module imports this
        # one, and a Dask worker should not pay for torch before a stage that needs it.
        import torch

        from offaug.algorithms.learners.bc import BC
        from offaug.algorithms.nn.networks import LOG_STD_MAX, LOG_STD_MIN, TruncatedGaussianActor

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
        self.box = ActionBox.from_normaliser(trainer.normaliser)

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
        return self.box.to_env(actions)

    @property
    def log_abs_det(self) -> float:
        return 0.0 if self.discrete else float(self.trainer.normaliser.log_abs_det)


class LearnerRolloutPolicy:
    """A trained offline learner's deterministic action, with the BC policy as beta_hat.

    Satisfies :class:`offaug.pipeline.rollouts.behaviour.CentredPolicy`: the rollout's noise is
    centred on ``learner.act`` (mapped to the normalised box by the BC policy's :class:`ActionBox`;
    discrete learners give action indices), while ``__call__``, ``to_env`` and ``log_abs_det`` are
    the BC policy's, so log beta_hat and the weights mean what they mean for BC rollouts.
    """

    def __init__(self, learner: Any, behaviour: BCRolloutPolicy) -> None:
        if learner.spaces != behaviour.trainer.spaces:
            raise ValueError(
                f"the learner's spaces {learner.spaces} differ from the BC policy's "
                f"{behaviour.trainer.spaces}: both must come from the same dataset"
            )
        self.learner = learner
        self.behaviour = behaviour
        self.discrete: bool = behaviour.discrete

    def __call__(
        self, observations: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None]:
        return self.behaviour(observations)

    def centre(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        actions = np.asarray(self.learner.act(np.asarray(observations, dtype=np.float32)))
        if self.discrete:
            return actions.astype(np.int64).reshape(-1)
        return self.behaviour.box.normalise(actions.reshape(len(observations), -1))

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return self.behaviour.to_env(actions)

    @property
    def log_abs_det(self) -> float:
        return self.behaviour.log_abs_det

    def discounted_value(self) -> DiscountedValue:
        """The learner's own ``V(s)`` (:class:`offaug.algorithms.base.StateValue`: its critics
        at its action, IQL's V) and the discount it learned with: MOBILE's penalty and the
        lookahead's bootstrap need them.

        Raises:
            ValueError: the learner has no value of its own.
        """
        state_values = getattr(self.learner, "state_values", None)
        if not callable(state_values):
            raise ValueError(
                f"MOBILE's penalty and lookahead.bootstrap need V(s) of the rollout learner; a"
                f" {type(self.learner).__name__} has no state_values"
            )
        return DiscountedValue(state_values, float(self.learner.config.gamma))


def load_rollout_policy(behaviour: str, learner: str | None = None) -> Any:
    """The rollout policy of checkpoints: BC (``learner`` None) or a learner around BC.

    Returns a :class:`BCRolloutPolicy` or a :class:`LearnerRolloutPolicy`.
    """
    # torch comes with load_trainer: imported here for the reason given in __init__ above.
    from offaug.algorithms.training.checkpoints import load_trainer

    bc = BCRolloutPolicy(load_trainer(behaviour, device="cpu"))
    if learner is None:
        return bc
    return LearnerRolloutPolicy(load_trainer(learner, device="cpu"), bc)
