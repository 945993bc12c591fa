"""Augmented data from rollouts: noise around a policy, the behaviour model and importance
weights, the simulator loop and learned dynamics, and rollouts as tasks that write shards."""
