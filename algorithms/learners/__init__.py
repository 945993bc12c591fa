"""One file per offline learner (and SAC, the online one), with the loss pieces they share."""
