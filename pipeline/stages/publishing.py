"""Publish datasets, shard sets and run directories as one Minari dataset (``offaug publish``).

A run directory stands for its source dataset, its augmented shard set, or both in that order
(``include``), and adds its workflow's name and hash to the provenance. Every part is recorded
in the provenance: shard sets with their source and shard checksums, datasets with their path.
The pipeline's own ``publish`` stage (:func:`publish_stage`) publishes a run's data the same way,
from its stage results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from offaug.datasets import (
    PublishedDataset,
    ShardSet,
    Transitions,
    load_transitions,
    publish_dataset,
    resolve_source,
)
from offaug.datasets.errors import DataError
from offaug.pipeline.contracts import AugmentedRef, DatasetRef
from offaug.pipeline.rundir.files import is_run_directory, read_stage_records, read_workflow
from offaug.pipeline.schema.run_sections import Include, PublishModel


def run_data(include: Include, source: str, augmented: str | None) -> list[str]:
    """A run's data to publish, in order: its source dataset and/or its augmented shard set.

    Raises:
        DataError: ``include`` asks for augmented data and the run made none.
    """
    parts = [source] if include in ("original", "both") else []
    if include in ("augmented", "both"):
        if augmented is None:
            raise DataError("the run made no augmented data", field=f"include={include!r}")
        parts.append(augmented)
    return parts


def expand_run_directories(
    sources: Sequence[str], include: Include = "both"
) -> tuple[list[str], dict[str, Any]]:
    """Replace each run directory in ``sources`` by its source dataset and/or shard set.

    Returns:
        The sources in order, and the provenance the run directories add (their workflow's
        ``workflow`` name and ``workflow_hash``).

    Raises:
        DataError: a run directory without the finished stage ``include`` asks for.
    """
    expanded: list[str] = []
    provenance: dict[str, Any] = {}
    for source in sources:
        if not is_run_directory(source):
            expanded.append(source)
            continue
        records = read_stage_records(source)
        augmented = None if include == "original" else records.result("rollout", AugmentedRef)
        expanded.extend(
            run_data(
                include,
                records.result("source", DatasetRef).source,
                None if augmented is None else augmented.directory,
            )
        )
        workflow = read_workflow(source)
        if workflow is not None:
            provenance.update({"workflow": workflow.name, "workflow_hash": workflow.digest()})
    return expanded, provenance


def load_parts(
    sources: Sequence[str], info_keys: Sequence[str] = ()
) -> tuple[list[Transitions | ShardSet], list[dict[str, Any]]]:
    """Open each source (shard sets stay on disk, datasets load) and describe it for provenance.

    Raises:
        DataError, DatasetNotFoundError: a source that cannot be read.
    """
    parts: list[Transitions | ShardSet] = []
    recorded: list[dict[str, Any]] = []
    for source in sources:
        resolved = resolve_source(source)
        if resolved.kind == "shards":
            shard_set = ShardSet.open(resolved.path)
            parts.append(shard_set)
            recorded.append(
                {
                    "name": source,
                    "kind": "shards",
                    "source": dict(shard_set.source),
                    "checksums": [ref.checksum for ref in shard_set.shards],
                }
            )
        else:
            parts.append(load_transitions(source, info_keys=info_keys))
            recorded.append({"name": source, "kind": resolved.kind, "path": str(resolved.path)})
    return parts, recorded


def publish_sources(
    sources: Sequence[str],
    dataset_id: str,
    *,
    include: Include = "both",
    info_keys: Sequence[str] = (),
    provenance: Mapping[str, Any] | None = None,
    root: str | Path | None = None,
    data_format: Literal["hdf5", "arrow"] = "hdf5",
    overwrite: bool = False,
    description: str | None = None,
    author: str | None = None,
    author_email: str | None = None,
    code_permalink: str | None = None,
    card: str | None = None,
) -> PublishedDataset:
    """Publish ``sources`` in order as the Minari dataset ``dataset_id``.

    Args:
        sources: Minari ids or directories, D4RL files, shard sets or run directories.
        dataset_id: Minari id to write, ``[namespace/]name-vK``.
        include: What a run directory contributes: original, augmented or both.
        info_keys: Also publish ``infos/KEY`` of Minari and D4RL sources.
        provenance: Extra provenance, merged over what the sources record.
        root, data_format, overwrite, description, author, author_email, code_permalink,
            card: As :func:`offaug.datasets.publish_dataset` takes them.

    Raises:
        DataError, DatasetNotFoundError, FileExistsError: as the sources and the writer do.
    """
    expanded, extra = expand_run_directories(sources, include)
    parts, recorded = load_parts(expanded, info_keys)
    return publish_dataset(
        parts,
        dataset_id,
        root=root,
        data_format=data_format,
        overwrite=overwrite,
        description=description,
        author=author,
        author_email=author_email,
        code_permalink=code_permalink,
        provenance={"sources": recorded, **extra, **(provenance or {})},
        card=card,
    )


def publish_stage(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    config: PublishModel,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    """The ``publish`` stage: a run's original and/or augmented data as a Minari dataset."""
    sources = run_data(
        config.include, data.source, None if augmented is None else augmented.directory
    )
    published = publish_sources(
        sources,
        config.dataset_id,
        provenance=provenance,
        root=config.root,
        data_format=config.format,
        overwrite=config.overwrite,
    )
    return {"dataset_id": config.dataset_id, "path": str(published.path), "include": config.include}
