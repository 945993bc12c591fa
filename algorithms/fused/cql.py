"""Continuous CQL as a :class:`~offaug.algorithms.fusing.FusedSpec`: K seeds in one network.

The update is one phase, as :meth:`CQL.update <offaug.algorithms.learners.cql.CQL.update>` is one
backward pass of the summed critic, actor, temperature and (Lagrange) dual losses: the fused
trainer steps the four optimisers on that sum for every member at once, then moves the target
critics. The log entropy temperature and ``log_alpha`` are modules of their own
(:class:`~offaug.algorithms.nn.networks.LearnedScalar`), so each member's pair is a row of a
``(K, 1)`` buffer with its own Adam moments and learning rate, as a network is; without the
Lagrange form ``log_alpha`` takes no step and is a per-member constant.

The step's randomness is :meth:`CQL.draw_noise <offaug.algorithms.learners.cql.CQL.draw_noise>`'s:
the policy's Gaussian noise, then the uniform actions of the log-sum-exp, drawn from each
member's own generator in the order its single-seed run draws them from the global one.
"""

from __future__ import annotations

from offaug.algorithms.fusing import FusedSpec, OptimizerSpec, Phase, config_hyperparameters
from offaug.algorithms.learners.cql import CQL

METRICS = (
    "critic_loss",
    "td_loss",
    "conservative_loss",
    "gap",
    "actor_loss",
    "temperature_loss",
    "temperature",
    "alpha",
    "q_data",
)
"""The metrics of a step, in the order :meth:`CQL.update` reports them (then ``alpha_loss``)."""


def cql_fused_spec(trainer: CQL) -> FusedSpec:
    """``trainer``'s update for the fused trainer (see :mod:`offaug.algorithms.fusing`)."""
    optimizers = {
        "actor": OptimizerSpec(trainer.actor_optimizer, "actor", "actor_learning_rate"),
        "critic": OptimizerSpec(trainer.critic_optimizer, "critic", "critic_learning_rate"),
        "temperature": OptimizerSpec(
            trainer.temperature_optimizer, "log_temperature", "temp_learning_rate"
        ),
    }
    metrics: tuple[str, ...] = METRICS
    if trainer.config.lagrange:
        optimizers["alpha"] = OptimizerSpec(
            trainer.alpha_optimizer, "log_alpha", "alpha_learning_rate"
        )
        metrics = (*METRICS, "alpha_loss")
    return FusedSpec(
        modules={
            "actor": trainer.actor,
            "critic": trainer.critic,
            "critic_target": trainer.critic_target,
            "log_temperature": trainer.log_temperature_module,
            "log_alpha": trainer.log_alpha_module,
            "normaliser": trainer.normaliser,
            "observation_normaliser": trainer.observation_normaliser,
        },
        optimizers=optimizers,
        targets={"critic_target": "critic"},
        phases=(Phase(trainer.phase_loss, tuple(optimizers), targets=("critic_target",)),),
        hyperparameters=config_hyperparameters(trainer.config, trainer.fused_hyperparameters),
        metrics=metrics,
        noise=trainer.draw_noise,
        schedule=trainer.schedule if trainer.config.bc_steps else None,
    )
