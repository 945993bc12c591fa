"""Learned models of a dataset that stand in for its simulator: the dynamics ensemble (MOPO,
MOBILE; rolled out by :mod:`offaug.pipeline.rollouts.model_rollouts`) and the transition
denoiser (SynthER), each trained, saved and loaded here."""
