"""The ``divergence`` section: how far each policy's actions leave the behaviour model beta_hat.

Densities are over the normalised action box [-1, 1]^d (nats). ``act`` is deterministic, so
KL(pi || beta_hat) of a trained policy is infinite (a point mass against a density); reported
instead is the negative log-likelihood of its actions under beta_hat, ``nll = -E_s log
beta_hat(pi(s)|s)``, comparable with the dataset actions' ``dataset_nll``: the larger the
excess, the further the policy left the behaviour's support. For the Gaussian policies a
Monte-Carlo KL is also given, ``mean(log pi(a|s) - log beta_hat(a|s))`` with ``a ~ pi(.|s)`` at
dataset states (0 for ``bc`` by definition), and for the rollout policy the exact-sample
estimate on the states it visited, ``mean(rollout_log_prob - behaviour_log_prob)`` of the
augmented data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.pipeline.diagnostics.importance import raw_log_ratio
from offaug.pipeline.diagnostics.policy_document import DivergenceSection, PolicyDivergence
from offaug.pipeline.diagnostics.policy_models import BehaviourModel, _rollout_divergence
from offaug.pipeline.diagnostics.sampling import PolicySample, batched_act
from offaug.pipeline.rollouts.noise import NoiseSpec


def policy_divergence(
    behaviour: BehaviourModel,
    observations: npt.NDArray[np.float32],
    dataset_actions: npt.NDArray[Any],
    policy_actions: npt.NDArray[Any],
) -> PolicyDivergence:
    """A deterministic policy's -E log beta_hat(pi(s)|s) and distance to dataset actions."""
    log_beta = behaviour.log_prob(observations, policy_actions)
    return {
        "kind": "deterministic (act)",
        "nll": -float(np.mean(log_beta)),
        "kl_monte_carlo": None,
        "action_distance": float(
            behaviour.actions.distance(policy_actions, dataset_actions).mean()
        ),
    }


def divergence_section(
    behaviour: BehaviourModel,
    bc_trainer: Any,
    parts: Sequence[Mapping[str, Any]],
    sample: PolicySample,
    augmented_data: Any | None,
    noise: NoiseSpec | None,
    rng: np.random.Generator,
) -> DivergenceSection:
    """beta_hat itself, the rollout policy (given its noise) and every trained policy's part."""
    states, dataset_actions = sample.states, sample.actions
    section: DivergenceSection = {
        "states": len(states),
        "dataset_nll": -float(np.mean(behaviour.log_prob(states, dataset_actions))),
        "policies": {},
    }
    bc_actions = batched_act(bc_trainer.act, states)
    bc_entry = policy_divergence(behaviour, states, dataset_actions, bc_actions)
    # beta_hat against itself: the Monte-Carlo KL is 0 by definition.
    kind = "categorical" if behaviour.actions.discrete else "gaussian"
    bc_entry["kind"] = f"{kind} (beta_hat)"
    bc_entry["kl_monte_carlo"] = 0.0
    section["policies"]["bc"] = bc_entry
    if noise is not None:
        rollout_entry = _rollout_divergence(behaviour, states, dataset_actions, noise, rng)
        log_ratio = None if augmented_data is None else raw_log_ratio(augmented_data)
        rollout_entry["kl_on_rollout_states"] = (
            None if log_ratio is None or log_ratio.size == 0 else -float(log_ratio.mean())
        )
        section["policies"]["rollout"] = rollout_entry
    for part in parts:
        section["policies"][part["name"]] = part["divergence"]
    return section
