"""Behaviour cloning: the warm start of the rollout policy and the behaviour model beta_hat.

Pomerleau 1991. Two policies:

* ``gaussian``: a Gaussian with learned, state-dependent std truncated to the action box
  (:class:`TruncatedGaussianActor`), fitted by maximum likelihood. Its ``log_prob`` is
  beta_hat(a|s), the denominator-side model behind every importance weight.
* ``deterministic``: ``a = tanh(MLP(s))`` fitted by mean squared error.

Discrete actions use a categorical policy (cross-entropy) whatever ``policy`` says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch.nn import functional as F

from offaug.algorithms.base import Spaces, adam, load_optimizer_state, weighted_mean
from offaug.algorithms.batch import TorchBatch, index_tensor, to_tensor
from offaug.algorithms.fusing import FusedSpec, Hyper, OptimizerSpec, Phase, config_hyperparameters
from offaug.algorithms.nn.distributions import ActionNormaliser
from offaug.algorithms.nn.networks import MLP, DeterministicActor, TruncatedGaussianActor
from offaug.algorithms.runtime import choose_device


@dataclasses.dataclass(frozen=True)
class BCConfig:
    """Behaviour-cloning hyperparameters."""

    policy: Literal["gaussian", "deterministic"] = "gaussian"
    """Gaussian (with log-probabilities, the behaviour model) or deterministic (MSE)."""
    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the policy network."""
    learning_rate: float = 1e-3
    """Adam learning rate."""
    batch_size: int = 256
    """Transitions per gradient step."""


def gaussian_nll(log_prob: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Negative log-likelihood of dataset actions."""
    return weighted_mean(-log_prob, weights)


def squared_error(
    predicted: torch.Tensor, actions: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """Sum over action dimensions of the squared error, averaged over the batch."""
    return weighted_mean((predicted - actions).pow(2).sum(-1), weights)


class BC:
    """Behaviour-cloning trainer."""

    name = "bc"
    fused_hyperparameters = ("learning_rate",)
    """Config fields that may differ between the members of a fused run."""

    def __init__(
        self, spaces: Spaces, config: BCConfig | None = None, *, device: str | None = None
    ) -> None:
        self.spaces = spaces
        self.config = config or BCConfig()
        self.device = choose_device(device)
        self.normaliser = ActionNormaliser(spaces).to(self.device)
        hidden = self.config.hidden
        self.policy: torch.nn.Module
        if spaces.discrete:
            self.policy = MLP(spaces.observation_dim, hidden, spaces.action_dim)
        elif self.config.policy == "gaussian":
            self.policy = TruncatedGaussianActor(spaces.observation_dim, spaces.action_dim, hidden)
        else:
            self.policy = DeterministicActor(spaces.observation_dim, spaces.action_dim, hidden)
        self.policy.to(self.device)
        self.optimizer = adam(self.policy.parameters(), self.config.learning_rate)
        self.steps = 0

    def compile_targets(self) -> tuple[str, ...]:
        """Methods that ``torch.compile`` speeds up (see
        :mod:`offaug.algorithms.training.compiling`).

        Only the Gaussian policy's loss: its truncated-normal log-density is many small
        element-wise ops that compiling fuses; the other policies' steps are matmul-bound.
        """
        if self.spaces.discrete or self.config.policy != "gaussian":
            return ()
        return ("loss",)

    def loss(self, batch: TorchBatch) -> torch.Tensor:
        """The weighted loss of one batch."""
        observations, weights = batch.observations, batch.weights
        if self.spaces.discrete:
            logits = self.policy(observations)
            return weighted_mean(F.cross_entropy(logits, batch.actions, reduction="none"), weights)
        actions = self.normaliser(batch.actions)
        if isinstance(self.policy, TruncatedGaussianActor):
            return gaussian_nll(self.policy.log_prob(observations, actions), weights)
        return squared_error(self.policy(observations), actions, weights)

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One gradient step."""
        loss = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return {"loss": loss.detach()}

    def fused_spec(self) -> FusedSpec:
        """The update as one phase (see :mod:`offaug.algorithms.fusing`)."""
        return FusedSpec(
            modules={"policy": self.policy, "normaliser": self.normaliser},
            optimizers={"optimizer": OptimizerSpec(self.optimizer, "policy", "learning_rate")},
            targets={},
            phases=(Phase(self._phase_loss, ("optimizer",)),),
            hyperparameters=config_hyperparameters(self.config, self.fused_hyperparameters),
            metrics=("loss",),
            # Cross-entropy reads its class axis second, so only the continuous losses stack.
            stacked=not self.spaces.discrete,
        )

    def _phase_loss(
        self, batch: TorchBatch, noise: Mapping[str, torch.Tensor], hyper: Hyper
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = self.loss(batch)
        return loss, {"loss": loss.detach()}

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """Greedy actions in the environment's action space."""
        obs = to_tensor(observations, self.device)
        if self.spaces.discrete:
            return self.policy(obs).argmax(-1).cpu().numpy()
        if isinstance(self.policy, TruncatedGaussianActor):
            action = self.policy.deterministic(obs)
        else:
            action = self.policy(obs)
        return self.normaliser.inverse(action).cpu().numpy()

    @staticmethod
    def has_density(config: BCConfig) -> bool:
        """Whether :meth:`policy_log_prob` exists for ``config``: not for a deterministic policy
        (on discrete actions every BC policy is a categorical, but the config cannot tell)."""
        return config.policy == "gaussian"

    @torch.no_grad()
    def policy_log_prob(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``log pi(a|s)`` of environment-space actions (``base.PolicyDensity``): the truncated
        Gaussian over the normalised box plus the box's ``log |det|``, or the categorical's
        log-probability of an action index.

        Raises:
            ValueError: a deterministic policy has no density.
        """
        if self.spaces.discrete:
            log_probs = F.log_softmax(self.policy(observations), -1)
            return log_probs.gather(-1, actions[:, None]).squeeze(-1)
        if not isinstance(self.policy, TruncatedGaussianActor):
            raise ValueError(
                "a deterministic BC policy has no log-probability; use policy='gaussian'"
            )
        # Change of variables from the normalised box to the environment's box.
        normalised = self.normaliser(actions)
        return self.policy.log_prob(observations, normalised) + self.normaliser.log_abs_det

    def log_prob(
        self, observations: npt.NDArray[np.float32], actions: npt.NDArray[Any]
    ) -> npt.NDArray[np.float32]:
        """``log beta_hat(a|s)`` of environment-space actions (a density over the env's box):
        :meth:`policy_log_prob` on arrays.

        Raises:
            ValueError: a deterministic policy has no density.
        """
        obs = to_tensor(observations, self.device)
        if self.spaces.discrete:
            action_tensor = index_tensor(actions, self.device)
        else:
            action_tensor = to_tensor(actions, self.device)
        log_prob: npt.NDArray[np.float32] = self.policy_log_prob(obs, action_tensor).cpu().numpy()
        return log_prob

    def state_dict(self) -> dict[str, Any]:
        """Policy, optimiser and step count."""
        return {
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.policy.load_state_dict(state["policy"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.steps = int(state["steps"])
