"""Implicit Q-Learning: values from expectiles of in-data Q, a policy from advantage weights.

Kostrikov, Nair and Levine 2021, "Offline Reinforcement Learning with Implicit Q-Learning"
(ICLR 2022, arXiv:2110.06169). Never queries Q at an action outside the data:

* ``V(s)`` regresses on ``min_e Q_target_e(s, a)`` of dataset actions with the expectile loss
  ``|tau - 1(u < 0)| u^2``, ``u = Q - V`` (eq. 5), an upper expectile standing in for the max;
* the critics regress on ``r + gamma * V(s')`` (eq. 6), their targets Polyak-averaged;
* the actor maximises ``exp(beta * (Q_target(s, a) - V(s))) * log pi(a|s)`` on dataset actions
  (eq. 7, advantage-weighted regression), the weight clipped at ``max_weight``.

The three losses touch disjoint parameters, so one backward pass serves them and they step together
(V's advantage for the actor is taken before this step's V update, as in the authors' code).
Locomotion settings from the paper's appendix B are the defaults: tau 0.7, beta 3, learning
rates 3e-4, 256x256 networks, a Gaussian actor with a state-independent log-std whose mean is
``tanh`` of the network, the actor's learning rate cosine-decayed to 0 over
``actor_lr_decay_steps`` (the paper's 1M; set it to the run's steps), and rewards scaled by
``1000 / (max - min)`` of the episode returns. ``q_values`` reports Q in the data's reward
units (the scale divided out), so it compares with Monte-Carlo returns.

All actions inside the trainer live in the normalised box ``[-1, 1]^d``; ``act`` returns the
Gaussian's mean in the environment's action space.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from offaug.algorithms.base import Spaces, adam, load_optimizer_state, soft_update, weighted_mean
from offaug.algorithms.batch import TorchBatch, to_tensor
from offaug.algorithms.fusing import FusedSpec, Hyper, OptimizerSpec, Phase, per_member
from offaug.algorithms.learners.losses import ensemble_td_loss, td_target
from offaug.algorithms.nn.distributions import (
    LOG_SQRT_2PI,
    ActionNormaliser,
    truncated_normal_log_prob,
)
from offaug.algorithms.nn.networks import LOG_STD_MAX, LOG_STD_MIN, MLP, CriticEnsemble
from offaug.algorithms.normalisation import ObservationNormaliser, observation_moments, reward_scale
from offaug.algorithms.runtime import choose_device
from offaug.datasets.sampler import MixtureSampler


@dataclasses.dataclass(frozen=True)
class IQLConfig:
    """IQL hyperparameters; the defaults are the paper's MuJoCo locomotion settings."""

    actor_learning_rate: float = 3e-4
    """Adam learning rate of the actor (its starting value under the cosine schedule)."""
    critic_learning_rate: float = 3e-4
    """Adam learning rate of the critics."""
    value_learning_rate: float = 3e-4
    """Adam learning rate of the value function V."""
    batch_size: int = 256
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Polyak rate of the target critics."""
    n_critics: int = 2
    """Critics in the ensemble; V and the advantage use the target ensemble's minimum."""
    expectile: float = 0.7
    """tau of the expectile loss: 0.5 is the mean (SARSA), towards 1 the max over the data."""
    beta: float = 3.0
    """Inverse temperature of the advantage weights ``exp(beta * A)``."""
    max_weight: float = 100.0
    """Upper clip of the advantage weights."""
    log_std: Literal["state_independent", "learned"] = "state_independent"
    """The actor's log-std: one learned vector for all states (the paper's), or a network head."""
    actor_lr_schedule: Literal["cosine", "constant"] = "cosine"
    """Cosine decay of the actor's learning rate to 0 over ``actor_lr_decay_steps``, or none."""
    actor_lr_decay_steps: int = 1_000_000
    """Length of the cosine schedule in gradient steps (after it the rate stays 0)."""
    reward_normalisation: Literal["return_range", "none"] = "return_range"
    """Scale rewards by ``1000 / (max - min)`` of the data's episode returns, or leave them."""
    normalise_observations: bool = True
    """Standardise observations with the training data's mean and std (+1e-3)."""
    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the actor, the critics and V."""

    def __post_init__(self) -> None:
        if not 0.0 < self.expectile < 1.0:
            raise ValueError(f"expectile must lie in (0, 1), not {self.expectile}")
        if self.actor_lr_decay_steps < 1:
            raise ValueError(f"actor_lr_decay_steps must be positive: {self.actor_lr_decay_steps}")


# ----------------------------------------------------------------------------------------------
# Pure losses. ``E`` critics, ``B`` transitions, ``A`` action dimensions.


def expectile_loss(
    difference: torch.Tensor, expectile: float | torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """``|tau - 1(u < 0)| * u^2`` of ``u = Q - V``, weighted mean over the batch: ``(B,) -> ()``."""
    expectile = per_member(expectile, difference)
    asymmetry = torch.where(difference < 0, 1.0 - expectile, expectile)
    return weighted_mean(asymmetry * difference.pow(2), weights)


def advantage_weights(
    advantage: torch.Tensor, beta: float | torch.Tensor, max_weight: float | torch.Tensor
) -> torch.Tensor:
    """``min(exp(beta * A), max_weight)``, detached: ``(B,) -> (B,)``."""
    beta, max_weight = per_member(beta, advantage), per_member(max_weight, advantage)
    return (beta * advantage.detach()).exp().clamp(max=max_weight)


def awr_actor_loss(
    log_prob: torch.Tensor, advantage_weight: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """``-exp(beta * A) * log pi(a|s)`` of dataset actions, weighted mean: ``(B,) -> ()``."""
    return weighted_mean(-advantage_weight * log_prob, weights)


def gaussian_log_prob(
    actions: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor
) -> torch.Tensor:
    """``log N(a; mean, exp(log_std))`` summed over action dimensions: ``(B, A) -> (B,)``."""
    z = (actions - mean) * (-log_std).exp()
    return (-0.5 * z.pow(2) - log_std - LOG_SQRT_2PI).sum(-1)


def cosine_rate(initial: Any, step: int | torch.Tensor, decay_steps: int) -> Any:
    """``initial * (1 + cos(pi * step / decay_steps)) / 2``, 0 from ``decay_steps`` on.

    ``step`` may be a device tensor (a graph-safe step's counter): the rate is then a tensor.
    """
    if isinstance(step, torch.Tensor):
        progress_t = step.clamp(max=decay_steps).double() / decay_steps
        return initial * (0.5 * (1.0 + torch.cos(math.pi * progress_t))).float()
    progress = min(step, decay_steps) / decay_steps
    return initial * 0.5 * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------------


class GaussianActor(nn.Module):
    """``N(tanh(MLP(s)), std)`` with a state-independent or a learned log-std (clipped)."""

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        hidden: tuple[int, ...],
        log_std: Literal["state_independent", "learned"],
    ) -> None:
        super().__init__()
        self.learned_std = log_std == "learned"
        outputs = 2 * action_dim if self.learned_std else action_dim
        self.net = MLP(observation_dim, hidden, outputs)
        self.log_std = None if self.learned_std else nn.Parameter(torch.zeros(action_dim))

    def mean_log_std(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean (inside the box) and the clipped log-std, ``(B, A)`` each."""
        out = self.net(observations)
        if self.log_std is None:
            mean, log_std = out.chunk(2, dim=-1)
        else:
            # A stacked run's (K, A) log-std meets (K, B, A) rows.
            log_std = self.log_std if self.log_std.dim() == 1 else self.log_std.unsqueeze(1)
            mean, log_std = out, log_std.expand_as(out)
        return torch.tanh(mean), log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)

    def log_prob(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``log pi(a|s)``: ``(B, obs), (B, A) -> (B,)``."""
        return gaussian_log_prob(actions, *self.mean_log_std(observations))


@dataclasses.dataclass(frozen=True)
class IQLLosses:
    """The losses of one IQL step (scalars; ``total`` carries the gradient)."""

    total: torch.Tensor
    """Sum of the three losses below, which touch disjoint parameters."""
    value: torch.Tensor
    """Expectile loss of V against the target critics."""
    critic: torch.Tensor
    """Squared TD error of the critics against ``r + gamma * V(s')``, summed over critics."""
    actor: torch.Tensor
    """Advantage-weighted negative log-likelihood of dataset actions."""
    advantage: torch.Tensor
    """Mean advantage ``Q_target - V`` over the batch."""
    q_data: torch.Tensor
    """Mean Q of the dataset actions (scaled reward units)."""


class IQL:
    """IQL trainer: Gaussian actor, ``n_critics`` critics with targets, and V."""

    name = "iql"
    fused_hyperparameters = (
        "actor_learning_rate",
        "critic_learning_rate",
        "value_learning_rate",
        "gamma",
        "tau",
        "expectile",
        "beta",
        "max_weight",
    )
    """Config fields that may differ between the members of a fused run."""

    def __init__(
        self, spaces: Spaces, config: IQLConfig | None = None, *, device: str | None = None
    ) -> None:
        if spaces.discrete:
            raise ValueError("IQL learns continuous actions only")
        self.spaces = spaces
        self.config = config or IQLConfig()
        self.device = choose_device(device)
        cfg = self.config
        obs_dim, act_dim = spaces.observation_dim, spaces.action_dim
        self.normaliser = ActionNormaliser(spaces).to(self.device)
        self.observation_normaliser = ObservationNormaliser(obs_dim).to(self.device)
        self.actor = GaussianActor(obs_dim, act_dim, cfg.hidden, cfg.log_std).to(self.device)
        self.critic = CriticEnsemble(obs_dim, act_dim, cfg.hidden, cfg.n_critics).to(self.device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.value = MLP(obs_dim, cfg.hidden, 1).to(self.device)
        self.actor_optimizer = adam(self.actor.parameters(), cfg.actor_learning_rate)
        self.critic_optimizer = adam(self.critic.parameters(), cfg.critic_learning_rate)
        self.value_optimizer = adam(self.value.parameters(), cfg.value_learning_rate)
        self._optimizers = [self.actor_optimizer, self.critic_optimizer, self.value_optimizer]
        self.reward_scale = 1.0
        self.steps = 0

    def prepare(self, sampler: MixtureSampler) -> None:
        """Take the observation moments and the reward scale of the data ``sampler`` draws."""
        if self.config.normalise_observations:
            self.observation_normaliser.set_moments(*observation_moments(sampler))
        if self.config.reward_normalisation == "return_range":
            self.reward_scale = reward_scale(sampler)

    # -- one step ------------------------------------------------------------------------------

    def hyperparameters(self) -> dict[str, float]:
        """The values of :attr:`fused_hyperparameters` and the reward scale the losses read."""
        values = {name: float(getattr(self.config, name)) for name in self.fused_hyperparameters}
        return {**values, "reward_scale": self.reward_scale}

    def losses(self, batch: TorchBatch, hyper: Hyper | None = None) -> IQLLosses:
        """The value, critic and actor losses of one batch (one backward pass serves them all)."""
        cfg = self.hyperparameters() if hyper is None else hyper
        weights = batch.weights
        obs = self.observation_normaliser(batch.observations)
        next_obs = self.observation_normaliser(batch.next_observations)
        actions = self.normaliser(batch.actions)  # (B, A) in [-1, 1]
        value = self.value(obs).squeeze(-1)  # (B,)
        with torch.no_grad():
            # V(s') apart, without a graph: in one pass with V(s) its rows would be back-propagated
            # too (as zeros).
            next_value = self.value(next_obs).squeeze(-1)
            q_target = self.critic_target(obs, actions).min(-2).values  # (B,)
            rewards = batch.rewards * per_member(cfg["reward_scale"], batch.rewards)
            target = td_target(rewards, batch.terminals, next_value, cfg["gamma"])
        advantage = q_target - value
        value_loss = expectile_loss(advantage, cfg["expectile"], weights)
        q_data = self.critic(obs, actions)  # (E, B)
        critic_loss = ensemble_td_loss(q_data, target, weights)
        advantage_weight = advantage_weights(advantage, cfg["beta"], cfg["max_weight"])
        actor_loss = awr_actor_loss(self.actor.log_prob(obs, actions), advantage_weight, weights)
        return IQLLosses(
            total=value_loss + critic_loss + actor_loss,
            value=value_loss,
            critic=critic_loss,
            actor=actor_loss,
            advantage=advantage.detach().mean(-1),
            q_data=q_data.detach().mean((-2, -1)),
        )

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One gradient step of V, the critics and the actor; then the target critics."""
        cfg = self.config
        if cfg.actor_lr_schedule == "cosine":
            rate = cosine_rate(cfg.actor_learning_rate, self.steps, cfg.actor_lr_decay_steps)
            for group in self.actor_optimizer.param_groups:
                group["lr"] = rate
        losses = self.losses(batch)
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        for optimizer in self._optimizers:
            optimizer.step()
        soft_update(self.critic_target, self.critic, cfg.tau)
        self.steps += 1
        return {
            "value_loss": losses.value.detach(),
            "critic_loss": losses.critic.detach(),
            "actor_loss": losses.actor.detach(),
            "advantage": losses.advantage,
            "q_data": losses.q_data,
        }

    def fused_spec(self) -> FusedSpec:
        """The update as one phase of all three optimisers (see :mod:`offaug.algorithms.fusing`)."""
        return FusedSpec(
            modules={
                "actor": self.actor,
                "critic": self.critic,
                "critic_target": self.critic_target,
                "value": self.value,
                "observation_normaliser": self.observation_normaliser,
                "normaliser": self.normaliser,
            },
            optimizers={
                "actor": OptimizerSpec(self.actor_optimizer, "actor", "actor_learning_rate"),
                "critic": OptimizerSpec(self.critic_optimizer, "critic", "critic_learning_rate"),
                "value": OptimizerSpec(self.value_optimizer, "value", "value_learning_rate"),
            },
            targets={"critic_target": "critic"},
            phases=(
                Phase(self._phase_loss, ("actor", "critic", "value"), targets=("critic_target",)),
            ),
            hyperparameters=self.hyperparameters(),
            metrics=("value_loss", "critic_loss", "actor_loss", "advantage", "q_data"),
            schedule=self._schedule if self.config.actor_lr_schedule == "cosine" else None,
            stacked=True,
        )

    def _phase_loss(
        self, batch: TorchBatch, noise: Mapping[str, torch.Tensor], hyper: Hyper
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        losses = self.losses(batch, hyper)
        return losses.total, {
            "value_loss": losses.value.detach(),
            "critic_loss": losses.critic.detach(),
            "actor_loss": losses.actor.detach(),
            "advantage": losses.advantage,
            "q_data": losses.q_data,
        }

    def _schedule(self, step: int | torch.Tensor, hyper: Hyper) -> dict[str, Any]:
        rate = cosine_rate(hyper["actor_learning_rate"], step, self.config.actor_lr_decay_steps)
        return {"actor_learning_rate": rate}

    # -- inference -----------------------------------------------------------------------------

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """The Gaussian's mean ``tanh(MLP(s))`` in the environment's action space."""
        obs = self.observation_normaliser(to_tensor(observations, self.device))
        mean, _ = self.actor.mean_log_std(obs)
        return self.normaliser.inverse(mean).cpu().numpy()

    @torch.no_grad()
    def policy_log_prob(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``log pi(a|s)`` of environment-space actions (``base.PolicyDensity``).

        The actor's Gaussian truncated to the normalised box (the actions an environment takes;
        the untruncated density the actor trains with differs on the box only by each state's
        log box mass) plus the box's ``log |det|``: a density over the environment's box, as
        ``log mu`` is.
        """
        mean, log_std = self.actor.mean_log_std(self.observation_normaliser(observations))
        normalised = self.normaliser(actions)
        return truncated_normal_log_prob(normalised, mean, log_std) + self.normaliser.log_abs_det

    @torch.no_grad()
    def q_values(
        self, observations: npt.NDArray[np.float32], actions: npt.NDArray[Any]
    ) -> npt.NDArray[np.float32]:
        """``min_e Q_e(s, a)`` in the data's reward units: ``(B, obs), (B, A) -> (B,)``."""
        obs = self.observation_normaliser(to_tensor(observations, self.device))
        normalised = self.normaliser(to_tensor(actions, self.device))
        q = self.critic(obs, normalised).min(0).values / self.reward_scale
        return q.cpu().numpy()

    @torch.no_grad()
    def state_values(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """``V(s)``, the expectile value net, in the data's reward units: ``(B, obs) -> (B,)``
        (``base.StateValue``)."""
        obs = self.observation_normaliser(to_tensor(observations, self.device))
        value = self.value(obs).squeeze(-1) / self.reward_scale
        return value.cpu().numpy()

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Networks, target critics, data statistics, optimisers and step count."""
        return {
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "value": self.value.state_dict(),
            "observation_normaliser": self.observation_normaliser.state_dict(),
            "reward_scale": torch.tensor(self.reward_scale, dtype=torch.float64),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "value_optimizer": self.value_optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        self.value.load_state_dict(state["value"])
        self.observation_normaliser.load_state_dict(state["observation_normaliser"])
        self.reward_scale = float(state["reward_scale"])
        load_optimizer_state(self.actor_optimizer, state["actor_optimizer"])
        load_optimizer_state(self.critic_optimizer, state["critic_optimizer"])
        load_optimizer_state(self.value_optimizer, state["value_optimizer"])
        self.steps = int(state["steps"])
