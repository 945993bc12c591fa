"""Continuous BCQ as a :class:`~offaug.algorithms.fusing.FusedSpec`: K seeds in one network.

The update is three phases, as :meth:`BCQ.update <offaug.algorithms.learners.bcq.BCQ.update>` steps
three optimisers one after another: the VAE every step; the critics from ``rl_start_step``,
then the target critics; the perturbation network from ``rl_start_step`` every
``update_actor_interval`` steps, then the target actor. Each phase reads the parameters the
phases before it left (the critics' target is scored with this step's VAE, the actor with this
step's critics), as the single-seed update does. Moving the target critics before the actor
step instead of after it changes nothing: the actor's loss does not read them.

The step's randomness is :meth:`BCQ.draw_noise <offaug.algorithms.learners.bcq.BCQ.draw_noise>`'s:
the VAE's reparameterisation noise, then, on the steps whose phases use them, the prior latents of
the target's candidates and of the actor's action, drawn from each member's own generator in the
order its single-seed run draws them from the global one. Fused, the candidate pass allocates its
activations instead of writing into the trainer's reused buffers, which ``torch.func.vmap`` cannot
batch; the arithmetic is the same.
"""

from __future__ import annotations

import functools

from offaug.algorithms.fusing import FusedSpec, OptimizerSpec, Phase
from offaug.algorithms.learners.bcq import BCQ

METRICS = ("vae_loss", "vae_reconstruction", "vae_kl", "critic_loss", "actor_loss", "q_mean")
"""The metrics of a step, in the order :meth:`BCQ.update` reports them."""


def bcq_fused_spec(trainer: BCQ) -> FusedSpec:
    """``trainer``'s update for the fused trainer (see :mod:`offaug.algorithms.fusing`)."""
    cfg = trainer.config
    return FusedSpec(
        modules={
            "vae": trainer.vae,
            "actor": trainer.actor,
            "critic": trainer.critic,
            "actor_target": trainer.actor_target,
            "critic_target": trainer.critic_target,
            "normaliser": trainer.normaliser,
        },
        optimizers={
            "vae": OptimizerSpec(trainer.vae_optimizer, "vae", "imitator_learning_rate"),
            "critic": OptimizerSpec(trainer.critic_optimizer, "critic", "critic_learning_rate"),
            "actor": OptimizerSpec(trainer.actor_optimizer, "actor", "actor_learning_rate"),
        },
        targets={"critic_target": "critic", "actor_target": "actor"},
        phases=(
            Phase(trainer.imitation_loss, ("vae",)),
            # Unbuffered (critic_loss's default): the candidate pass allocates, as vmap needs.
            # Looped members share the trainer's buffers: the pass runs without gradients and
            # its values are copied out before the next member's pass.
            Phase(
                trainer.critic_loss,
                ("critic",),
                start=cfg.rl_start_step,
                targets=("critic_target",),
                looped_loss=functools.partial(trainer.critic_loss, buffered=True),
            ),
            Phase(
                trainer.policy_loss,
                ("actor",),
                every=cfg.update_actor_interval,
                start=cfg.rl_start_step,
                targets=("actor_target",),
            ),
        ),
        hyperparameters=trainer.hyperparameters(),
        metrics=METRICS,
        noise=trainer.draw_noise,
        carried=trainer.last_rl_metrics,
        restore=trainer.restore_rl_metrics,
    )
