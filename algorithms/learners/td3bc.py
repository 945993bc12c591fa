"""TD3+BC: TD3 whose actor also regresses on the dataset's actions.

Fujimoto and Gu 2021, "A Minimalist Approach to Offline Reinforcement Learning" (NeurIPS,
arXiv:2106.06860). The actor maximises ``lambda * Q_1(s, pi(s)) - (pi(s) - a)^2`` with
``lambda = alpha / mean |Q_1(s, pi(s))|`` (eq. 3: the normaliser is a detached batch
statistic, so alpha trades the two terms whatever the scale of the rewards); the critics are
TD3's (twin critics, clipped double-Q target with target policy smoothing, the actor and the
targets updated every ``policy_freq`` critic steps); observations are standardised with the
training data's mean and std (section 5), which :meth:`TD3BC.prepare` takes from the sampler
and the checkpoint keeps, so :meth:`TD3BC.act` applies them to raw observations.

Defaults are the paper's (and d3rlpy 2.8's ``TD3PlusBCConfig()``). As in the authors' code the
actor's Q term is the first critic's, and the squared error is the mean over action dimensions.

All actions inside the trainer live in the normalised box ``[-1, 1]^d``; ``act`` and
``q_values`` speak the environment's observation and action spaces. :mod:`offaug.algorithms.
rebrac` builds on this trainer.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from offaug.algorithms.base import Spaces, adam, load_optimizer_state, soft_update, weighted_mean
from offaug.algorithms.batch import TorchBatch, to_tensor
from offaug.algorithms.fusing import FusedSpec, Hyper, OptimizerSpec, Phase, Randn, per_member
from offaug.algorithms.learners.losses import ensemble_td_loss, td_target
from offaug.algorithms.nn.distributions import ActionNormaliser
from offaug.algorithms.nn.networks import CriticEnsemble, DeterministicActor
from offaug.algorithms.normalisation import ObservationNormaliser, observation_moments
from offaug.algorithms.runtime import choose_device
from offaug.datasets.sampler import MixtureSampler


@dataclasses.dataclass(frozen=True)
class TD3BCConfig:
    """TD3+BC hyperparameters; the defaults are the paper's (and d3rlpy 2.8's)."""

    actor_learning_rate: float = 3e-4
    """Adam learning rate of the actor."""
    critic_learning_rate: float = 3e-4
    """Adam learning rate of the critics."""
    batch_size: int = 256
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Polyak rate of the target actor and critics (applied on actor steps)."""
    n_critics: int = 2
    """Critics in the ensemble; the target takes their minimum."""
    policy_noise: float = 0.2
    """Std of the Gaussian noise on the target action (target policy smoothing)."""
    noise_clip: float = 0.5
    """The smoothing noise is clipped to ``[-noise_clip, noise_clip]``."""
    policy_freq: int = 2
    """Critic steps per actor step (the actor and targets update on every ``policy_freq``-th)."""
    alpha: float = 2.5
    """Weight of the normalised Q term against the behaviour-cloning term."""
    normalise_observations: bool = True
    """Standardise observations with the training data's mean and std (+1e-3)."""
    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the actor and of every critic."""

    def __post_init__(self) -> None:
        if self.policy_freq < 1:
            raise ValueError(f"policy_freq must be positive, not {self.policy_freq}")


class TwinDelayedConfig(Protocol):
    """The fields :class:`TD3BC`'s update reads (TD3BCConfig and ReBRACConfig have them)."""

    @property
    def actor_learning_rate(self) -> float: ...
    @property
    def critic_learning_rate(self) -> float: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def gamma(self) -> float: ...
    @property
    def tau(self) -> float: ...
    @property
    def n_critics(self) -> int: ...
    @property
    def policy_noise(self) -> float: ...
    @property
    def noise_clip(self) -> float: ...
    @property
    def policy_freq(self) -> int: ...
    @property
    def normalise_observations(self) -> bool: ...
    @property
    def hidden(self) -> tuple[int, ...]: ...


# ----------------------------------------------------------------------------------------------
# Pure losses. ``E`` critics, ``B`` transitions, ``A`` action dimensions.


def smoothed_actions(
    actions: torch.Tensor, noise: torch.Tensor, sigma: float, clip: float
) -> torch.Tensor:
    """TD3's target policy smoothing: ``clip(a + clip(sigma * noise, -c, c), -1, 1)``."""
    sigma, clip = per_member(sigma, noise), per_member(clip, noise)
    return (actions + (sigma * noise).clamp(-clip, clip)).clamp(-1.0, 1.0)


def q_normaliser(q_policy: torch.Tensor) -> torch.Tensor:
    """``1 / mean |Q(s, pi(s))|`` over the batch, detached: ``(B,) -> ()``.

    Unweighted: it measures the critic's scale, so per-sample weights scale both terms of the
    actor's loss alike.
    """
    return 1.0 / q_policy.detach().abs().mean(-1).clamp_min(1e-6)


def td3bc_actor_loss(
    q_policy: torch.Tensor,
    policy_actions: torch.Tensor,
    actions: torch.Tensor,
    alpha: float,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (3): ``-alpha * Q / mean|Q| + mean_d (pi(s) - a)^2``, weighted mean over the batch.

    ``q_policy`` ``(B,)`` is the first critic at ``(s, pi(s))``; actions ``(B, A)``. Returns the
    loss and its behaviour-cloning part.
    """
    behaviour = weighted_mean((policy_actions - actions).pow(2).mean(-1), weights)
    lam = alpha * q_normaliser(q_policy)
    return -lam * weighted_mean(q_policy, weights) + behaviour, behaviour


# ----------------------------------------------------------------------------------------------


class TD3BC:
    """TD3+BC trainer: deterministic actor, ``n_critics`` critics in one :class:`CriticEnsemble`."""

    name = "td3bc"
    uses_next_actions = False
    """Whether batches must carry ``next_actions`` (``MixtureSampler(next_actions=True)``)."""
    stacks_members = True
    """Whether a fused run may run the losses on stacked parameters (``FusedSpec.stacked``)."""
    fused_hyperparameters: tuple[str, ...] = (
        "actor_learning_rate",
        "critic_learning_rate",
        "gamma",
        "tau",
        "policy_noise",
        "noise_clip",
        "alpha",
    )
    """Config fields that may differ between the members of a fused run."""

    def __init__(
        self, spaces: Spaces, config: TD3BCConfig | None = None, *, device: str | None = None
    ) -> None:
        config = config or TD3BCConfig()
        self.alpha = config.alpha
        self._setup(spaces, config, device)

    def _setup(self, spaces: Spaces, config: TwinDelayedConfig, device: str | None) -> None:
        if spaces.discrete:
            raise ValueError(f"{self.name} learns continuous actions only")
        self.spaces = spaces
        self.config: TwinDelayedConfig = config
        self.device = choose_device(device)
        self.normaliser = ActionNormaliser(spaces).to(self.device)
        self.observation_normaliser = ObservationNormaliser(spaces.observation_dim).to(self.device)
        self.actor = self._make_actor().to(self.device)
        self.actor_target = copy.deepcopy(self.actor).requires_grad_(False)
        self.critic = self._make_critic().to(self.device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.actor_optimizer = adam(self.actor.parameters(), config.actor_learning_rate)
        self.critic_optimizer = adam(self.critic.parameters(), config.critic_learning_rate)
        # The actor's metrics of its latest step, reported on the critic-only steps between.
        zero = torch.zeros((), device=self.device)
        self._actor_metrics: dict[str, torch.Tensor] = {"actor_loss": zero, "bc_loss": zero}
        self.steps = 0

    def _make_actor(self) -> DeterministicActor:
        return DeterministicActor(
            self.spaces.observation_dim, self.spaces.action_dim, self.config.hidden
        )

    def _make_critic(self) -> CriticEnsemble:
        cfg = self.config
        return CriticEnsemble(
            self.spaces.observation_dim, self.spaces.action_dim, cfg.hidden, cfg.n_critics
        )

    def prepare(self, sampler: MixtureSampler) -> None:
        """Take the observation mean and std of the data ``sampler`` draws from."""
        if self.config.normalise_observations:
            self.observation_normaliser.set_moments(*observation_moments(sampler))

    # -- one step ------------------------------------------------------------------------------

    def hyperparameters(self) -> dict[str, float]:
        """The values of :attr:`fused_hyperparameters` that the losses read."""
        return {name: float(getattr(self.config, name)) for name in self.fused_hyperparameters}

    def draw_noise(self, batch_size: int, randn: Randn) -> dict[str, torch.Tensor]:
        """The step's random draws: the target policy smoothing noise ``(B, A)``."""
        return {"target": randn((batch_size, self.spaces.action_dim))}

    def _next_values(
        self, next_obs: torch.Tensor, next_actions: torch.Tensor, batch: TorchBatch, hyper: Hyper
    ) -> torch.Tensor:
        """``min_e Q_target_e(s', a')`` of the smoothed target actions: ``(B,)``."""
        return self.critic_target(next_obs, next_actions).min(-2).values

    def _actor_losses(
        self,
        obs: torch.Tensor,
        policy_actions: torch.Tensor,
        actions: torch.Tensor,
        weights: torch.Tensor,
        hyper: Hyper,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's loss and its behaviour-cloning part, scored by the first critic."""
        q_policy = self.critic.member(0, obs, policy_actions)  # (B,)
        return td3bc_actor_loss(q_policy, policy_actions, actions, hyper["alpha"], weights)

    def critic_loss(
        self, batch: TorchBatch, noise: Mapping[str, torch.Tensor], hyper: Hyper
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The critics' TD loss against the clipped double-Q target of smoothed target actions."""
        obs = self.observation_normaliser(batch.observations)
        next_obs = self.observation_normaliser(batch.next_observations)
        actions = self.normaliser(batch.actions)  # (B, A) in [-1, 1]
        with torch.no_grad():
            target_actions = self.actor_target(next_obs)
            next_actions = smoothed_actions(
                target_actions, noise["target"], hyper["policy_noise"], hyper["noise_clip"]
            )
            next_values = self._next_values(next_obs, next_actions, batch, hyper)
            target = td_target(batch.rewards, batch.terminals, next_values, hyper["gamma"])
        q_data = self.critic(obs, actions)  # (E, B)
        loss = ensemble_td_loss(q_data, target, batch.weights)
        return loss, {"critic_loss": loss.detach(), "q_data": q_data.detach().mean((-2, -1))}

    def actor_loss(
        self, batch: TorchBatch, noise: Mapping[str, torch.Tensor], hyper: Hyper
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor's loss (the critics' parameters must take no gradient from it)."""
        obs = self.observation_normaliser(batch.observations)
        actions = self.normaliser(batch.actions)
        policy_actions = self.actor(obs)
        loss, bc_loss = self._actor_losses(obs, policy_actions, actions, batch.weights, hyper)
        return loss, {"actor_loss": loss.detach(), "bc_loss": bc_loss.detach()}

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One critic step; on every ``policy_freq``-th step also an actor and target step."""
        cfg = self.config
        hyper = self.hyperparameters()
        noise = self.draw_noise(len(batch.rewards), self._randn)
        critic_loss, critic_metrics = self.critic_loss(batch, noise, hyper)
        self.critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_optimizer.step()

        if self.steps % cfg.policy_freq == 0:
            # The critics score the actor's actions without recording gradients for their own
            # weights: the graph is built while they do not require grad.
            self.critic.requires_grad_(False)
            actor_loss, self._actor_metrics = self.actor_loss(batch, noise, hyper)
            self.critic.requires_grad_(True)
            self.actor_optimizer.zero_grad(set_to_none=True)
            actor_loss.backward()
            self.actor_optimizer.step()
            soft_update(self.critic_target, self.critic, cfg.tau)
            soft_update(self.actor_target, self.actor, cfg.tau)
        self.steps += 1
        return {
            "critic_loss": critic_metrics["critic_loss"],
            **self._actor_metrics,
            "q_data": critic_metrics["q_data"],
        }

    def _randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, device=self.device)

    def fused_spec(self) -> FusedSpec:
        """The update as a critic phase and an actor phase (see :mod:`offaug.algorithms.fusing`)."""
        return FusedSpec(
            modules={
                "actor": self.actor,
                "actor_target": self.actor_target,
                "critic": self.critic,
                "critic_target": self.critic_target,
                "observation_normaliser": self.observation_normaliser,
                "normaliser": self.normaliser,
            },
            optimizers={
                "critic": OptimizerSpec(self.critic_optimizer, "critic", "critic_learning_rate"),
                "actor": OptimizerSpec(self.actor_optimizer, "actor", "actor_learning_rate"),
            },
            targets={"critic_target": "critic", "actor_target": "actor"},
            phases=(
                Phase(self.critic_loss, ("critic",)),
                Phase(
                    self.actor_loss,
                    ("actor",),
                    every=self.config.policy_freq,
                    targets=("critic_target", "actor_target"),
                ),
            ),
            hyperparameters=self.hyperparameters(),
            metrics=("critic_loss", "actor_loss", "bc_loss", "q_data"),
            noise=self.draw_noise,
            carried=self._actor_metrics,
            restore=self._restore_actor_metrics,
            stacked=self.stacks_members,
        )

    def _restore_actor_metrics(self, metrics: Mapping[str, torch.Tensor]) -> None:
        self._actor_metrics = {name: metrics[name].to(self.device) for name in self._actor_metrics}

    # -- inference -----------------------------------------------------------------------------

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """The actor's actions in the environment's action space (raw observations in)."""
        obs = self.observation_normaliser(to_tensor(observations, self.device))
        return self.normaliser.inverse(self.actor(obs)).cpu().numpy()

    @torch.no_grad()
    def q_values(
        self, observations: npt.NDArray[np.float32], actions: npt.NDArray[Any]
    ) -> npt.NDArray[np.float32]:
        """``min_e Q_e(s, a)`` of environment-space actions: ``(B, obs), (B, A) -> (B,)``."""
        obs = self.observation_normaliser(to_tensor(observations, self.device))
        normalised = self.normaliser(to_tensor(actions, self.device))
        return self.critic(obs, normalised).min(0).values.cpu().numpy()

    @torch.no_grad()
    def state_values(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """``V(s) = min_e Q_e(s, pi(s))`` at the actor's own action: ``(B, obs) -> (B,)``
        (``base.StateValue``)."""
        obs = self.observation_normaliser(to_tensor(observations, self.device))
        return self.critic(obs, self.actor(obs)).min(0).values.cpu().numpy()

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Networks, targets, observation moments, optimisers, step count, last actor metrics."""
        return {
            "actor": self.actor.state_dict(),
            "actor_target": self.actor_target.state_dict(),
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "observation_normaliser": self.observation_normaliser.state_dict(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "actor_metrics": {k: v.clone() for k, v in self._actor_metrics.items()},
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.actor.load_state_dict(state["actor"])
        self.actor_target.load_state_dict(state["actor_target"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        self.observation_normaliser.load_state_dict(state["observation_normaliser"])
        load_optimizer_state(self.actor_optimizer, state["actor_optimizer"])
        load_optimizer_state(self.critic_optimizer, state["critic_optimizer"])
        self._actor_metrics = {
            k: v.clone().to(self.device) for k, v in state["actor_metrics"].items()
        }
        self.steps = int(state["steps"])
