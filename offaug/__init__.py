"""offaug: offline reinforcement-learning data augmentation.

The code lives in three sub-packages, one per top-level folder of the repository:
``offaug.datasets`` (loading, shards, sampling, dataset generation), ``offaug.algorithms``
(the offline learners BC, CQL, BCQ, IQL, TD3+BC, ReBRAC and SAC, discrete CQL and BCQ, their
training loops, and online SAC for D4RL-style dataset levels) and ``offaug.pipeline`` (the
workflow's stages, the Dask graph that runs them, diagnostics and the report).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("offaug")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
