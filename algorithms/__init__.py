"""offaug's learners and the training around them.

==============  =====================================================================
``nn``          networks, CPU kernels, action distributions and the action box
``learners``    one file per learner (BC, CQL, BCQ, IQL, TD3+BC, ReBRAC, SAC, the
                discrete CQL and BCQ) and the loss pieces they share
``training``    the offline training loop, importance weighting, state noise,
                ``torch.compile`` where it pays
``fused``       K seeds of one learner trained as one batched network
``online``      online SAC and the D4RL-style dataset levels made with it
==============  =====================================================================

Beside them: the trainer protocol and checkpoints (:mod:`.base`), process set-up
(:mod:`.runtime`), the numpy-to-torch boundary (:mod:`.batch`), how a learner describes its
update for fusing (:mod:`.fusing`), learners by name (:mod:`.registry`), data normalisation
(:mod:`.normalisation`) and evaluation with normalised scores (:mod:`.evaluate`).
"""
