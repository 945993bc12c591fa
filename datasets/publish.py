"""Publish transitions as a Minari dataset, written directly in Minari's own on-disk layout.

``publish_dataset`` takes offaug data (:class:`Transitions` in memory or :class:`ShardSet`
references; original data, augmented data or both) and writes ``root/<dataset_id>/`` so that
``minari.load_dataset(dataset_id)``, ``minari show`` and ``offaug.datasets.load_transitions``
read it like any dataset Minari made itself:

* ``data/metadata.json``: the keys Minari's ``create_dataset_from_buffers`` writes (totals,
  ``data_format``, ``jpeg_encoding``, serialised spaces, ``env_spec``, ``dataset_id``, authors,
  ``minari_version``, reference scores, ``dataset_size``) plus one ``offaug`` key with the
  provenance (:func:`offaug.datasets.layout.minari_metadata`);
* the episodes in the chosen storage format (:mod:`offaug.datasets.storage.hdf5`: one
  ``main_data.hdf5``; :mod:`offaug.datasets.storage.arrow`: one folder per episode);
* ``README.md`` (the dataset card, :mod:`offaug.datasets.card`) and ``checksums.json``
  (``xxh3_128`` of every other file) next to ``data/``.

Episodes keep their N+1 observations: an episode's ``observations`` rows followed by the
``next_observation`` of its last row. That is exact only when every other ``next_observation``
equals the following row's observation, which is checked (:mod:`offaug.datasets.staging`).

**Per-step columns become step infos.** ``rollout_log_prob``, ``behaviour_log_prob``,
``importance_weight`` and ``source`` are written as ``infos/<name>``; extras named
``infos/<key>`` (e.g. ``infos/qpos``) as ``infos/<key>``. Minari stores infos with N+1 rows per
episode; offaug aligns them with the observations: **row t holds the value of the transition
that starts at observation t**, and the last row (the final observation, which starts no
transition) is padding: NaN for floats, -1 for signed integers, 0 for unsigned, False for
bools. This is how offaug's reader aligns ``infos/qpos`` (the simulator state *at* observation
t), so ``load_transitions(id, info_keys=[...])`` and :func:`load_published` return the
columns unchanged. (Minari's ``DataCollector`` fills row 0 from ``reset`` and row t+1 from
step t; a column read through Minari is indexed by the observation it belongs to instead.)
When parts differ in which of these columns they carry, the rows of a part without one are
filled: NaN log-probabilities, weight 1 (the sampler's convention), source -1 (unknown).

Everything is built in a hidden sibling directory and renamed into place
(:func:`offaug.datasets.atomic.staged_directory`); an existing id is refused unless
``overwrite``, and then replaced only once the new dataset is complete. Floats are stored in
the dtype the spaces declare (float64 for Hopper's observations); the widening from offaug's
float32 is exact, so reading the dataset back gives offaug's values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from offaug import __version__ as offaug_version
from offaug.datasets.atomic import json_default, staged_directory
from offaug.datasets.card import render_card
from offaug.datasets.errors import DataError
from offaug.datasets.layout import (
    CARD_NAME,
    CHECKSUMS_NAME,
    EXTRA_INFO_PREFIX,
    INFO_ALIGNMENT,
    METADATA_KEY,
    InfoColumn,
    Spaces,
    mark_namespaces,
    minari_metadata,
    read_metadata,
    resolve_spaces,
    validate_dataset_id,
)
from offaug.datasets.parts import (
    Part,
    PartInfo,
    PartStats,
    WeightStats,
    chunks,
    describe_part,
    info_columns,
    settle_extras,
    stored_bytes,
)
from offaug.datasets.paths import dataset_root, resolve_dataset_dir
from offaug.datasets.shards import CHECKSUM_ALGORITHM, file_checksum
from offaug.datasets.sources import load_transitions
from offaug.datasets.staging import stage
from offaug.datasets.storage import (
    EpisodeWriter,
    StorageBackend,
    StorageFormat,
    storage_backend,
)
from offaug.datasets.transitions import OPTIONAL_FIELDS, Transitions

__all__ = [
    "CARD_NAME",
    "CHECKSUMS_NAME",
    "METADATA_KEY",
    "PublishFormat",
    "PublishedDataset",
    "load_published",
    "publish_dataset",
    "verify_published",
]

PublishFormat = StorageFormat
"""The storage formats a dataset can be published in."""


@dataclasses.dataclass(frozen=True)
class PublishedDataset:
    """A small reference to a published dataset: what a pipeline stage returns."""

    dataset_id: str
    """The Minari id."""
    path: str
    """Absolute path of the dataset directory (holding ``data/``, the card and checksums)."""
    data_format: PublishFormat
    """Minari storage format."""
    episodes: int
    """Number of episodes."""
    steps: int
    """Number of steps (transitions)."""
    checksum: str
    """``xxh3_128`` of ``checksums.json``: one digest for the whole published content."""

    @property
    def data_dir(self) -> Path:
        """Minari's ``data/`` folder."""
        return Path(self.path) / "data"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


def _meta_value(parts: Sequence[PartInfo], key: str) -> Any:
    return parts[0].meta.get(key)


def publish_dataset(
    parts: Sequence[Part],
    dataset_id: str,
    *,
    root: str | Path | None = None,
    data_format: PublishFormat = "hdf5",
    overwrite: bool = False,
    env_spec: str | None = None,
    eval_env_spec: str | None = None,
    observation_space: str | None = None,
    action_space: str | None = None,
    ref_min_score: float | None = None,
    ref_max_score: float | None = None,
    author: str | Sequence[str] | None = None,
    author_email: str | Sequence[str] | None = None,
    code_permalink: str | None = None,
    algorithm_name: str | None = None,
    description: str | None = None,
    requirements: Sequence[str] | None = None,
    provenance: Mapping[str, Any] | None = None,
    card: str | None = None,
) -> PublishedDataset:
    """Write ``parts`` as the Minari dataset ``dataset_id`` (see the module docstring).

    Args:
        parts: The data, in order: each part's episodes become consecutive Minari episodes.
            Shard sets are read shard by shard (checksums verified).
        dataset_id: Minari id, ``[namespace/]name-vK``.
        root: Datasets root; default ``MINARI_DATASETS_PATH`` (or ``~/.minari/datasets``).
        data_format: ``"hdf5"`` or ``"arrow"``.
        overwrite: Replace an existing dataset once the new one is complete.
        env_spec: Serialised ``EnvSpec`` (JSON), default ``parts[0].meta["env_spec"]``.
        eval_env_spec: Serialised evaluation ``EnvSpec``, default from ``parts[0].meta``.
        observation_space: Minari-serialised space, default from ``parts[0].meta``.
        action_space: Minari-serialised space, default from ``parts[0].meta``.
        ref_min_score: Random-policy reference return; with ``ref_max_score``, default from
            ``parts[0].meta``. Written only when both are known.
        ref_max_score: Expert reference return.
        author: Minari's ``author`` (one name or several).
        author_email: Minari's ``author_email``.
        code_permalink: Minari's ``code_permalink``.
        algorithm_name: Minari's ``algorithm_name``.
        description: Minari's ``description`` (also the card's first paragraph).
        requirements: Minari's ``requirements`` (pip specifiers for ``recover_environment``).
        provenance: Where the data came from (source id and checksum, workflow hash, config,
            noise, ...). Stored under ``metadata.json["offaug"]["provenance"]`` and in the card,
            with offaug's version added.
        card: Extra Markdown for the card's "Notes" section.

    Returns:
        A :class:`PublishedDataset` reference.

    Raises:
        FileExistsError: The dataset exists and ``overwrite`` is false.
        DataError: The id is malformed or escapes the root, the spaces are missing or
            unsupported, or the data does not fit them (see the message's field).
    """
    if not parts:
        raise DataError("nothing to publish", field="parts")
    backend = storage_backend(data_format)
    validate_dataset_id(dataset_id)
    final = resolve_dataset_dir(dataset_id, root)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: dataset {dataset_id} exists; pass overwrite=True")

    infos = [describe_part(i, part) for i, part in enumerate(parts)]
    columns = info_columns(infos)
    observation_text, action_text = _space_texts(infos, observation_space, action_space)
    spaces = resolve_spaces(observation_text, action_text)
    if (ref_min_score is None) != (ref_max_score is None):
        raise DataError(
            "give both reference scores or neither", field="ref_min_score/ref_max_score"
        )
    if ref_min_score is None:
        ref_min_score = _meta_value(infos, "ref_min_score")
        ref_max_score = _meta_value(infos, "ref_max_score")
    described = {
        "spaces_text": (observation_text, action_text),
        "jpeg_encoding": not spaces.has_image,
        "env_spec": env_spec if env_spec is not None else _meta_value(infos, "env_spec"),
        "eval_env_spec": (
            eval_env_spec if eval_env_spec is not None else _meta_value(infos, "eval_env_spec")
        ),
        "ref_scores": (
            (float(ref_min_score), float(ref_max_score))
            if ref_min_score is not None and ref_max_score is not None
            else None
        ),
        "author": author,
        "author_email": author_email,
        "code_permalink": code_permalink,
        "algorithm_name": algorithm_name,
        "description": description,
        "requirements": requirements,
    }
    provenance_record = {**dict(provenance or {}), "offaug_version": offaug_version}

    with staged_directory(final, overwrite=overwrite) as staging:
        written = _write_episodes(parts, infos, spaces, columns, staging / "data", backend)
        checksum = _write_description(
            staging,
            written,
            dataset_id=dataset_id,
            data_format=data_format,
            spaces=spaces,
            provenance=provenance_record,
            card=card,
            **described,
        )
    mark_namespaces(dataset_root(root), dataset_id)
    return PublishedDataset(
        dataset_id=dataset_id,
        path=str(final),
        data_format=data_format,
        episodes=written.episodes,
        steps=written.steps,
        checksum=checksum,
    )


def _space_texts(
    infos: Sequence[PartInfo], observation_space: str | None, action_space: str | None
) -> tuple[str, str]:
    """The serialised spaces to publish: given, or ``parts[0].meta``'s; no part may disagree."""
    observation_text = observation_space or _meta_value(infos, "observation_space")
    action_text = action_space or _meta_value(infos, "action_space")
    if not observation_text or not action_text:
        raise DataError(
            "no observation/action space: parts[0].meta has none and none was passed",
            field="observation_space" if not observation_text else "action_space",
            hint="pass observation_space= and action_space= (Minari-serialised)",
        )
    for info in infos[1:]:
        for key, text in (("observation_space", observation_text), ("action_space", action_text)):
            theirs = info.meta.get(key)
            if theirs and theirs != text:
                raise DataError(
                    f"part {info.index} declares another {key} than the published one",
                    field=f"parts[{info.index}].meta[{key!r}]",
                    hint="publish parts of one environment together",
                )
    return str(observation_text), str(action_text)


@dataclasses.dataclass(frozen=True)
class _Written:
    """What :func:`_write_episodes` put under ``data/``."""

    parts: tuple[tuple[PartInfo, PartStats], ...]
    weights: WeightStats
    columns: tuple[InfoColumn, ...]
    """The info columns, with the extras' dtypes and shapes settled."""
    checksums: Mapping[str, str]
    """``{path under data/: xxh3_128}``."""
    data_bytes: int

    @property
    def episodes(self) -> int:
        return sum(stats.episodes for _, stats in self.parts)

    @property
    def steps(self) -> int:
        return sum(stats.rows for _, stats in self.parts)


def _write_episodes(
    parts: Sequence[Part],
    infos: Sequence[PartInfo],
    spaces: Spaces,
    columns: list[InfoColumn],
    data_dir: Path,
    backend: StorageBackend,
) -> _Written:
    """Every part's episodes, in order, as Minari episodes ``0 .. E-1`` under ``data_dir``."""
    data_dir.mkdir(parents=True)
    writer: EpisodeWriter | None = None
    part_stats: list[tuple[PartInfo, PartStats]] = []
    weights = WeightStats()
    try:
        for info, part in zip(infos, parts, strict=True):
            stats = PartStats()
            for chunk in chunks(part):
                if writer is None:
                    columns = settle_extras(columns, chunk)
                    expected_bytes = stored_bytes(infos, spaces, columns)
                    writer = backend.writer(
                        data_dir, spaces, columns, expected_bytes=expected_bytes
                    )
                writer.write(stage(chunk, spaces, columns, f"parts[{info.index}]"))
                stats.add(chunk)
                if chunk.importance_weight is not None:
                    weights.add(chunk.importance_weight)
            part_stats.append((info, stats))
        if writer is None:
            raise DataError("the parts hold no transitions", field="parts")
        checksums, data_bytes = writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return _Written(tuple(part_stats), weights, tuple(columns), checksums, data_bytes)


def _write_description(
    staging: Path,
    written: _Written,
    *,
    dataset_id: str,
    data_format: PublishFormat,
    spaces: Spaces,
    provenance: Mapping[str, Any],
    card: str | None,
    **minari_fields: Any,
) -> str:
    """``data/metadata.json``, the card and ``checksums.json``; returns the latter's digest."""
    offaug_metadata = {
        "provenance": dict(provenance),
        "parts": [
            {**info.description, "rows": stats.rows, "episodes": stats.episodes}
            for info, stats in written.parts
        ],
        "info_alignment": INFO_ALIGNMENT,
        "info_columns": {column.key: column.describe() for column in written.columns},
        "importance_weights": written.weights.summary(),
        "checksums": CHECKSUMS_NAME,
    }
    metadata = minari_metadata(
        dataset_id=dataset_id,
        data_format=data_format,
        episodes=written.episodes,
        steps=written.steps,
        offaug=offaug_metadata,
        **minari_fields,
    )
    # Minari's dataset_size: MB of everything under data/ (metadata.json included), to 0.1.
    draft = json.dumps(metadata, default=json_default)
    metadata["dataset_size"] = round((written.data_bytes + len(draft)) / 1e6, 1)
    files = {
        "data/metadata.json": json.dumps(metadata, default=json_default).encode(),
        CARD_NAME: render_card(
            dataset_id=dataset_id,
            metadata=metadata,
            spaces=spaces,
            parts=written.parts,
            columns=written.columns,
            weights=written.weights.summary(),
            provenance=provenance,
            card=card,
        ).encode(),
    }
    checksums = {f"data/{k}": v for k, v in written.checksums.items()}
    for relative, content in files.items():
        (staging / relative).write_bytes(content)
        checksums[relative] = str(xxhash.xxh3_128(content).hexdigest())
    listing = {"algorithm": CHECKSUM_ALGORITHM, "files": dict(sorted(checksums.items()))}
    listing_bytes = (json.dumps(listing, indent=1) + "\n").encode()
    (staging / CHECKSUMS_NAME).write_bytes(listing_bytes)
    return str(xxhash.xxh3_128(listing_bytes).hexdigest())


# --------------------------------------------------------------------------- reading back


def _dataset_dir(source: str | os.PathLike[str], root: str | Path | None) -> Path:
    path = Path(os.fspath(source)).expanduser()
    if path.is_dir():
        return path.absolute()
    return resolve_dataset_dir(os.fspath(source), root)


def verify_published(
    source: str | os.PathLike[str], *, root: str | Path | None = None
) -> list[tuple[str, str]]:
    """Check a published dataset against its ``checksums.json``.

    Args:
        source: The dataset directory or its Minari id (under ``root``).
        root: Datasets root for an id.

    Returns:
        ``(relative path, problem)`` for every missing, changed or unlisted file; empty when
        all match.

    Raises:
        DataError: No readable ``checksums.json`` (not published by offaug).
    """
    directory = _dataset_dir(source, root)
    listing = directory / CHECKSUMS_NAME
    try:
        recorded = json.loads(listing.read_text())["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(f"no readable {CHECKSUMS_NAME} ({exc})", path=listing) from exc
    problems: list[tuple[str, str]] = []
    for relative, digest in recorded.items():
        path = directory / relative
        if not path.is_file():
            problems.append((relative, "missing"))
        elif file_checksum(path) != digest:
            problems.append((relative, "checksum mismatch"))
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if path.is_file() and relative != CHECKSUMS_NAME and relative not in recorded:
            problems.append((relative, "not listed in checksums.json"))
    return problems


def load_published(
    source: str | os.PathLike[str], *, root: str | Path | None = None, **load_options: Any
) -> Transitions:
    """Read a published dataset back with its per-step infos as :class:`Transitions` columns.

    ``load_transitions`` reads the dataset like any Minari dataset; this also reads the infos
    that ``metadata.json["offaug"]["info_columns"]`` lists and puts them back where they came
    from (``importance_weight``, ``extras["infos/qpos"]``, ...), so that publishing then
    loading returns equal transitions.

    Args:
        source: The dataset directory or its Minari id (under ``root``).
        root: Datasets root for an id.
        **load_options: Passed to :func:`offaug.datasets.load_transitions` (``cache``, ...).
    """
    directory = _dataset_dir(source, root)
    metadata = read_metadata(directory / "data")
    described = (metadata.get(METADATA_KEY) or {}).get("info_columns", {})
    transitions = load_transitions(directory, info_keys=list(described), **load_options)
    restored: dict[str, Any] = {}
    extras = dict(transitions.extras)
    for key, column in described.items():
        values = extras.pop(f"{EXTRA_INFO_PREFIX}{key}")
        if column["column"] in OPTIONAL_FIELDS:
            restored[column["column"]] = values
        else:
            extras[column["column"]] = values
    return dataclasses.replace(transitions.with_columns(**restored), extras=extras)
