"""K seeds of one learner trained in one process as one batched network, each member exactly
its single-seed run."""
