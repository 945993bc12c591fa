"""Conservative Q-Learning for discrete actions: the CQL penalty on a double DQN.

Kumar, Zhou, Tucker and Levine 2020, "Conservative Q-Learning for Offline Reinforcement
Learning" (NeurIPS, arXiv:2006.04779), section 4 (CQL(H) with discrete actions, where
``log sum_a exp Q(s, a)`` is exact). Where the paper leaves a choice this file follows d3rlpy
2.8 (``algos/qlearning/torch/cql_impl.py``, ``DiscreteCQLImpl``): the penalty is taken on the
ensemble-mean Q, the TD error is Huber by default, and the target network is a hard copy.
Continuous actions: :mod:`offaug.algorithms.learners.cql`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch.nn import functional as F

from offaug.algorithms.base import (
    Spaces,
    adam,
    frozen_copy,
    hard_update,
    load_optimizer_state,
    weighted_mean,
)
from offaug.algorithms.batch import TorchBatch, index_tensor, to_tensor
from offaug.algorithms.fusing import FusedSpec, Hyper, config_hyperparameters, hard_copy_spec
from offaug.algorithms.learners.losses import td_target
from offaug.algorithms.nn.networks import DiscreteCriticEnsemble
from offaug.algorithms.runtime import choose_device


@dataclasses.dataclass(frozen=True)
class DiscreteCQLConfig:
    """Discrete CQL hyperparameters; the defaults are d3rlpy 2.8's ``DiscreteCQLConfig()``."""

    learning_rate: float = 6.25e-5
    """Adam learning rate of the Q-networks."""
    batch_size: int = 32
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    n_critics: int = 1
    """Q-networks in the ensemble; the target takes their minimum."""
    target_update_interval: int = 8000
    """Gradient steps between hard copies of the Q-networks into the target (first at step 1)."""
    alpha: float = 1.0
    """Weight of the penalty ``logsumexp_a Q(s, a) - Q(s, a_data)``."""
    td_loss: Literal["huber", "mse"] = "huber"
    """TD error: Huber with delta 1 (d3rlpy's mean Q-function) or squared error."""
    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of every Q-network."""


def discrete_td_loss(
    q_data: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor | None,
    kind: Literal["huber", "mse"] = "huber",
) -> torch.Tensor:
    """TD error summed over critics, weighted mean over the batch: ``(E, B), (B,) -> ()``."""
    target = target.expand_as(q_data)
    if kind == "huber":
        errors = F.huber_loss(q_data, target, reduction="none", delta=1.0)
    else:
        errors = (q_data - target).pow(2)
    return weighted_mean(errors.sum(0), weights)


def discrete_conservative_loss(
    q_values: torch.Tensor, q_data: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """``logsumexp_a Q(s, a) - Q(s, a_data)`` of the ensemble-mean Q (as d3rlpy).

    ``q_values`` ``(E, B, n_actions)``, ``q_data`` ``(E, B)``.
    """
    mean_q = q_values.mean(0)  # (B, n_actions)
    return weighted_mean(torch.logsumexp(mean_q, dim=-1) - q_data.mean(0), weights)


class DiscreteCQL:
    """Discrete CQL trainer: double DQN with a hard-copied target and the CQL penalty."""

    name = "discrete_cql"
    fused_hyperparameters: tuple[str, ...] = ("learning_rate", "gamma", "alpha")
    """Config fields that may differ between the members of a fused run."""

    def __init__(
        self,
        spaces: Spaces,
        config: DiscreteCQLConfig | None = None,
        *,
        device: str | None = None,
    ) -> None:
        if not spaces.discrete:
            raise ValueError("DiscreteCQL learns discrete actions; use CQL for continuous ones")
        self.spaces = spaces
        self.config = config or DiscreteCQLConfig()
        self.device = choose_device(device)
        cfg = self.config
        self.critic = DiscreteCriticEnsemble(
            spaces.observation_dim, spaces.action_dim, cfg.hidden, cfg.n_critics
        ).to(self.device)
        self.critic_target = frozen_copy(self.critic)
        self.optimizer = adam(self.critic.parameters(), cfg.learning_rate)
        self.steps = 0

    def hyperparameters(self) -> dict[str, float]:
        """The values of :attr:`fused_hyperparameters` (the loss reads them from here)."""
        return config_hyperparameters(self.config, self.fused_hyperparameters)

    def copies_target(self, step: int) -> bool:
        """Whether step ``step`` (counted from 0) ends with a hard copy into the target."""
        return step % self.config.target_update_interval == 0

    def loss(
        self, batch: TorchBatch, noise: Mapping[str, torch.Tensor], hyper: Hyper
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step's TD loss plus ``alpha`` times the penalty, and its metrics (no noise)."""
        cfg = self.config
        batch_size = batch.observations.shape[0]
        # One online pass over s and s' together: (2B, obs) -> (E, 2B, n_actions).
        q_both = self.critic(torch.cat([batch.observations, batch.next_observations]))
        q_values = q_both[:, :batch_size]  # (E, B, n_actions)
        index = batch.actions.view(1, -1, 1).expand(q_values.shape[0], -1, 1)
        q_data = q_values.gather(-1, index).squeeze(-1)  # (E, B)
        with torch.no_grad():
            # Double DQN: the online ensemble mean chooses a', the target ensemble scores it.
            next_actions = q_both[:, batch_size:].mean(0).argmax(-1)  # (B,)
            q_next = self.critic_target(batch.next_observations)  # (E, B, n_actions)
            index_next = next_actions.view(1, -1, 1).expand(q_next.shape[0], -1, 1)
            next_values = q_next.gather(-1, index_next).squeeze(-1).min(0).values  # (B,)
            target = td_target(batch.rewards, batch.terminals, next_values, hyper["gamma"])
        td = discrete_td_loss(q_data, target, batch.weights, cfg.td_loss)
        conservative = discrete_conservative_loss(q_values, q_data, batch.weights)
        loss = td + hyper["alpha"] * conservative
        return loss, {
            "loss": loss.detach(),
            "td_loss": td.detach(),
            "conservative_loss": conservative.detach(),
            "q_data": q_data.detach().mean(),
        }

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One gradient step; the target is copied when the step count hits the interval."""
        loss, metrics = self.loss(batch, {}, self.hyperparameters())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.copies_target(self.steps):
            hard_update(self.critic_target, self.critic)
        self.steps += 1
        return metrics

    def fused_spec(self) -> FusedSpec:
        """The update as one phase whose target step is the hard copy (see
        :func:`~offaug.algorithms.fusing.hard_copy_schedule`)."""
        return hard_copy_spec(
            ("critic", "critic_target"),
            self.critic,
            self.critic_target,
            self.optimizer,
            self.loss,
            self.hyperparameters(),
            ("loss", "td_loss", "conservative_loss", "q_data"),
            self.copies_target,
        )

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """Greedy actions: argmax of the ensemble-mean Q."""
        q_values = self.critic(to_tensor(observations, self.device))  # (E, B, n_actions)
        return q_values.mean(0).argmax(-1).cpu().numpy()

    @torch.no_grad()
    def q_values(
        self, observations: npt.NDArray[np.float32], actions: npt.NDArray[Any]
    ) -> npt.NDArray[np.float32]:
        """``min_e Q_e(s, a)`` of action indices: ``(B, obs), (B,) -> (B,)``."""
        q_values = self.critic(to_tensor(observations, self.device))  # (E, B, n_actions)
        index = index_tensor(actions, self.device)
        index = index.view(1, -1, 1).expand(q_values.shape[0], -1, 1)
        return q_values.gather(-1, index).squeeze(-1).min(0).values.cpu().numpy()

    def state_dict(self) -> dict[str, Any]:
        """Q-networks, target, optimiser and step count."""
        return {
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.steps = int(state["steps"])
