"""K copies of one learner's update as one batched network: the fused trainer, the stacked
parameters, the CQL and BCQ fused specs and the graph-safe step, each member exactly its
single-seed run. The loops that drive it are :mod:`offaug.algorithms.training`'s."""
