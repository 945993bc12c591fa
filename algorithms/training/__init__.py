"""The offline training loop behind ``offaug train``, with what it applies to batches: importance
weights, state noise and ``torch.compile``."""
