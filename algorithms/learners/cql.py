"""Conservative Q-Learning for continuous actions: SAC whose critics are pushed down off the
data and up on it.

Kumar, Zhou, Tucker and Levine 2020, "Conservative Q-Learning for Offline Reinforcement
Learning" (NeurIPS, arXiv:2006.04779): CQL(H), eq. (4), on top of SAC, with the
importance-sampled estimate of ``log sum_a exp Q(s, a)`` from the paper's implementation
details and, optionally, its Lagrange form, which tunes the penalty weight so that the gap
stays at a threshold. Discrete actions: :mod:`offaug.algorithms.learners.discrete_cql`.

Where the paper leaves a choice, this file follows d3rlpy 2.8 (``algos/qlearning/torch/
cql_impl.py``) so that results can be compared with it:

* ``log sum_a exp Q(s, a)`` is estimated from ``n`` uniform actions (log-density
  ``-act_dim * log 2`` on the normalised box), ``n`` policy actions at ``s`` and ``n`` policy
  actions at ``s'`` (all scored at ``s``), each minus its log-density, log-sum-exp'd over the
  ``3n`` samples without subtracting ``log 3n`` (as the authors' code does too);
* the penalty is ``alpha * conservative_weight * (gap - alpha_threshold)`` per critic, summed
  over critics, ``alpha = exp(log_alpha)`` clipped to ``[0, 1e6]``; the TD loss is the squared
  error summed over critics;
* the target is ``min_e Q_target(s', tanh(mean(s')))`` unless ``soft_q_backup`` (SAC's entropy
  backup) or ``max_q_backup`` (max over ``n`` policy samples) is chosen;
* the entropy temperature is tuned towards a target entropy of ``-act_dim``.

One difference in order: all four losses are built from one forward pass and stepped together,
so the actor loss scores its actions with the critics *before* this step's critic update (the
authors' code does the same; d3rlpy steps the critics first).

All actions inside the trainer live in the normalised box ``[-1, 1]^d`` (``ActionNormaliser``);
``act`` and ``q_values`` speak the environment's action space.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from offaug.algorithms.base import Spaces, adam, frozen_copy, load_optimizer_state, soft_update
from offaug.algorithms.batch import TorchBatch, to_tensor
from offaug.algorithms.fusing import Draws, Hyper, config_hyperparameters
from offaug.algorithms.learners.cql_losses import (
    ALPHA_MAX,
    alpha_loss,
    backup_values,
    conservative_gap,
    conservative_penalty,
    original_rows_gap,
)
from offaug.algorithms.learners.losses import (
    ensemble_td_loss,
    soft_actor_loss,
    soft_bc_actor_loss,
    td_target,
    temperature_loss,
)
from offaug.algorithms.nn.distributions import (
    ActionNormaliser,
    tanh_gaussian,
    tanh_gaussian_log_prob,
)
from offaug.algorithms.nn.networks import (
    CriticEnsemble,
    LearnedScalar,
    TanhGaussianActor,
    ensemble_values,
)
from offaug.algorithms.normalisation import ObservationNormaliser, observation_moments
from offaug.algorithms.runtime import choose_device
from offaug.datasets.sampler import MixtureSampler


@dataclasses.dataclass(frozen=True)
class CQLConfig:
    """Continuous CQL hyperparameters; the defaults are d3rlpy 2.8's ``CQLConfig()``."""

    actor_learning_rate: float = 1e-4
    """Adam learning rate of the policy."""
    critic_learning_rate: float = 3e-4
    """Adam learning rate of the critics."""
    temp_learning_rate: float = 1e-4
    """Adam learning rate of the log entropy temperature (0 keeps it fixed)."""
    alpha_learning_rate: float = 1e-4
    """Adam learning rate of ``log_alpha`` (used only when ``lagrange``)."""
    batch_size: int = 256
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Polyak rate of the target critics."""
    n_critics: int = 2
    """Critics in the ensemble; targets and the actor use their minimum."""
    initial_temperature: float = 1.0
    """Initial SAC entropy temperature."""
    initial_alpha: float = 1.0
    """Initial multiplier ``alpha`` of the conservative penalty (fixed unless ``lagrange``)."""
    alpha_threshold: float = 10.0
    """Target action gap tau of the Lagrange form: alpha grows while the gap is above it."""
    conservative_weight: float = 5.0
    """Constant factor of the penalty; the effective weight is ``alpha * conservative_weight``."""
    n_action_samples: int = 10
    """Actions per state for each of the three parts of the log-sum-exp estimate."""
    soft_q_backup: bool = False
    """Back up ``min Q_target(s', a') - temperature * log pi(a'|s')`` with a' sampled (SAC)."""
    max_q_backup: bool = False
    """Back up the max over ``n_action_samples`` policy actions of ``min Q_target(s', a')``."""
    lagrange: bool = True
    """Tune ``log_alpha`` by dual descent so that the gap stays at ``alpha_threshold``.

    d3rlpy's default (``alpha_learning_rate > 0``) is this Lagrange form; ``False`` is CQL(H)
    with the fixed weight ``initial_alpha * conservative_weight``, the paper's MuJoCo setting
    and d3rlpy's ``alpha_learning_rate=0.0``.
    """
    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the actor and of every critic."""
    bc_steps: int = 0
    """Gradient steps at the start in which the actor maximises the data actions'
    log-likelihood (with the entropy term) instead of ``Q``, while the critics train as usual:
    the authors' ``policy_eval_start`` and CORL's ``bc_steps``. A short run then improves on a
    clone of the data instead of on a random policy."""
    conservative_rows: Literal["all", "original"] = "all"
    """Whose actions the penalty pushes up: every row's (CQL), or the original data's only
    (the first source; COMBO, Yu et al. 2021), with the log-sum-exp still pushed down at every
    row's state. With augmented data, ``original`` lets its transitions train the critics by TD
    without counting its actions as the data's; on one source both are CQL."""
    normalise_observations: bool = False
    """Standardise observations with the training data's mean and std (taken once, before the
    first step, and kept in the checkpoint): d3rlpy's ``observation_scaler="standard"`` and
    CORL's ``normalize``. Off by default, as in d3rlpy's ``CQLConfig()``."""

    def __post_init__(self) -> None:
        if self.soft_q_backup and self.max_q_backup:
            raise ValueError("soft_q_backup and max_q_backup are mutually exclusive")
        if self.n_action_samples < 1:
            raise ValueError(f"n_action_samples must be positive, not {self.n_action_samples}")
        if self.bc_steps < 0:
            raise ValueError(f"bc_steps must be 0 or more, not {self.bc_steps}")
        if self.conservative_rows not in ("all", "original"):
            raise ValueError(
                f"conservative_rows must be 'all' or 'original', not {self.conservative_rows!r}"
            )

    @property
    def backup(self) -> Literal["mean", "soft", "max"]:
        """Which target the critics regress on."""
        if self.soft_q_backup:
            return "soft"
        if self.max_q_backup:
            return "max"
        return "mean"


@dataclasses.dataclass(frozen=True)
class CQLLosses:
    """The losses of one CQL step (scalars; ``total`` carries the gradient)."""

    total: torch.Tensor
    """Sum of the four losses below, which touch disjoint parameters."""
    critic: torch.Tensor
    """TD loss plus ``alpha`` times the conservative penalty."""
    td: torch.Tensor
    """Squared TD error summed over critics."""
    conservative: torch.Tensor
    """``alpha * conservative_weight * (gap - alpha_threshold)`` summed over critics (d3rlpy's)."""
    gap: torch.Tensor
    """Mean over critics and states of ``log sum_a exp Q(s, a) - Q(s, a_data)``."""
    actor: torch.Tensor
    """SAC policy loss."""
    temperature: torch.Tensor
    """Entropy-temperature loss."""
    alpha: torch.Tensor | None
    """Lagrange dual loss (None when ``alpha`` is fixed)."""
    q_data: torch.Tensor
    """Mean Q of the dataset actions."""


class CQL:
    """Continuous CQL trainer (SAC actor, ``n_critics`` critics in one :class:`CriticEnsemble`)."""

    name = "cql"
    fuses_on_cpu = False
    """``fuse_seeds: auto`` trains its seeds one per stage on a CPU (arithmetic-bound steps)."""
    fused_hyperparameters: tuple[str, ...] = (
        "actor_learning_rate",
        "critic_learning_rate",
        "temp_learning_rate",
        "alpha_learning_rate",
        "gamma",
        "tau",
        "conservative_weight",
        "alpha_threshold",
        "initial_temperature",
        "initial_alpha",
    )
    """Config fields that may differ between the members of a fused run."""

    def __init__(
        self, spaces: Spaces, config: CQLConfig | None = None, *, device: str | None = None
    ) -> None:
        if spaces.discrete:
            raise ValueError("CQL learns continuous actions; use DiscreteCQL for discrete ones")
        self.spaces = spaces
        self.config = config or CQLConfig()
        self.device = choose_device(device)
        cfg = self.config
        obs_dim, act_dim = spaces.observation_dim, spaces.action_dim
        self.normaliser = ActionNormaliser(spaces).to(self.device)
        self.observation_normaliser = ObservationNormaliser(obs_dim).to(self.device)
        self.actor = TanhGaussianActor(obs_dim, act_dim, cfg.hidden).to(self.device)
        self.critic = CriticEnsemble(obs_dim, act_dim, cfg.hidden, cfg.n_critics).to(self.device)
        self.critic_target = frozen_copy(self.critic)
        # Modules of their own, so that a fused run stacks and steps them as it does networks.
        self.log_temperature_module = LearnedScalar(math.log(cfg.initial_temperature)).to(
            self.device
        )
        self.log_alpha_module = LearnedScalar(
            math.log(cfg.initial_alpha), requires_grad=cfg.lagrange
        ).to(self.device)
        self.actor_optimizer = adam(self.actor.parameters(), cfg.actor_learning_rate)
        self.critic_optimizer = adam(self.critic.parameters(), cfg.critic_learning_rate)
        self.temperature_optimizer = adam(
            self.log_temperature_module.parameters(), cfg.temp_learning_rate
        )
        self.alpha_optimizer = adam(self.log_alpha_module.parameters(), cfg.alpha_learning_rate)
        self._optimizers = [self.actor_optimizer, self.critic_optimizer, self.temperature_optimizer]
        if cfg.lagrange:
            self._optimizers.append(self.alpha_optimizer)
        self.target_entropy = -float(act_dim)
        # Log-density of the uniform proposal on the normalised box [-1, 1]^act.
        self.random_log_density = -act_dim * math.log(2.0)
        self.steps = 0

    def prepare(self, sampler: MixtureSampler) -> None:
        """Take the observation mean and std of the data ``sampler`` draws from (if asked)."""
        if self.config.normalise_observations:
            self.observation_normaliser.set_moments(*observation_moments(sampler))

    @property
    def reads_sources(self) -> bool:
        """Whether the losses read each row's source (``TorchBatch.set_index``)."""
        return self.config.conservative_rows == "original"

    @property
    def log_temperature(self) -> torch.Tensor:
        """The log entropy temperature."""
        return self.log_temperature_module.value

    @property
    def log_alpha(self) -> torch.Tensor:
        """The log multiplier of the conservative penalty (trained only when ``lagrange``)."""
        return self.log_alpha_module.value

    # -- one step ------------------------------------------------------------------------------

    def hyperparameters(self) -> dict[str, Any]:
        """The values of :attr:`fused_hyperparameters` (the losses read them from here), and
        this step's :meth:`schedule`."""
        hyper: dict[str, Any] = config_hyperparameters(self.config, self.fused_hyperparameters)
        hyper.update(self.schedule(self.steps, hyper))
        return hyper

    def schedule(self, step: int | torch.Tensor, hyper: Hyper) -> dict[str, Any]:
        """``bc_phase``: 1 during the first ``bc_steps`` steps (the actor clones), else 0.

        Fused, ``hyper`` holds one value per member and so does the phase."""
        if not self.config.bc_steps:
            return {}
        gamma = hyper["gamma"]
        if isinstance(step, torch.Tensor):  # a graph-safe step's device counter
            return {"bc_phase": torch.zeros_like(gamma) + (step < self.config.bc_steps)}
        warm = float(step < self.config.bc_steps)
        return {"bc_phase": torch.full_like(gamma, warm) if torch.is_tensor(gamma) else warm}

    def draw_noise(self, batch_size: int, draws: Draws) -> dict[str, torch.Tensor]:
        """The step's random draws, in this order: the policy's Gaussian noise for ``s`` and
        ``s'`` together, ``(n + 1, 2B, act)``, then the uniform actions ``(n, B, act)``."""
        n, act_dim = self.config.n_action_samples, self.spaces.action_dim
        return {
            "policy": draws((n + 1, 2 * batch_size, act_dim)),
            "uniform": draws.uniform((n, batch_size, act_dim), -1.0, 1.0),
        }

    def losses(
        self,
        batch: TorchBatch,
        noise: Mapping[str, torch.Tensor] | None = None,
        hyper: Hyper | None = None,
    ) -> CQLLosses:
        """All losses of one step from one pass of the actor and one pass of the critics.

        ``noise`` (:meth:`draw_noise`'s) is drawn from the global generator when not given;
        ``hyper`` defaults to :meth:`hyperparameters`.
        """
        cfg = self.config
        if noise is None:
            noise = self.draw_noise(len(batch.rewards), Draws(self.device))
        hyper = self.hyperparameters() if hyper is None else hyper
        n = cfg.n_action_samples
        obs = self.observation_normaliser(batch.observations)
        next_obs = self.observation_normaliser(batch.next_observations)
        weights = batch.weights
        batch_size, act_dim = obs.shape[0], self.spaces.action_dim
        actions = self.normaliser(batch.actions)  # (B, act) in [-1, 1]
        temperature = self.log_temperature.detach().exp()
        alpha = self.log_alpha.detach().exp().clamp(0.0, ALPHA_MAX)

        # The policy at s (with gradient, for the actor) and at s' (without): each trunk once.
        mean, log_std = self.actor.mean_log_std(obs)  # (B, act) each
        with torch.no_grad():
            next_mean, next_log_std = self.actor.mean_log_std(next_obs)
        # Sample 0 of each state feeds the actor loss (at s) and the soft backup (at s');
        # samples 1..n feed the log-sum-exp. (n + 1, 2B, act) noise for s and s' together.
        sampled, log_prob = tanh_gaussian(
            torch.cat([mean, next_mean]), torch.cat([log_std, next_log_std]), noise["policy"]
        )  # (n + 1, 2B, act), (n + 1, 2B)

        with torch.no_grad():
            next_values = backup_values(
                self.config.backup,
                self.critic_target,
                next_obs,
                next_mean,
                sampled[:, batch_size:],
                log_prob[:, batch_size:],
                temperature,
            )
            target = td_target(batch.rewards, batch.terminals, next_values, hyper["gamma"])

        # Every critic input of the step in one ensemble evaluation, all scored at s:
        # the data action (1), policy actions at s and at s' (2n) and uniform actions (n).
        policy_actions = sampled[1:].detach().reshape(2 * n, batch_size, act_dim)
        critic_actions = torch.cat([actions.unsqueeze(0), policy_actions, noise["uniform"]])
        samples = critic_actions.shape[0]  # 3n + 1
        # (3n + 1, B, obs) -> ((3n + 1) * B, obs); the actions likewise.
        critic_obs = obs.unsqueeze(0).expand(samples, -1, -1).reshape(-1, obs.shape[-1])
        q_all = ensemble_values(self.critic, critic_obs, critic_actions.reshape(-1, act_dim))
        q_all = q_all.view(-1, samples, batch_size)  # (E, (3n + 1) * B) -> (E, 3n + 1, B)
        q_data = q_all[:, 0]  # (E, B)
        log_density = torch.cat(
            [
                log_prob[1:].detach().reshape(2 * n, batch_size),
                torch.full((n, batch_size), self.random_log_density, device=self.device),
            ]
        )  # (3n, B), in the order of q_all[:, 1:]
        gap = conservative_gap(q_data, q_all[:, 1:], log_density)  # (E, B)
        td = ensemble_td_loss(q_data, target, weights)
        weight, threshold = hyper["conservative_weight"], hyper["alpha_threshold"]
        gap_weights: torch.Tensor | None = weights
        if cfg.conservative_rows == "original" and batch.set_index is not None:
            gap, gap_weights = original_rows_gap(gap, q_data, weights, batch.set_index), None
        penalty = conservative_penalty(gap, gap_weights, weight, threshold)
        critic = td + alpha * penalty

        # The actor's actions, scored by critics whose weights take no gradient from it.
        q_policy = ensemble_values(self.critic, obs, sampled[0, :batch_size], frozen=True)
        policy = soft_actor_loss(q_policy, log_prob[0, :batch_size], temperature, weights)
        if cfg.bc_steps:
            # A blend rather than a branch, so that a fused run (a tensor per member) and a
            # single one (a float) take the same path; the warm start is 1, then 0.
            warm = hyper["bc_phase"]
            data_log_prob = tanh_gaussian_log_prob(actions, mean, log_std)
            cloning = soft_bc_actor_loss(
                data_log_prob, log_prob[0, :batch_size], temperature, weights
            )
            policy = warm * cloning + (1.0 - warm) * policy
        temp = temperature_loss(
            self.log_temperature, log_prob[0, :batch_size], self.target_entropy, weights
        )
        dual = None
        total = critic + policy + temp
        if cfg.lagrange:
            dual = alpha_loss(self.log_alpha, gap, gap_weights, weight, threshold)
            total = total + dual
        return CQLLosses(
            total=total,
            critic=critic,
            td=td,
            conservative=alpha * penalty,
            gap=gap.detach().mean(),
            actor=policy,
            temperature=temp,
            alpha=dual,
            q_data=q_data.detach().mean(),
        )

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One gradient step of critics, actor, temperature and (Lagrange) alpha."""
        noise = self.draw_noise(len(batch.rewards), Draws(self.device))
        total, metrics = self.phase_loss(batch, noise, self.hyperparameters())
        # The losses touch disjoint parameters, so one backward pass serves all of them.
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
        total.backward()
        for optimizer in self._optimizers:
            optimizer.step()
        soft_update(self.critic_target, self.critic, self.config.tau)
        self.steps += 1
        return metrics

    def phase_loss(
        self, batch: TorchBatch, noise: Mapping[str, torch.Tensor], hyper: Hyper
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step's summed loss and its metrics (the temperature and alpha it started from)."""
        losses = self.losses(batch, noise, hyper)
        metrics = {
            "critic_loss": losses.critic.detach(),
            "td_loss": losses.td.detach(),
            "conservative_loss": losses.conservative.detach(),
            "gap": losses.gap,
            "actor_loss": losses.actor.detach(),
            "temperature_loss": losses.temperature.detach(),
            "temperature": self.log_temperature.detach().exp(),
            "alpha": self.log_alpha.detach().exp().clamp(0.0, ALPHA_MAX),
            "q_data": losses.q_data,
        }
        if losses.alpha is not None:
            metrics["alpha_loss"] = losses.alpha.detach()
        return losses.total, metrics

    # -- inference -----------------------------------------------------------------------------

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """Deterministic actions ``tanh(mean)`` in the environment's action space."""
        obs = self.observation_normaliser(to_tensor(observations, self.device))
        return self.normaliser.inverse(self.actor.deterministic(obs)).cpu().numpy()

    @torch.no_grad()
    def policy_log_prob(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``log pi(a|s)`` of environment-space actions (``base.PolicyDensity``)."""
        obs = self.observation_normaliser(observations)
        return self.actor.env_log_prob(obs, actions, self.normaliser)

    @torch.no_grad()
    def q_values(
        self, observations: npt.NDArray[np.float32], actions: npt.NDArray[Any]
    ) -> npt.NDArray[np.float32]:
        """``min_e Q_e(s, a)`` of environment-space actions: ``(B, obs), (B, act) -> (B,)``."""
        obs = self.observation_normaliser(to_tensor(observations, self.device))
        normalised = self.normaliser(to_tensor(actions, self.device))
        return ensemble_values(self.critic, obs, normalised).min(0).values.cpu().numpy()

    @torch.no_grad()
    def state_values(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """``V(s) = min_e Q_e(s, pi(s))`` at the actor's deterministic action ``tanh(mean)``:
        ``(B, obs) -> (B,)`` (``base.StateValue``)."""
        obs = self.observation_normaliser(to_tensor(observations, self.device))
        actions = self.actor.deterministic(obs)
        return ensemble_values(self.critic, obs, actions).min(0).values.cpu().numpy()

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Networks, target critics, observation moments, log temperature and alpha, optimisers
        and step count."""
        return {
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "observation_normaliser": self.observation_normaliser.state_dict(),
            "log_temperature": self.log_temperature.detach().clone(),
            "log_alpha": self.log_alpha.detach().clone(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "temperature_optimizer": self.temperature_optimizer.state_dict(),
            "alpha_optimizer": self.alpha_optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        # A checkpoint from before observation normalisation existed trained on raw ones.
        identity = ObservationNormaliser(self.spaces.observation_dim).state_dict()
        self.observation_normaliser.load_state_dict(state.get("observation_normaliser", identity))
        with torch.no_grad():
            self.log_temperature.copy_(state["log_temperature"])
            self.log_alpha.copy_(state["log_alpha"])
        load_optimizer_state(self.actor_optimizer, state["actor_optimizer"])
        load_optimizer_state(self.critic_optimizer, state["critic_optimizer"])
        load_optimizer_state(self.temperature_optimizer, state["temperature_optimizer"])
        load_optimizer_state(self.alpha_optimizer, state["alpha_optimizer"])
        self.steps = int(state["steps"])
