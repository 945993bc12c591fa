"""Batch-Constrained deep Q-learning (BCQ) for discrete actions.

Fujimoto, Conti, Ghavamzadeh, Pineau 2019, "Benchmarking Batch Deep Reinforcement Learning
Algorithms" (arXiv:1910.01708), section 4. An imitation network G(a|s) allows only actions
whose probability relative to the most likely one exceeds ``action_flexibility``; Double-DQN
picks the next action among the allowed ones. Continuous actions:
:mod:`offaug.algorithms.learners.bcq`.

Hyperparameter defaults follow d3rlpy 2.8's ``DiscreteBCQConfig``. Every loss term (TD,
imitation, logit penalty) is weighted per sample by ``batch.weights``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
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
from offaug.algorithms.learners.bcq import QReduction, reduce_ensemble
from offaug.algorithms.learners.losses import td_target
from offaug.algorithms.nn.networks import MLP, EnsembleLinear, EnsembleMLP
from offaug.algorithms.runtime import choose_device


@dataclasses.dataclass(frozen=True)
class DiscreteBCQConfig:
    """Discrete BCQ hyperparameters (defaults: d3rlpy 2.8 ``DiscreteBCQConfig``)."""

    hidden: tuple[int, ...] = (256, 256)
    """Hidden widths of the Q network (and of the imitation network when not shared)."""
    share_encoder: bool = True
    """The imitation head reads the first critic's hidden features (d3rlpy's default)."""
    learning_rate: float = 6.25e-5
    """Adam learning rate of the Q and imitation networks (one optimiser)."""
    batch_size: int = 32
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    n_critics: int = 1
    """Q networks in the ensemble; the target takes their minimum."""
    action_flexibility: float = 0.3
    """tau: an action is allowed when ``G(a|s) / max_a' G(a'|s)`` exceeds it."""
    beta: float = 0.5
    """Weight of the imitation logits' L2 penalty ``mean(logits ** 2)``."""
    target_update_interval: int = 8000
    """Gradient steps between hard copies of the Q network into its target."""

    def __post_init__(self) -> None:
        if not self.hidden:
            raise ValueError("discrete BCQ needs at least one hidden layer")
        if self.n_critics < 1 or self.target_update_interval < 1:
            raise ValueError("n_critics and target_update_interval must be >= 1")


def allowed_actions(imitation_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """``G(a|s) / max_a' G(a'|s) > threshold`` as a mask: ``(B, A) -> (B, A)`` bool.

    The most likely action always passes (its ratio is 1), so no row is empty for
    ``threshold < 1``.
    """
    log_probs = F.log_softmax(imitation_logits, dim=-1)
    relative = log_probs - log_probs.amax(dim=-1, keepdim=True)
    return relative > math.log(threshold)


def constrained_greedy(q_values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``argmax_a Q(s, a)`` over the allowed actions: ``(B, A), (B, A) bool -> (B,)`` int64."""
    return q_values.masked_fill(~allowed, -math.inf).argmax(dim=-1)


@dataclasses.dataclass(frozen=True)
class DiscreteBCQLoss:
    """The discrete BCQ objective and its terms (each a weighted batch mean)."""

    total: torch.Tensor
    td: torch.Tensor
    imitation: torch.Tensor
    regularisation: torch.Tensor


def discrete_bcq_loss(
    q_taken: torch.Tensor,
    targets: torch.Tensor,
    imitation_logits: torch.Tensor,
    actions: torch.Tensor,
    beta: float,
    weights: torch.Tensor | None,
) -> DiscreteBCQLoss:
    """Huber TD error (summed over critics) + NLL of dataset actions + ``beta * mean(logits^2)``.

    Shapes: ``q_taken (E, B)`` = Q_e(s, a_data), ``targets (B,)``, ``imitation_logits (B, A)``,
    ``actions (B,)`` int64.
    """
    td = F.smooth_l1_loss(q_taken, targets.expand_as(q_taken), reduction="none").sum(0)  # (B,)
    nll = F.cross_entropy(imitation_logits, actions, reduction="none")  # (B,)
    penalty = imitation_logits.pow(2).mean(-1)  # (B,)
    return DiscreteBCQLoss(
        total=weighted_mean(td + nll + beta * penalty, weights),
        td=weighted_mean(td, weights),
        imitation=weighted_mean(nll, weights),
        regularisation=weighted_mean(penalty, weights),
    )


class DiscreteBCQNetwork(nn.Module):
    """Q_e(s, .) for ``E`` critics and imitation logits G(.|s), with an optional shared torso.

    ``(B, obs) -> q (E, B, A), logits (B, A)``. With ``share_encoder`` the imitation head reads
    the hidden features of the first critic (d3rlpy's ``share_encoder``).
    """

    def __init__(
        self,
        observation_dim: int,
        n_actions: int,
        hidden: Sequence[int],
        members: int,
        share_encoder: bool,
    ) -> None:
        super().__init__()
        *inner, width = hidden
        self.torso = EnsembleMLP(members, observation_dim, inner, width)
        self.q_head = EnsembleLinear(members, width, n_actions)
        self.imitator: nn.Module = (
            nn.Linear(width, n_actions)
            if share_encoder
            else MLP(observation_dim, hidden, n_actions)
        )
        self.share_encoder = share_encoder

    def forward(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = F.relu(self.torso(observations))  # (E, B, H)
        q_values = self.q_head(features)  # (E, B, A)
        source = features[0] if self.share_encoder else observations
        return q_values, self.imitator(source)

    def q_only(self, observations: torch.Tensor) -> torch.Tensor:
        """``(B, obs) -> (E, B, A)`` without the imitation head."""
        q_values: torch.Tensor = self.q_head(F.relu(self.torso(observations)))
        return q_values


class DiscreteBCQ:
    """Discrete BCQ trainer: Q ensemble + imitation network, one optimiser, hard target copies."""

    name = "discrete_bcq"
    fused_hyperparameters: tuple[str, ...] = ("learning_rate", "gamma", "beta")
    """Config fields that may differ between the members of a fused run (the allowed-action
    threshold ``action_flexibility`` is one value for all)."""

    def __init__(
        self,
        spaces: Spaces,
        config: DiscreteBCQConfig | None = None,
        *,
        device: str | None = None,
    ) -> None:
        if not spaces.discrete:
            raise ValueError("DiscreteBCQ learns discrete actions; use BCQ for continuous ones")
        self.spaces = spaces
        self.config = config or DiscreteBCQConfig()
        self.device = choose_device(device)
        cfg = self.config
        self.network = DiscreteBCQNetwork(
            spaces.observation_dim, spaces.action_dim, cfg.hidden, cfg.n_critics, cfg.share_encoder
        ).to(self.device)
        self.target = frozen_copy(self.network)
        self.optimizer = adam(self.network.parameters(), cfg.learning_rate)
        self.steps = 0

    def _greedy(self, q_values: torch.Tensor, imitation_logits: torch.Tensor) -> torch.Tensor:
        """Constrained greedy action of the ensemble-mean Q: ``(E, B, A), (B, A) -> (B,)``."""
        allowed = allowed_actions(imitation_logits, self.config.action_flexibility)
        return constrained_greedy(q_values.mean(0), allowed)

    def hyperparameters(self) -> dict[str, float]:
        """The values of :attr:`fused_hyperparameters` (the loss reads them from here)."""
        return config_hyperparameters(self.config, self.fused_hyperparameters)

    def copies_target(self, step: int) -> bool:
        """Whether step ``step`` (counted from 0) ends with a hard copy into the target."""
        return (step + 1) % self.config.target_update_interval == 0

    def loss(
        self, batch: TorchBatch, noise: Mapping[str, torch.Tensor], hyper: Hyper
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step's TD + imitation loss and its metrics (no noise)."""
        with torch.no_grad():
            # Double DQN: the online networks choose among allowed actions, the target scores.
            next_q, next_logits = self.network(batch.next_observations)
            next_actions = self._greedy(next_q, next_logits)  # (B,)
            target_q = self.target.q_only(batch.next_observations)  # (E, B, A)
            index = next_actions.view(1, -1, 1).expand(target_q.shape[0], -1, 1)
            next_values = target_q.gather(-1, index).squeeze(-1).amin(0)  # (E, B) -> (B,)
            targets = td_target(batch.rewards, batch.terminals, next_values, hyper["gamma"])
        q_values, logits = self.network(batch.observations)
        taken = batch.actions.view(1, -1, 1).expand(q_values.shape[0], -1, 1)
        q_taken = q_values.gather(-1, taken).squeeze(-1)  # (E, B)
        loss = discrete_bcq_loss(
            q_taken, targets, logits, batch.actions, hyper["beta"], batch.weights
        )
        return loss.total, {
            "loss": loss.total.detach(),
            "td_loss": loss.td.detach(),
            "imitation_loss": loss.imitation.detach(),
            "logit_penalty": loss.regularisation.detach(),
            "q_mean": q_taken.detach().mean(),
        }

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One gradient step on TD + imitation losses; hard target copy every interval."""
        loss, metrics = self.loss(batch, {}, self.hyperparameters())
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        self.optimizer.step()
        if self.copies_target(self.steps):
            hard_update(self.target, self.network)
        self.steps += 1
        return metrics

    def fused_spec(self) -> FusedSpec:
        """The update as one phase whose target step is the hard copy (see
        :func:`~offaug.algorithms.fusing.hard_copy_schedule`)."""
        return hard_copy_spec(
            ("network", "target"),
            self.network,
            self.target,
            self.optimizer,
            self.loss,
            self.hyperparameters(),
            ("loss", "td_loss", "imitation_loss", "logit_penalty", "q_mean"),
            self.copies_target,
        )

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
        """argmax of the ensemble-mean Q over the actions the imitation network allows."""
        obs = to_tensor(observations, self.device).reshape(-1, self.spaces.observation_dim)
        q_values, logits = self.network(obs)
        return self._greedy(q_values, logits).cpu().numpy()

    @torch.no_grad()
    def allowed(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.bool_]:
        """Which actions pass the imitation threshold: ``(B, obs) -> (B, A)`` bool."""
        obs = to_tensor(observations, self.device).reshape(-1, self.spaces.observation_dim)
        _, logits = self.network(obs)
        mask = allowed_actions(logits, self.config.action_flexibility)
        return mask.cpu().numpy()

    @torch.no_grad()
    def q_values(
        self,
        observations: npt.NDArray[np.float32],
        actions: npt.NDArray[np.int64],
        reduction: QReduction = "first",
    ) -> npt.NDArray[np.float32]:
        """Q(s, a) of action indices: ``(B, obs), (B,) -> (B,)``."""
        obs = to_tensor(observations, self.device).reshape(-1, self.spaces.observation_dim)
        index = index_tensor(actions, self.device)
        q_all = self.network.q_only(obs)  # (E, B, A)
        taken = q_all.gather(-1, index.view(1, -1, 1).expand(q_all.shape[0], -1, 1)).squeeze(-1)
        return reduce_ensemble(taken, reduction).cpu().numpy()

    def state_dict(self) -> dict[str, Any]:
        """Network, target, optimiser and step count."""
        return {
            "network": self.network.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.network.load_state_dict(state["network"])
        self.target.load_state_dict(state["target"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.steps = int(state["steps"])
