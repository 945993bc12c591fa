"""The training loops behind ``offaug train`` (one seed, and many seeds fused), with what they
apply to batches: importance weights, state noise, the device sampler, ``torch.compile`` and CUDA
graphs of the graph-safe step."""
