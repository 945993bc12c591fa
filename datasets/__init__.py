"""offaug's data layer: the transition contract, readers, shards and the sampler.

The names most users need::

    from offaug.datasets import load_transitions, Transitions, write_shard_set, MixtureSampler
"""

from offaug.datasets.errors import ChecksumError, DataError, DatasetNotFoundError
from offaug.datasets.generate import make_dataset
from offaug.datasets.publish import (
    PublishedDataset,
    load_published,
    publish_dataset,
    verify_published,
)
from offaug.datasets.sampler import Batch, MixtureSampler
from offaug.datasets.shards import ShardRef, ShardSet, read_shard, write_shard, write_shard_set
from offaug.datasets.sources import load_transitions, resolve_source
from offaug.datasets.transitions import (
    ALL_FIELDS,
    OPTIONAL_FIELDS,
    REQUIRED_FIELDS,
    Source,
    Transitions,
    concatenate,
)

__all__ = [
    "ALL_FIELDS",
    "OPTIONAL_FIELDS",
    "REQUIRED_FIELDS",
    "Batch",
    "ChecksumError",
    "DataError",
    "DatasetNotFoundError",
    "MixtureSampler",
    "PublishedDataset",
    "ShardRef",
    "ShardSet",
    "Source",
    "Transitions",
    "concatenate",
    "load_published",
    "load_transitions",
    "make_dataset",
    "publish_dataset",
    "read_shard",
    "resolve_source",
    "verify_published",
    "write_shard",
    "write_shard_set",
]
