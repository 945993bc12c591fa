"""ReBRAC: TD3+BC with separate actor and critic penalties, LayerNorm critics, bigger everything.

Tarasov, Kurenkov, Nikulin and Kolesnikov 2023, "Revisiting the Minimalist Approach to Offline
Reinforcement Learning" (NeurIPS, arXiv:2305.09836). On top of
:mod:`offaug.algorithms.learners.td3bc`:

* the actor minimises ``beta_1 * ||pi(s) - a||^2 - min_e Q_e(s, pi(s)) / mean |min_e Q_e|``
  (the squared error summed over action dimensions; the Q term normalised, ``normalise_q``);
* the critics' target is penalised by the distance of the smoothed target action from the
  dataset's next action: ``y = r + gamma * (min_e Q'_e(s', a') - beta_2 * ||a' - a'_data||^2)``,
  so batches carry ``next_actions`` (the dataset's action at ``s'``, see
  :class:`offaug.datasets.MixtureSampler`);
* LayerNorm after every hidden layer of the critics, three hidden layers, batch 1024,
  learning rates 1e-3, and the EDAC initialisation (biases 0.1, output layers uniform in
  ``+-3e-3`` for critics and ``+-1e-3`` for the actor), as the authors' code.

Defaults are the paper's locomotion settings (its hyperparameter table; CORL's configs) with
the penalties of hopper-medium (``beta_1 = beta_2 = 0.01``); the paper tunes both per dataset,
and ``penalties: "walker2d-medium-v2"`` takes that dataset's pair from its table
(:data:`PAPER_PENALTIES`). Observations are not standardised by default, as in the paper.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from offaug.algorithms.base import Spaces, weighted_mean
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.fusing import Hyper
from offaug.algorithms.learners.td3bc import TD3BC, q_normaliser
from offaug.algorithms.nn.networks import CriticEnsemble, DeterministicActor, EnsembleLinear

PAPER_PENALTIES: dict[str, tuple[float, float]] = {
    "halfcheetah-random-v2": (0.001, 0.1),
    "halfcheetah-medium-v2": (0.001, 0.01),
    "halfcheetah-medium-replay-v2": (0.01, 0.001),
    "halfcheetah-medium-expert-v2": (0.01, 0.1),
    "halfcheetah-expert-v2": (0.01, 0.01),
    "hopper-random-v2": (0.001, 0.01),
    "hopper-medium-v2": (0.01, 0.01),
    "hopper-medium-replay-v2": (0.05, 0.5),
    "hopper-medium-expert-v2": (0.1, 0.01),
    "hopper-expert-v2": (0.1, 0.1),
    "walker2d-random-v2": (0.01, 0.0),
    "walker2d-medium-v2": (0.05, 0.1),
    "walker2d-medium-replay-v2": (0.05, 0.01),
    "walker2d-medium-expert-v2": (0.01, 0.01),
    "walker2d-expert-v2": (0.01, 0.5),
}
"""(beta_1, beta_2) per D4RL locomotion dataset: the paper's tuned actor and critic penalties
(its hyperparameter table, as in CORL's ReBRAC configs)."""
DEFAULT_BC_COEF = 0.01
"""hopper-medium's beta_1 = beta_2, the defaults of both penalties."""


@dataclasses.dataclass(frozen=True)
class ReBRACConfig:
    """ReBRAC hyperparameters; the defaults are the paper's locomotion ones (hopper-medium's)."""

    actor_learning_rate: float = 1e-3
    """Adam learning rate of the actor."""
    critic_learning_rate: float = 1e-3
    """Adam learning rate of the critics."""
    batch_size: int = 1024
    """Transitions per gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Polyak rate of the target actor and critics (applied on actor steps)."""
    n_critics: int = 2
    """Critics in the ensemble; the target and the actor take their minimum."""
    policy_noise: float = 0.2
    """Std of the Gaussian noise on the target action (target policy smoothing)."""
    noise_clip: float = 0.5
    """The smoothing noise is clipped to ``[-noise_clip, noise_clip]``."""
    policy_freq: int = 2
    """Critic steps per actor step (the actor and targets update on every ``policy_freq``-th)."""
    actor_bc_coef: float = DEFAULT_BC_COEF
    """beta_1: weight of the actor's squared distance to the dataset action."""
    critic_bc_coef: float = DEFAULT_BC_COEF
    """beta_2: weight of the target action's squared distance to the dataset's next action."""
    normalise_q: bool = True
    """Divide the actor's Q term by its batch mean absolute value (detached)."""
    critic_layer_norm: bool = True
    """LayerNorm after every hidden layer of the critics."""
    actor_layer_norm: bool = False
    """LayerNorm after every hidden layer of the actor."""
    normalise_observations: bool = False
    """Standardise observations with the training data's mean and std (+1e-3)."""
    hidden: tuple[int, ...] = (256, 256, 256)
    """Hidden layer widths of the actor and of every critic."""
    penalties: str | None = None
    """A D4RL locomotion dataset (``"walker2d-medium-v2"``, ...; :data:`PAPER_PENALTIES`) whose
    tuned ``actor_bc_coef`` and ``critic_bc_coef`` from the paper's table replace those fields."""

    def __post_init__(self) -> None:
        if self.policy_freq < 1:
            raise ValueError(f"policy_freq must be positive, not {self.policy_freq}")
        if self.penalties is None:
            return
        if self.penalties not in PAPER_PENALTIES:
            raise ValueError(
                f"penalties {self.penalties!r} is not a dataset of the paper's table; "
                f"known: {', '.join(sorted(PAPER_PENALTIES))}"
            )
        actor, critic = PAPER_PENALTIES[self.penalties]
        given = (self.actor_bc_coef, self.critic_bc_coef)
        if given not in ((actor, critic), (DEFAULT_BC_COEF, DEFAULT_BC_COEF)):
            raise ValueError(
                f"give either penalties ({self.penalties!r}: {actor} / {critic}) or "
                f"actor_bc_coef / critic_bc_coef ({given[0]} / {given[1]}), not both"
            )
        # Frozen: the table's values become the fields, so the resolved config says them.
        object.__setattr__(self, "actor_bc_coef", actor)
        object.__setattr__(self, "critic_bc_coef", critic)


# ----------------------------------------------------------------------------------------------
# Pure losses. ``E`` critics, ``B`` transitions, ``A`` action dimensions.


def squared_distance(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``||first - second||^2`` summed over the action dimensions: ``(B, A) -> (B,)``."""
    return (first - second).pow(2).sum(-1)


def penalised_next_values(
    q_next: torch.Tensor,
    next_actions: torch.Tensor,
    dataset_next_actions: torch.Tensor,
    critic_bc_coef: float,
) -> torch.Tensor:
    """``min_e Q'_e(s', a') - beta_2 * ||a' - a'_data||^2``: ``(E, B) -> (B,)``."""
    penalty = critic_bc_coef * squared_distance(next_actions, dataset_next_actions)
    return q_next.min(0).values - penalty


def rebrac_actor_loss(
    q_policy: torch.Tensor,
    policy_actions: torch.Tensor,
    actions: torch.Tensor,
    actor_bc_coef: float,
    normalise_q: bool,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``beta_1 * ||pi(s) - a||^2 - lambda * min_e Q_e(s, pi(s))``, weighted mean over the batch.

    ``q_policy`` ``(E, B)``; ``lambda = 1 / mean |min_e Q_e|`` (detached) when ``normalise_q``,
    else 1. Returns the loss and the mean squared distance (unscaled).
    """
    q_min = q_policy.min(0).values
    distance = squared_distance(policy_actions, actions)
    lam = q_normaliser(q_min) if normalise_q else 1.0
    return weighted_mean(actor_bc_coef * distance - lam * q_min, weights), weighted_mean(
        distance, weights
    )


# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def edac_init(network: nn.Module, output_bound: float) -> None:
    """Biases 0.1 in the hidden layers; output weights and bias uniform in ``+-output_bound``.

    The hidden weights keep PyTorch's default (uniform in ``+-1/sqrt(fan_in)``), as in the
    authors' code. ``network`` is a :class:`DeterministicActor` or a :class:`CriticEnsemble`.
    """
    layers = [m for m in network.modules() if isinstance(m, nn.Linear | EnsembleLinear)]
    for layer in layers[:-1]:
        layer.bias.fill_(0.1)
    layers[-1].weight.uniform_(-output_bound, output_bound)
    layers[-1].bias.uniform_(-output_bound, output_bound)


class ReBRAC(TD3BC):
    """ReBRAC trainer: :class:`TD3BC`'s update with ReBRAC's penalties and networks."""

    name = "rebrac"
    uses_next_actions = True
    # Its LayerNorm ensembles and penalties run per member under vmap.
    stacks_members = False
    fused_hyperparameters = (
        "actor_learning_rate",
        "critic_learning_rate",
        "gamma",
        "tau",
        "policy_noise",
        "noise_clip",
        "actor_bc_coef",
        "critic_bc_coef",
    )

    def __init__(
        self, spaces: Spaces, config: ReBRACConfig | None = None, *, device: str | None = None
    ) -> None:
        self.rebrac_config = config or ReBRACConfig()
        self._setup(spaces, self.rebrac_config, device)

    def _make_actor(self) -> DeterministicActor:
        cfg = self.rebrac_config
        actor = DeterministicActor(
            self.spaces.observation_dim,
            self.spaces.action_dim,
            cfg.hidden,
            layer_norm=cfg.actor_layer_norm,
        )
        edac_init(actor, 1e-3)
        return actor

    def _make_critic(self) -> CriticEnsemble:
        cfg = self.rebrac_config
        critic = CriticEnsemble(
            self.spaces.observation_dim,
            self.spaces.action_dim,
            cfg.hidden,
            cfg.n_critics,
            layer_norm=cfg.critic_layer_norm,
        )
        edac_init(critic, 3e-3)
        return critic

    def _next_values(
        self, next_obs: torch.Tensor, next_actions: torch.Tensor, batch: TorchBatch, hyper: Hyper
    ) -> torch.Tensor:
        if batch.next_actions is None:
            raise ValueError(
                "ReBRAC needs each row's next dataset action: sample with "
                "MixtureSampler(..., next_actions=True)"
            )
        dataset_next = self.normaliser(batch.next_actions)
        q_next = self.critic_target(next_obs, next_actions)  # (E, B)
        return penalised_next_values(q_next, next_actions, dataset_next, hyper["critic_bc_coef"])

    def _actor_losses(
        self,
        obs: torch.Tensor,
        policy_actions: torch.Tensor,
        actions: torch.Tensor,
        weights: torch.Tensor,
        hyper: Hyper,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_policy = self.critic(obs, policy_actions)  # (E, B): ReBRAC takes their minimum
        return rebrac_actor_loss(
            q_policy,
            policy_actions,
            actions,
            hyper["actor_bc_coef"],
            self.rebrac_config.normalise_q,
            weights,
        )
