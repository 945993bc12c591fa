"""offaug: offline reinforcement-learning data augmentation.

The code lives in three sub-packages, one per top-level folder of the repository:
``offaug.datasets`` (loading, shards, sampling), ``offaug.algorithms`` (BC, CQL, BCQ) and
``offaug.pipeline`` (stages and the Dask graph).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("offaug")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
