"""Soft Actor-Critic: the online learner that trains the policies behind D4RL-style datasets.

Haarnoja, Zhou, Abbeel, Levine 2018, "Soft Actor-Critic: Off-Policy Maximum Entropy Deep
Reinforcement Learning with a Stochastic Actor" (ICML), with the learned temperature of
Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications" (arXiv:1812.05905),
Algorithm 1. Continuous (Box) actions only.

One gradient step (:meth:`SAC.update`), in the paper's order:

1. critics: ``sum_e (Q_e(s, a) - y)^2`` with the soft target
   ``y = r + gamma * (1 - terminal) * (min_e Q_target_e(s', a') - alpha * log pi(a'|s'))``,
   ``a' ~ pi(.|s')``. Only terminations stop bootstrapping; a truncation (time limit) does not;
2. actor: ``alpha * log pi(a|s) - min_e Q_e(s, a)``, ``a ~ pi(.|s)`` (reparameterised), scored
   by the critics just updated;
3. temperature: ``-alpha * (log pi(a|s) + target_entropy)``, target entropy ``-|A|``;
4. Polyak averaging of the target critics.

Steps 2 and 3 share one actor sample and one backward pass; both use the temperature from
before this step (the paper's order; d3rlpy steps the temperature first, a difference of one
learning-rate step in alpha). Defaults follow d3rlpy 2.8's ``SACConfig``.

The critic, actor and temperature losses come from :mod:`offaug.algorithms.learners.losses` (CQL
shares them); online training (the replay buffer and the environment loop) is
:mod:`offaug.algorithms.online.loop`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from offaug.algorithms.base import Spaces, adam, frozen_copy, load_optimizer_state, soft_update
from offaug.algorithms.batch import TorchBatch, to_tensor
from offaug.algorithms.learners.losses import ensemble_td_loss, soft_actor_loss, temperature_loss
from offaug.algorithms.nn.distributions import ActionNormaliser
from offaug.algorithms.nn.networks import CriticEnsemble, TanhGaussianActor
from offaug.algorithms.runtime import choose_device


@dataclasses.dataclass(frozen=True)
class SACConfig:
    """SAC hyperparameters (d3rlpy 2.8 defaults) and the online loop's settings."""

    actor_learning_rate: float = 3e-4
    """Adam learning rate of the policy."""
    critic_learning_rate: float = 3e-4
    """Adam learning rate of the critics."""
    temp_learning_rate: float = 3e-4
    """Adam learning rate of ``log alpha``; 0 keeps the temperature fixed."""
    batch_size: int = 256
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Polyak rate of the target critics."""
    n_critics: int = 2
    """Critics in the ensemble; targets and the actor use their minimum."""
    initial_temperature: float = 1.0
    """Starting entropy temperature alpha."""
    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the actor and of every critic."""
    target_entropy: float | None = None
    """Entropy the temperature steers towards; None is ``-action_dim`` (the paper's choice)."""
    buffer_size: int = 1_000_000
    """Online only: transitions the replay buffer holds (oldest overwritten first)."""
    learning_starts: int = 5_000
    """Online only: environment steps taken with uniform random actions before learning."""
    train_frequency: int = 1
    """Online only: environment steps between rounds of gradient steps."""
    gradient_steps: int = 1
    """Online only: gradient steps per round."""


def soft_td_target(
    rewards: torch.Tensor,
    terminals: torch.Tensor,
    next_q: torch.Tensor,
    next_log_prob: torch.Tensor,
    temperature: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """``r + gamma * (1 - terminal) * (min_e Q'_e(s', a') - alpha * log pi(a'|s'))``: ``(B,)``.

    ``next_q`` is ``(E, B)``; the rest ``(B,)`` (``temperature`` a scalar or ``(1,)``).
    """
    soft_value = next_q.amin(dim=0) - temperature * next_log_prob
    return torch.addcmul(rewards, 1.0 - terminals, soft_value, value=gamma)


class SAC:
    """Soft Actor-Critic trainer (continuous actions)."""

    name = "sac"

    def __init__(
        self, spaces: Spaces, config: SACConfig | None = None, *, device: str | None = None
    ) -> None:
        if spaces.discrete:
            raise ValueError("sac learns continuous (Box) actions only")
        self.spaces = spaces
        self.config = config or SACConfig()
        self.device = choose_device(device)
        cfg = self.config
        self.normaliser = ActionNormaliser(spaces).to(self.device)
        self.actor = TanhGaussianActor(spaces.observation_dim, spaces.action_dim, cfg.hidden)
        self.critic = CriticEnsemble(
            spaces.observation_dim, spaces.action_dim, cfg.hidden, members=cfg.n_critics
        )
        self.actor.to(self.device)
        self.critic.to(self.device)
        self.critic_target = frozen_copy(self.critic)
        self.log_temperature = torch.nn.Parameter(
            torch.full((1,), float(np.log(cfg.initial_temperature)), device=self.device)
        )
        self.critic_optimizer = adam(self.critic.parameters(), cfg.critic_learning_rate)
        # One optimiser, two parameter groups: the actor and log alpha step together.
        self.actor_optimizer = adam(self.actor.parameters(), cfg.actor_learning_rate)
        self._actor_inputs = list(self.actor.parameters())
        if cfg.temp_learning_rate > 0:
            self.actor_optimizer.add_param_group(
                {"params": [self.log_temperature], "lr": cfg.temp_learning_rate}
            )
            self._actor_inputs.append(self.log_temperature)
        else:
            self.log_temperature.requires_grad_(False)
        self.target_entropy = (
            -float(spaces.action_dim) if cfg.target_entropy is None else cfg.target_entropy
        )
        self.steps = 0

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One gradient step of critics, actor, temperature and target critics."""
        cfg = self.config
        observations, weights = batch.observations, batch.weights
        actions = self.normaliser(batch.actions)
        temperature = self.log_temperature.detach().exp()  # (1,)

        with torch.no_grad():
            next_sample = self.actor(batch.next_observations)
            next_q = self.critic_target(batch.next_observations, next_sample.actions)  # (E, B)
            targets = soft_td_target(
                batch.rewards, batch.terminals, next_q, next_sample.log_prob, temperature, cfg.gamma
            )
        q_values = self.critic(observations, actions)  # (E, B)
        loss_critic = ensemble_td_loss(q_values, targets, weights)
        self.critic_optimizer.zero_grad(set_to_none=True)
        loss_critic.backward()
        self.critic_optimizer.step()

        sample = self.actor(observations)
        q_policy = self.critic(observations, sample.actions)  # (E, B), updated critics
        loss_actor = soft_actor_loss(q_policy, sample.log_prob, temperature, weights)
        loss_temperature = temperature_loss(
            self.log_temperature, sample.log_prob, self.target_entropy, weights
        )
        self.actor_optimizer.zero_grad(set_to_none=True)
        # Only the actor and log alpha receive gradients: the critics' weights are skipped.
        (loss_actor + loss_temperature).backward(inputs=self._actor_inputs)
        self.actor_optimizer.step()

        soft_update(self.critic_target, self.critic, cfg.tau)
        self.steps += 1
        return {
            "critic_loss": loss_critic.detach(),
            "actor_loss": loss_actor.detach(),
            "temperature_loss": loss_temperature.detach(),
            "temperature": temperature[0],
            "q_mean": q_values.detach().mean(),
        }

    @torch.no_grad()
    def policy_log_prob(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``log pi(a|s)`` of environment-space actions (``base.PolicyDensity``)."""
        return self.actor.env_log_prob(observations, actions, self.normaliser)

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Deterministic (squashed-mean) actions ``(B, act)`` in the environment's bounds."""
        obs = to_tensor(observations, self.device)
        return self.normaliser.inverse(self.actor.deterministic(obs)).cpu().numpy()

    @torch.no_grad()
    def sample_action(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Actions ``(B, act)`` sampled from the stochastic policy, in the environment's bounds."""
        obs = to_tensor(observations, self.device)
        return self.normaliser.inverse(self.actor(obs).actions).cpu().numpy()

    def state_dict(self) -> dict[str, Any]:
        """Networks, optimisers (log alpha shares the actor's), temperature and step count."""
        return {
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "log_temperature": self.log_temperature.detach().clone(),
            "actor_optimizer": self.actor_optimizer.state_dict(),  # actor and log alpha
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        with torch.no_grad():
            self.log_temperature.copy_(state["log_temperature"])
        load_optimizer_state(self.actor_optimizer, state["actor_optimizer"])
        load_optimizer_state(self.critic_optimizer, state["critic_optimizer"])
        self.steps = int(state["steps"])
