"""offaug's learners and the training around them.

==============  =====================================================================
``nn``          networks, CPU kernels, action distributions and the action box
``learners``    one file per learner (BC, CQL, BCQ, IQL, TD3+BC, ReBRAC, SAC, the
                discrete CQL and BCQ) and the loss pieces they share
``fused``       K copies of a learner's update as one batched network (the fused
                trainer, its graph-safe step), each member exactly its single-seed run
``training``    the training loops (one seed; many seeds fused), importance weighting,
                state noise, the device sampler, compiled and captured steps
``online``      online SAC and the D4RL-style dataset levels made with it
==============  =====================================================================

Beside them: the trainer protocol and checkpoints (:mod:`.base`), process set-up
(:mod:`.runtime`), the numpy-to-torch boundary (:mod:`.batch`), how a learner describes its
update for fusing (:mod:`.fusing`), learners by name (:mod:`.registry`), data normalisation
(:mod:`.normalisation`), evaluation with normalised scores (:mod:`.evaluate`) and the names of
learners, weightings and dataset levels, importable without torch (:mod:`.names`).
"""
