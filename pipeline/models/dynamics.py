"""A learned-dynamics ensemble for datasets whose simulator is not at hand (MOPO-style).

Yu et al. 2020, "MOPO: Model-based Offline Policy Optimization". An ensemble of probabilistic
networks predicts a Gaussian over (next-state difference, reward) and a termination logit from
(state, action); members are trained together (one batched ensemble op) on independent
bootstrap draws of the data. A step (:meth:`DynamicsEnsemble.step`) lets a random member predict
it and reports the ensemble's uncertainty ``u(s, a)``, by which a model rollout
(:mod:`offaug.pipeline.rollouts.model_rollouts`) penalises the reward,
``r - coefficient * u(s, a)``, one of

* ``mopo``: ``u = max_k ||sigma_k(s, a)||``, MOPO's max-aleatoric penalty (its lambda is the
  coefficient);
* ``mobile``: Sun et al. 2023, "Model-Bellman Inconsistency for Model-based Offline Reinforcement
  Learning" (MOBILE), ICML. ``u`` is the std over members k of the Bellman target
  ``r_k + gamma * V(s'_k)``, each member's target averaged over ``mobile_samples`` draws
  (s'_k, r_k) of its Gaussian; ``V`` is the rollout learner's own value, ``min_j Q_j(s', pi(s'))``
  of its critics at its action (IQL: its V net), with its discount
  (:class:`DiscountedValue`), so only a learner with a value
  can roll out with it (the coefficient is the paper's beta).

With ``invariants`` every predicted next state is projected onto the quadratic functions of the
observation the data keeps constant (:mod:`offaug.pipeline.models.invariants`: Pendulum's
cos² + sin² = 1), so a long rollout stays on the states the env can be in.

:meth:`DynamicsEnsemble.disagreement` scores dataset states for ``disagreement`` starts,
:meth:`DynamicsEnsemble.expected_step` gives the members' mean prediction (for quality reports)
and :meth:`DynamicsEnsemble.mean_step` the same with its uncertainty, for the search in the model
(:class:`offaug.pipeline.rollouts.model_rollouts.ModelEnv`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch.nn import functional as F

from offaug.algorithms.base import Spaces, adam, config_from_json, load_checkpoint, save_checkpoint
from offaug.algorithms.nn.networks import EnsembleMLP
from offaug.datasets.transitions import Transitions
from offaug.pipeline.models.invariants import QuadraticInvariants, find_invariants
from offaug.pipeline.rollouts.references import DiscountedValue

PenaltyKind = Literal["mopo", "mobile"]
"""The uncertainty a model rollout's reward is penalised by (the module docstring says each)."""


@dataclasses.dataclass(frozen=True)
class DynamicsConfig:
    """Hyperparameters of the dynamics ensemble and its rollouts."""

    members: int = 7
    """Ensemble size (MOPO: 7)."""
    hidden: tuple[int, ...] = (200, 200, 200)
    """Hidden widths of each member."""
    learning_rate: float = 1e-3
    """Adam learning rate."""
    batch_size: int = 256
    """Transitions per member per step."""
    steps: int = 5000
    """Gradient steps."""
    holdout_fraction: float = 0.1
    """Share of transitions kept out of training for the validation loss."""
    horizon: int = 5
    """Model rollout length H."""
    penalty: PenaltyKind = "mopo"
    """Which uncertainty penalises the reward: MOPO's or MOBILE's."""
    penalty_coefficient: float = 1.0
    """The coefficient in ``r - coefficient * uncertainty`` (MOPO's lambda, MOBILE's beta)."""
    mobile_samples: int = 10
    """MOBILE: draws of (s', r) per member whose Bellman targets are averaged."""
    bounds_margin: float = 0.1
    """States may exceed the dataset's range by this share of it before a rollout stops."""
    seed: int = 0
    """Seed of initialisation, bootstrap draws and rollouts."""
    invariants: bool = False
    """Project every predicted next state onto the data's quadratic invariants
    (:mod:`offaug.pipeline.models.invariants`); a dataset without any is unchanged."""


def mobile_penalty(rewards: torch.Tensor, next_values: torch.Tensor, gamma: float) -> torch.Tensor:
    """MOBILE's uncertainty from each member's draws: ``(S, E, B), (S, E, B) -> (B,)``.

    The Bellman target ``r + gamma * V(s')`` of every draw, averaged over a member's ``S``
    draws, then its (unbiased) std over the ``E`` members.
    """
    targets = rewards + gamma * next_values  # (S, E, B)
    return targets.mean(0).std(0)


def gaussian_nll(mean: torch.Tensor, log_var: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample Gaussian negative log-likelihood summed over dimensions: ``(..., d) -> (...)``."""
    return 0.5 * (((target - mean) ** 2) * torch.exp(-log_var) + log_var).sum(-1)


class DynamicsEnsemble:
    """The ensemble, its input/output normalisation and its training."""

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        config: DynamicsConfig,
        statistics: Mapping[str, npt.NDArray[Any]],
        invariants: QuadraticInvariants | None = None,
    ) -> None:
        self.config = config
        self.observation_dim = observation_dim
        self.action_dim = action_dim
        torch.manual_seed(config.seed)
        # Outputs: mean and log-variance of (delta state, reward), then a termination logit.
        self.target_dim = observation_dim + 1
        self.net = EnsembleMLP(
            config.members, observation_dim + action_dim, config.hidden, 2 * self.target_dim + 1
        )
        self.max_log_var = torch.nn.Parameter(torch.full((self.target_dim,), 0.5))
        self.min_log_var = torch.nn.Parameter(torch.full((self.target_dim,), -10.0))
        self.optimizer = adam(
            [*self.net.parameters(), self.max_log_var, self.min_log_var], config.learning_rate
        )
        self.stats = {
            k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in statistics.items()
        }
        self.invariants = invariants
        """The data's quadratic invariants (None: not known, as in a model saved before they
        were kept); predictions are projected onto them where ``config.invariants``."""

    def _predict(
        self, observations: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs = (torch.cat([observations, actions], -1) - self.stats["input_mean"]) / self.stats[
            "input_std"
        ]
        out = self.net(inputs)  # (E, B, 2 * target + 1)
        mean, raw_log_var, terminal_logit = out.split([self.target_dim, self.target_dim, 1], dim=-1)
        # Soft bounds on the log-variance, as in PETS/MBPO.
        log_var = self.max_log_var - F.softplus(self.max_log_var - raw_log_var)
        log_var = self.min_log_var + F.softplus(log_var - self.min_log_var)
        return mean, log_var, terminal_logit.squeeze(-1)

    def fit(self, data: Transitions) -> dict[str, float]:
        """Train on ``data``; returns the final training and hold-out losses."""
        rng = np.random.default_rng(self.config.seed)
        n = len(data)
        order = rng.permutation(n)
        holdout = order[: int(n * self.config.holdout_fraction)]
        train_rows = order[int(n * self.config.holdout_fraction) :]
        tensors = _training_tensors(data)
        targets = self._targets(tensors)
        members, batch = self.config.members, self.config.batch_size
        loss = torch.zeros(())
        for _ in range(self.config.steps):
            # Each member draws its own bootstrap batch: (E, B) row indices.
            rows = torch.as_tensor(
                train_rows[rng.integers(0, len(train_rows), size=(members, batch))]
            )
            loss = self._loss(tensors, targets, rows)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        with torch.no_grad():
            rows = torch.as_tensor(np.broadcast_to(holdout, (members, len(holdout))).copy())
            holdout_loss = self._loss(tensors, targets, rows) if len(holdout) else torch.zeros(())
        return {"train_loss": float(loss.detach()), "holdout_loss": float(holdout_loss)}

    def _targets(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        delta = tensors["next_observations"] - tensors["observations"]
        target = torch.cat([delta, tensors["rewards"][:, None]], -1)
        return (target - self.stats["target_mean"]) / self.stats["target_std"]

    def _loss(
        self, tensors: Mapping[str, torch.Tensor], targets: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        observations = tensors["observations"][rows]  # (E, B, obs)
        actions = tensors["actions"][rows]
        mean, log_var, terminal_logit = self._predict(observations, actions)
        nll = gaussian_nll(mean, log_var, targets[rows])
        terminal = F.binary_cross_entropy_with_logits(
            terminal_logit, tensors["terminals"][rows], reduction="none"
        )
        bounds = 0.01 * (self.max_log_var.sum() - self.min_log_var.sum())
        # Over every member's bootstrap rows, (E, B): the members' losses summed, scaled by 1/E.
        return (nll + terminal).mean() + bounds

    @torch.no_grad()
    def step(
        self,
        observations: torch.Tensor,
        actions: torch.Tensor,
        member: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One model step for a batch: next states, rewards, terminal flags, uncertainty."""
        mean, log_var, terminal_logit = self._predict(observations, actions)  # (E, B, .)
        std = torch.exp(0.5 * log_var)
        target_std = self.stats["target_std"]
        batch = torch.arange(observations.shape[0])
        noise = torch.randn(mean.shape[1:], generator=generator)
        sample = mean[member, batch] + std[member, batch] * noise  # (B, target)
        prediction = sample * target_std + self.stats["target_mean"]
        next_observations = self._on_invariants(
            observations + prediction[:, : self.observation_dim]
        )
        rewards = prediction[:, -1]
        uncertainty = self._mopo_uncertainty(log_var)
        # Sampled, not thresholded: terminations are rare, and a 0.5 threshold would hide them.
        probability = torch.sigmoid(terminal_logit[member, batch])
        terminals = torch.rand(probability.shape, generator=generator) < probability
        return next_observations, rewards, terminals, uncertainty

    @torch.no_grad()
    def mean_step(
        self, observations: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The members' mean prediction for a batch, no noise drawn: next states, rewards,
        termination probabilities and MOPO's uncertainty (as :meth:`step` gives it). What a
        search that compares continuations needs: the same (s, a) always gives the same step."""
        mean, log_var, terminal_logit = self._predict(observations, actions)  # (E, B, .)
        target_std = self.stats["target_std"]
        prediction = mean.mean(0) * target_std + self.stats["target_mean"]
        next_observations = self._on_invariants(
            observations + prediction[:, : self.observation_dim]
        )
        probability = torch.sigmoid(terminal_logit).mean(0)
        return next_observations, prediction[:, -1], probability, self._mopo_uncertainty(log_var)

    def _on_invariants(self, next_observations: torch.Tensor) -> torch.Tensor:
        """Predicted next states, projected onto the data's invariants where the config asks."""
        if not self.config.invariants or self.invariants is None:
            return next_observations
        return self.invariants.project(next_observations)

    def _mopo_uncertainty(self, log_var: torch.Tensor) -> torch.Tensor:
        """MOPO's penalty: the largest predicted std (in original units) over members,
        ``(E, B, target) -> (B,)``."""
        std = torch.exp(0.5 * log_var)
        return torch.linalg.vector_norm(std * self.stats["target_std"], dim=-1).amax(0)

    @torch.no_grad()
    def bellman_inconsistency(
        self,
        observations: torch.Tensor,
        actions: torch.Tensor,
        value: DiscountedValue,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """MOBILE's uncertainty at each (s, a) of a batch: ``(B, obs), (B, act) -> (B,)``."""
        mean, log_var, _ = self._predict(observations, actions)  # (E, B, target)
        std = torch.exp(0.5 * log_var)
        noise = torch.randn((self.config.mobile_samples, *mean.shape), generator=generator)
        draws = (mean + std * noise) * self.stats["target_std"] + self.stats["target_mean"]
        next_observations = observations + draws[..., : self.observation_dim]  # (S, E, B, obs)
        rewards = draws[..., -1]  # (S, E, B)
        # (S, E, B, obs) -> (S * E * B, obs): the learner values every draw in one batch.
        flat = next_observations.reshape(-1, self.observation_dim).numpy()
        next_values = torch.as_tensor(
            np.asarray(value.value(flat), dtype=np.float32).reshape(rewards.shape)
        )
        return mobile_penalty(rewards, next_values, value.gamma)

    @torch.no_grad()
    def expected_step(
        self, observations: npt.ArrayLike, actions: npt.ArrayLike, chunk: int = 4096
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """The ensemble's one-step prediction at each (s, a): the members' mean of their
        predicted means, as next observations ``(N, obs)`` and rewards ``(N,)`` in the data's
        units (no noise drawn: what the model believes, for judging it against the env)."""
        obs = np.asarray(observations, dtype=np.float32)
        act = np.asarray(actions, dtype=np.float32).reshape(len(obs), -1)
        next_parts, reward_parts = [], []
        for start in range(0, len(obs), chunk):
            # Copies: the data may be a read-only memory map, which torch must not wrap.
            next_obs, rewards, _, _ = self.mean_step(
                torch.tensor(obs[start : start + chunk]), torch.tensor(act[start : start + chunk])
            )
            next_parts.append(next_obs.numpy())
            reward_parts.append(rewards.numpy())
        if not next_parts:
            return np.zeros((0, self.observation_dim), np.float32), np.zeros(0, np.float32)
        return np.concatenate(next_parts), np.concatenate(reward_parts)

    @torch.no_grad()
    def disagreement(
        self, observations: npt.ArrayLike, actions: npt.ArrayLike, chunk: int = 4096
    ) -> npt.NDArray[np.float64]:
        """(N,) the members' spread at (s, a): the norm of the std over members of their
        predicted means (normalised units), the ensemble's epistemic uncertainty."""
        obs = np.asarray(observations, dtype=np.float32)
        act = np.asarray(actions, dtype=np.float32).reshape(len(obs), -1)
        spread = []
        for start in range(0, len(obs), chunk):
            # Copies: the data may be a read-only memory map, which torch must not wrap.
            mean, _, _ = self._predict(
                torch.tensor(obs[start : start + chunk]), torch.tensor(act[start : start + chunk])
            )  # (E, B, target)
            spread.append(torch.linalg.vector_norm(mean.std(0), dim=-1).double().numpy())
        return np.concatenate(spread) if spread else np.zeros(0)

    def state_dict(self) -> dict[str, Any]:
        """Weights and normalisation statistics (and the data's invariants, where known)."""
        state: dict[str, Any] = {
            "net": self.net.state_dict(),
            "max_log_var": self.max_log_var.detach(),
            "min_log_var": self.min_log_var.detach(),
            "stats": self.stats,
            "dims": torch.tensor([self.observation_dim, self.action_dim]),
        }
        if self.invariants is not None:
            state["invariants"] = self.invariants.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.net.load_state_dict(state["net"])
        with torch.no_grad():
            self.max_log_var.copy_(state["max_log_var"])
            self.min_log_var.copy_(state["min_log_var"])
        self.stats = dict(state["stats"])
        # Checkpoints from before invariants were kept have none.
        saved = state.get("invariants")
        self.invariants = None if saved is None else QuadraticInvariants.from_state_dict(saved)


def _training_tensors(data: Transitions) -> dict[str, torch.Tensor]:
    return {
        # Copies: the data may be a read-only memory map, which torch must not wrap.
        "observations": torch.tensor(np.asarray(data.observations, dtype=np.float32)),
        "actions": torch.tensor(np.asarray(data.actions, dtype=np.float32)),
        "next_observations": torch.tensor(np.asarray(data.next_observations, dtype=np.float32)),
        "rewards": torch.tensor(np.asarray(data.rewards, dtype=np.float32)),
        "terminals": torch.tensor(np.asarray(data.terminals, dtype=np.float32)),
    }


def dataset_statistics(data: Transitions) -> dict[str, npt.NDArray[np.float32]]:
    """Normalisation statistics and state bounds of a dataset."""
    inputs = np.concatenate([data.observations, data.actions], 1).astype(np.float64)
    targets = np.concatenate(
        [data.next_observations - data.observations, data.rewards[:, None]], 1
    ).astype(np.float64)
    observations = np.asarray(data.observations, dtype=np.float64)
    return {
        "input_mean": inputs.mean(0).astype(np.float32),
        "input_std": (inputs.std(0) + 1e-6).astype(np.float32),
        "target_mean": targets.mean(0).astype(np.float32),
        "target_std": (targets.std(0) + 1e-6).astype(np.float32),
        "observation_low": observations.min(0).astype(np.float32),
        "observation_high": observations.max(0).astype(np.float32),
    }


def train_dynamics(
    data: Transitions, config: DynamicsConfig | None = None
) -> tuple[DynamicsEnsemble, dict[str, float]]:
    """Fit a dynamics ensemble to a dataset with continuous actions."""
    config = config or DynamicsConfig()
    if data.is_discrete_action:
        raise ValueError("the dynamics ensemble needs continuous actions")
    states = np.concatenate([data.observations, data.next_observations])
    model = DynamicsEnsemble(
        data.observations.shape[1],
        data.actions.shape[1],
        config,
        dataset_statistics(data),
        find_invariants(states),
    )
    return model, model.fit(data)


def save_dynamics(model: DynamicsEnsemble, path: str | Path) -> Path:
    """Write the ensemble as a checkpoint that loads without pickle."""
    spaces = Spaces(model.observation_dim, model.action_dim)
    return save_checkpoint(
        path, algorithm="dynamics", config=model.config, spaces=spaces, state=model.state_dict()
    )


def load_dynamics(path: str | Path) -> DynamicsEnsemble:
    """Load :func:`save_dynamics`'s checkpoint."""
    checkpoint = load_checkpoint(path)
    if checkpoint.algorithm != "dynamics":
        raise ValueError(f"{path}: a {checkpoint.algorithm} checkpoint, not a dynamics model")
    saved = dict(checkpoint.config)
    if isinstance(saved.get("penalty"), (int, float)):
        # Checkpoints from before the choice of penalty hold MOPO's lambda under "penalty".
        saved["penalty_coefficient"] = float(saved.pop("penalty"))
    config = config_from_json(DynamicsConfig, saved)
    stats = {k: v.numpy() for k, v in checkpoint.state["stats"].items()}
    model = DynamicsEnsemble(
        checkpoint.spaces.observation_dim, checkpoint.spaces.action_dim, config, stats
    )
    model.load_state_dict(checkpoint.state)
    return model
