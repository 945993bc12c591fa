"""offaug's data layer: the transition contract, readers, shards and the sampler."""
