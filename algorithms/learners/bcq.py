"""Batch-Constrained deep Q-learning (BCQ) for continuous actions.

Fujimoto, Meger, Precup 2019, "Off-Policy Deep Reinforcement Learning without Exploration"
(ICML; arXiv:1812.02900), Algorithm 1. A conditional VAE G(a|s) models the dataset's actions; a
perturbation network xi(s, a) moves a decoded action by at most ``action_flexibility`` (Phi);
twin critics are trained towards a soft clipped double-Q target taken over
``n_action_samples`` perturbed candidates of the next state, and the policy picks the best of
as many candidates by Q_1. Discrete actions: :mod:`offaug.algorithms.learners.discrete_bcq`.

Hyperparameter defaults follow d3rlpy 2.8's ``BCQConfig``; the network sizes follow the paper
(400-300 actor and critics, 750-750 VAE), because d3rlpy 2.8's default encoder is 256-256 for
every network. Actions are learned in the normalised box ``[-1, 1]^d``
(:class:`ActionNormaliser`). Every loss term is weighted per sample by ``batch.weights``
(:func:`weighted_mean`), so importance-weighted augmented data weights the VAE, critic and
actor terms alike.

Training noise (VAE reparameterisation, candidate latents) is :meth:`BCQ.draw_noise`'s, from
torch's global generator, which the training loop seeds and checkpoints; ``act`` draws its
candidates from a generator the trainer owns, so evaluation repeats exactly from a checkpoint.
The losses of the three steps are pure functions of a batch, that noise and the
hyperparameters, so K seeds also train as one batched network (:mod:`offaug.algorithms.
bcq_fused`).

Scoring the ``n * B`` candidates is most of a step. It runs in
:func:`~offaug.algorithms.nn.kernels.tiled_mlp` on the same parameters as the modules (a test
checks the two agree): each state's share of a first layer is computed once, not ``n`` times,
and a single run's activations go to buffers reused between steps.

Where this differs from d3rlpy 2.8: the decoder ends in tanh, as in the paper (d3rlpy's
``with_squash`` flag is inverted, so its decoder is unbounded); ``update_actor_interval`` is
honoured (d3rlpy's BCQ ignores it); the actor step computes no critic weight gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from offaug.algorithms.base import (
    Spaces,
    adam,
    frozen_copy,
    load_optimizer_state,
    soft_update,
    weighted_mean,
)
from offaug.algorithms.batch import TorchBatch, to_tensor
from offaug.algorithms.fusing import Draws, Hyper, config_hyperparameters
from offaug.algorithms.learners.losses import ensemble_td_loss, td_target
from offaug.algorithms.nn.distributions import ActionNormaliser
from offaug.algorithms.nn.kernels import Workspace, tiled_mlp
from offaug.algorithms.nn.networks import (
    VAE,
    CriticEnsemble,
    DeterministicActor,
    ensemble_affines,
    mlp_affines,
)
from offaug.algorithms.runtime import choose_device

QReduction = Literal["first", "min", "mean"]
"""How ``q_values`` combines an ensemble: the first critic (the one BCQ acts on), min or mean."""

# Clip of the VAE's prior samples, N(0, 1) clipped to [-0.5, 0.5] (paper, appendix D).
LATENT_CLIP = 0.5


@dataclasses.dataclass(frozen=True)
class BCQConfig:
    """Continuous BCQ hyperparameters (defaults: d3rlpy 2.8 ``BCQConfig``, paper sizes)."""

    actor_hidden: tuple[int, ...] = (400, 300)
    """Hidden widths of the perturbation network xi(s, a)."""
    critic_hidden: tuple[int, ...] = (400, 300)
    """Hidden widths of each critic Q_e(s, a)."""
    vae_hidden: tuple[int, ...] = (750, 750)
    """Hidden widths of the VAE's encoder and of its decoder."""
    latent_dim: int | None = None
    """VAE latent size; None means ``2 * action_dim`` (paper and d3rlpy)."""
    actor_learning_rate: float = 1e-3
    """Adam learning rate of the perturbation network."""
    critic_learning_rate: float = 1e-3
    """Adam learning rate of the critics."""
    imitator_learning_rate: float = 1e-3
    """Adam learning rate of the VAE."""
    batch_size: int = 100
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Polyak rate of the target networks."""
    n_critics: int = 2
    """Critics in the ensemble (2: clipped double Q)."""
    update_actor_interval: int = 1
    """Gradient steps per actor (and actor-target) update; the critics update every step."""
    lam: float = 0.75
    """Target weight of the ensemble minimum: ``lam * min + (1 - lam) * max`` over critics."""
    n_action_samples: int = 100
    """Candidate actions per state, both in the critic target and in ``act``."""
    action_flexibility: float = 0.05
    """Phi: largest perturbation of a decoded action, in the normalised ``[-1, 1]`` box."""
    rl_start_step: int = 0
    """Steps that train only the VAE before the critics and actor start."""
    beta: float = 0.5
    """Weight of the VAE's KL term."""
    act_seed: int | None = None
    """Seed of the generator behind ``act``'s candidates; None uses ``torch.initial_seed()``."""

    def __post_init__(self) -> None:
        if self.n_critics < 1 or self.n_action_samples < 1 or self.update_actor_interval < 1:
            raise ValueError("n_critics, n_action_samples and update_actor_interval must be >= 1")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must lie in [0, 1], not {self.lam}")


# --------------------------------------------------------------------------------------------
# Losses (pure functions of tensors; the TD target and loss are offaug.algorithms.learners.losses)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VAELoss:
    """The VAE objective and its two terms (each a weighted batch mean)."""

    total: torch.Tensor
    reconstruction: torch.Tensor
    kl: torch.Tensor


def vae_loss(
    reconstruction: torch.Tensor,
    actions: torch.Tensor,
    latent_mean: torch.Tensor,
    latent_log_std: torch.Tensor,
    beta: float,
    weights: torch.Tensor | None,
) -> VAELoss:
    """``||a - a_hat||^2 + beta * KL(N(mu, sigma) || N(0, 1))``, both averaged over dimensions.

    Shapes: ``reconstruction, actions (B, act)``, ``latent_mean, latent_log_std (B, latent)``.
    """
    squared_error = (reconstruction - actions).pow(2).mean(-1)  # (B,)
    variance = (2 * latent_log_std).exp()
    kl = (0.5 * (latent_mean.pow(2) + variance - 1.0) - latent_log_std).mean(-1)  # (B,)
    return VAELoss(
        total=weighted_mean(squared_error + beta * kl, weights),
        reconstruction=weighted_mean(squared_error, weights),
        kl=weighted_mean(kl, weights),
    )


def perturb(
    actions: torch.Tensor, squashed_residual: torch.Tensor, flexibility: float
) -> torch.Tensor:
    """``clip(a + Phi * xi, -1, 1)`` with ``xi = tanh(.)`` in ``[-1, 1]``: the BCQ policy."""
    return (actions + flexibility * squashed_residual).clamp(-1.0, 1.0)


def soft_clipped_double_q(candidate_values: torch.Tensor, lam: float) -> torch.Tensor:
    """``max_i [lam * min_e Q_e(s, a_i) + (1 - lam) * max_e Q_e(s, a_i)]``.

    ``candidate_values (E, n, B) -> (B,)``: critics ``E``, candidates ``n``, states ``B``.
    """
    low, high = candidate_values.aminmax(dim=0)  # (n, B) each
    return torch.lerp(high, low, lam).amax(dim=0)


def actor_loss(q_values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``-Q_1(s, pi(s))``: ``q_values (B,)`` of the first critic."""
    return weighted_mean(-q_values, weights)


def reduce_ensemble(values: torch.Tensor, reduction: QReduction) -> torch.Tensor:
    """One value per state from an ensemble's: ``(E, B) -> (B,)``."""
    if reduction == "first":
        return values[0]
    if reduction == "min":
        return values.amin(0)
    return values.mean(0)


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(
        torch.initial_seed() if seed is None else seed
    )


_NOT_YET = float("nan")  # a loss that has not been computed yet (before rl_start_step)


# --------------------------------------------------------------------------------------------
# Continuous BCQ
# --------------------------------------------------------------------------------------------


class BCQ:
    """Continuous BCQ trainer: VAE, perturbation network, twin critics and their targets."""

    name = "bcq"
    fuses_on_cpu = False
    """``fuse_seeds: auto`` trains its seeds one per stage on a CPU (arithmetic-bound steps)."""
    fused_hyperparameters: tuple[str, ...] = (
        "actor_learning_rate",
        "critic_learning_rate",
        "imitator_learning_rate",
        "gamma",
        "tau",
        "lam",
        "action_flexibility",
        "beta",
    )
    """Config fields that may differ between the members of a fused run."""

    def __init__(
        self, spaces: Spaces, config: BCQConfig | None = None, *, device: str | None = None
    ) -> None:
        if spaces.discrete:
            raise ValueError("BCQ learns continuous actions; use DiscreteBCQ for discrete ones")
        self.spaces = spaces
        self.config = config or BCQConfig()
        self.device = choose_device(device)
        cfg = self.config
        obs_dim, act_dim = spaces.observation_dim, spaces.action_dim
        self.normaliser = ActionNormaliser(spaces).to(self.device)
        self.vae = VAE(obs_dim, act_dim, cfg.vae_hidden, cfg.latent_dim).to(self.device)
        # xi(s, a) = tanh(MLP([s, a])); the perturbation is Phi * xi.
        self.actor = DeterministicActor(obs_dim + act_dim, act_dim, cfg.actor_hidden).to(
            self.device
        )
        self.critic = CriticEnsemble(obs_dim, act_dim, cfg.critic_hidden, cfg.n_critics).to(
            self.device
        )
        self.actor_target: DeterministicActor = frozen_copy(self.actor)
        self.critic_target: CriticEnsemble = frozen_copy(self.critic)
        self.vae_optimizer = adam(self.vae.parameters(), cfg.imitator_learning_rate)
        self.actor_optimizer = adam(self.actor.parameters(), cfg.actor_learning_rate)
        self.critic_optimizer = adam(self.critic.parameters(), cfg.critic_learning_rate)
        self._actor_params = list(self.actor.parameters())
        self.generator = _generator(self.device, cfg.act_seed)
        self._workspace = Workspace()
        self.steps = 0
        nan = torch.tensor(_NOT_YET, device=self.device)
        # The latest critic and actor metrics, reported on the steps that do not train them.
        self.last_rl_metrics: dict[str, torch.Tensor] = {
            "critic_loss": nan,
            "actor_loss": nan,
            "q_mean": nan,
        }

    # ---- candidates ------------------------------------------------------------------------

    @torch.no_grad()
    def _score_candidates(
        self,
        states: torch.Tensor,
        latent: torch.Tensor,
        actor: DeterministicActor,
        critic: CriticEnsemble,
        members: int,
        *,
        flexibility: float | None = None,
        buffered: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Perturbed VAE actions and their values: ``(B, obs), (n, B, latent)`` ->
        candidates ``(n, B, act)``, values ``(members, n, B)`` of the first ``members`` critics.

        Computes ``perturb(G(s, z), xi(s, G(s, z)))`` and ``Q_e(s, .)`` for every latent ``z``,
        exactly as the modules would on ``n * B`` repeated states, with :func:`tiled_mlp`:
        into the trainer's reused buffers when ``buffered``, else allocating (what a fused
        run's ``vmap`` batches). ``flexibility`` defaults to the config's Phi.
        """
        workspace = self._workspace if buffered else None
        if flexibility is None:
            flexibility = self.config.action_flexibility
        decoder, perturbation = mlp_affines(self.vae.decoder), mlp_affines(actor.net)
        decoded = tiled_mlp(decoder, states, latent, workspace, "decoder").tanh_()
        residual = tiled_mlp(perturbation, states, decoded, workspace, "actor").tanh_()
        candidates = perturb(decoded, residual, flexibility)  # (n, B, act)
        values = torch.stack(
            [
                tiled_mlp(
                    ensemble_affines(critic.net, member),
                    states,
                    candidates,
                    workspace,
                    f"critic{member}",
                ).squeeze(-1)
                for member in range(members)
            ]
        )  # members x (n, B)
        return candidates, values

    def _prior_latent(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n_action_samples`` clipped prior draws per state: ``(n, B, latent)``."""
        shape = (self.config.n_action_samples, batch, self.vae.latent_dim)
        latent = torch.randn(shape, generator=generator, device=self.device)
        return latent.clamp_(-LATENT_CLIP, LATENT_CLIP)

    # ---- training --------------------------------------------------------------------------

    def trains_critics(self, step: int) -> bool:
        """Whether step ``step`` (counted from 0) trains the critics (from ``rl_start_step``)."""
        return step >= self.config.rl_start_step

    def trains_actor(self, step: int) -> bool:
        """Whether step ``step`` also trains the actor (every ``update_actor_interval``)."""
        return self.trains_critics(step) and step % self.config.update_actor_interval == 0

    def hyperparameters(self) -> dict[str, float]:
        """The values of :attr:`fused_hyperparameters` (the losses read them from here)."""
        return config_hyperparameters(self.config, self.fused_hyperparameters)

    def draw_noise(self, batch_size: int, draws: Draws) -> dict[str, torch.Tensor]:
        """The random draws of step ``draws.step``, in this order: the VAE's reparameterisation
        noise ``vae`` ``(B, latent)``; on critic steps the clipped prior latents ``target``
        ``(n, B, latent)`` of the next states' candidates; on actor steps the clipped prior
        latent ``actor`` ``(B, latent)`` of the action the actor perturbs."""
        latent_dim = self.vae.latent_dim
        noise = {"vae": draws((batch_size, latent_dim))}
        if self.trains_critics(draws.step):
            shape = (self.config.n_action_samples, batch_size, latent_dim)
            noise["target"] = draws(shape).clamp_(-LATENT_CLIP, LATENT_CLIP)
        if self.trains_actor(draws.step):
            latent = draws((batch_size, latent_dim))
            noise["actor"] = latent.clamp_(-LATENT_CLIP, LATENT_CLIP)
        return noise

    def imitation_loss(
        self, batch: TorchBatch, noise: Mapping[str, torch.Tensor], hyper: Hyper
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The VAE's loss on the data actions (:func:`vae_loss`) and its terms."""
        actions = self.normaliser(batch.actions)
        reconstruction, latent_mean, latent_log_std = self.vae(
            batch.observations, actions, noise["vae"]
        )
        imitation = vae_loss(
            reconstruction, actions, latent_mean, latent_log_std, hyper["beta"], batch.weights
        )
        return imitation.total, {
            "vae_loss": imitation.total.detach(),
            "vae_reconstruction": imitation.reconstruction.detach(),
            "vae_kl": imitation.kl.detach(),
        }

    def critic_loss(
        self,
        batch: TorchBatch,
        noise: Mapping[str, torch.Tensor],
        hyper: Hyper,
        *,
        buffered: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The critics' TD loss towards the soft clipped double-Q value of each next state's
        candidates (``buffered``: as for the candidate pass; the single-seed update's)."""
        actions = self.normaliser(batch.actions)
        with torch.no_grad():
            _, values = self._score_candidates(
                batch.next_observations,
                noise["target"],
                self.actor_target,
                self.critic_target,
                self.config.n_critics,
                flexibility=hyper["action_flexibility"],
                buffered=buffered,
            )  # (E, n, B)
            next_values = soft_clipped_double_q(values, hyper["lam"])
            targets = td_target(batch.rewards, batch.terminals, next_values, hyper["gamma"])
        q_values = self.critic(batch.observations, actions)  # (E, B)
        loss = ensemble_td_loss(q_values, targets, batch.weights)
        return loss, {"critic_loss": loss.detach(), "q_mean": q_values.detach().mean()}

    def policy_loss(
        self, batch: TorchBatch, noise: Mapping[str, torch.Tensor], hyper: Hyper
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``-Q_1`` of each state's perturbed VAE action (the critics' parameters must take
        no gradient from it)."""
        observations = batch.observations
        with torch.no_grad():
            decoded = self.vae.decode(observations, noise["actor"])  # (B, act)
        residual = self.actor(torch.cat([observations, decoded], dim=-1))
        policy_actions = perturb(decoded, residual, hyper["action_flexibility"])
        loss = actor_loss(self.critic(observations, policy_actions)[0], batch.weights)
        return loss, {"actor_loss": loss.detach()}

    def update(self, batch: TorchBatch) -> dict[str, torch.Tensor]:
        """One step: VAE, then critics, then (every ``update_actor_interval``) the actor.

        ``critic_loss``, ``actor_loss`` and ``q_mean`` report their latest value (NaN until
        ``rl_start_step``), so every step returns the same metric names.
        """
        cfg = self.config
        noise = self.draw_noise(len(batch.rewards), Draws(self.device, step=self.steps))
        hyper = self.hyperparameters()
        loss, metrics = self.imitation_loss(batch, noise, hyper)
        self.vae_optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        self.vae_optimizer.step()

        if self.trains_critics(self.steps):
            loss, critic_metrics = self.critic_loss(batch, noise, hyper, buffered=True)
            self.critic_optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            self.critic_optimizer.step()
            self.last_rl_metrics.update(critic_metrics)
            if self.trains_actor(self.steps):
                loss, actor_metrics = self.policy_loss(batch, noise, hyper)
                # Gradients for the actor only: the critics' weight gradients are never computed.
                grads = torch.autograd.grad(loss, self._actor_params)
                for param, grad in zip(self._actor_params, grads, strict=True):
                    param.grad = grad
                self.actor_optimizer.step()
                self.last_rl_metrics.update(actor_metrics)
                soft_update(self.actor_target, self.actor, cfg.tau)
            soft_update(self.critic_target, self.critic, cfg.tau)
        self.steps += 1
        return {**metrics, **self.last_rl_metrics}

    def restore_rl_metrics(self, metrics: Mapping[str, torch.Tensor]) -> None:
        """Set the latest critic and actor metrics (a fused run's member)."""
        self.last_rl_metrics = {
            name: metrics[name].to(self.device) for name in self.last_rl_metrics
        }

    # ---- inference -------------------------------------------------------------------------

    @torch.no_grad()
    def act(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The best of ``n_action_samples`` candidates by Q_1, in the environment's bounds.

        Candidates come from :attr:`generator`, so a restored trainer repeats its actions.
        """
        obs = to_tensor(observations, self.device).reshape(-1, self.spaces.observation_dim)
        batch = obs.shape[0]
        latent = self._prior_latent(batch, self.generator)
        candidates, q1 = self._score_candidates(obs, latent, self.actor, self.critic, members=1)
        best = q1[0].argmax(dim=0)  # (n, B) -> (B,)
        chosen = candidates[best, torch.arange(batch, device=self.device)]  # (B, act)
        return self.normaliser.inverse(chosen).cpu().numpy()

    @torch.no_grad()
    def q_values(
        self,
        observations: npt.NDArray[np.float32],
        actions: npt.NDArray[np.float32],
        reduction: QReduction = "first",
    ) -> npt.NDArray[np.float32]:
        """Q(s, a) of environment-space actions: ``(B, obs), (B, act) -> (B,)``."""
        obs = to_tensor(observations, self.device)
        normalised = self.normaliser(to_tensor(actions, self.device))
        values = self.critic(obs, normalised)  # (E, B)
        return reduce_ensemble(values, reduction).cpu().numpy()

    @torch.no_grad()
    def sample_vae_actions(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """One action per state decoded from the clipped prior (environment bounds)."""
        obs = to_tensor(observations, self.device)
        latent = torch.randn(
            (obs.shape[0], self.vae.latent_dim), generator=self.generator, device=self.device
        ).clamp_(-LATENT_CLIP, LATENT_CLIP)
        decoded = self.vae.decode(obs, latent)
        return self.normaliser.inverse(decoded).cpu().numpy()

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Networks, targets, optimisers, step count and ``act``'s generator."""
        return {
            "vae": self.vae.state_dict(),
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "actor_target": self.actor_target.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "vae_optimizer": self.vae_optimizer.state_dict(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "steps": self.steps,
            "act_generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.vae.load_state_dict(state["vae"])
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.actor_target.load_state_dict(state["actor_target"])
        self.critic_target.load_state_dict(state["critic_target"])
        load_optimizer_state(self.vae_optimizer, state["vae_optimizer"])
        load_optimizer_state(self.actor_optimizer, state["actor_optimizer"])
        load_optimizer_state(self.critic_optimizer, state["critic_optimizer"])
        self.steps = int(state["steps"])
        self.generator.set_state(state["act_generator"].cpu())
