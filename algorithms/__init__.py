"""offaug's learners: one file per algorithm (BC, CQL, BCQ and their discrete forms, SAC) on
shared networks, losses, distributions and CPU kernels; ``registry`` builds them by name and
``train`` runs the offline training loop."""
