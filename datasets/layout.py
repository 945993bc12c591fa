"""Minari's dataset layout as offaug reads and writes it: metadata, spaces, N+1 rows, infos.

* **Metadata**: ``data/metadata.json`` holds the keys Minari's ``create_dataset_from_buffers``
  writes (:func:`minari_metadata`, in its order) plus, for datasets offaug published, one
  :data:`METADATA_KEY` entry with the provenance and the info columns (Minari keeps unknown
  keys and ignores them).
* **Spaces**: serialised with ``minari.serialization``; offaug handles Box, Discrete and
  Dict-of-Box observations and Box or Discrete actions. A Dict observation is stored leaf by
  leaf and flattened, for offaug, in the space's own key order (:class:`Leaf`).
* **N+1 rows**: an episode of N steps stores N+1 observations (its last is the final
  observation) and N actions, rewards, terminations and truncations. A transition's
  ``next_observation`` is the stored row after its ``observation``, never across an episode
  boundary (:func:`transition_rows`, :class:`StoredEpisodes`).
* **Step infos**: ``infos/<key>`` also holds N+1 rows. Row t holds the value of the transition
  that starts at observation t (for ``qpos``/``qvel``: the simulator state *at* observation
  t); the last row, the final observation, is padding (:attr:`InfoColumn.pad`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt
from minari.dataset.minari_dataset import parse_dataset_id
from minari.dataset.minari_storage import is_image_space
from minari.namespace import NAMESPACE_METADATA_FILENAME
from minari.serialization import deserialize_space

from offaug.datasets.atomic import write_text_atomic
from offaug.datasets.errors import DataError

METADATA_NAME = "metadata.json"
"""Minari's metadata file, in ``data/`` (and one per episode in the Arrow layout)."""
CARD_NAME = "README.md"
"""The dataset card of a published dataset, next to ``data/``."""
CHECKSUMS_NAME = "checksums.json"
"""The digest of every other file of a published dataset, next to ``data/``."""
METADATA_KEY = "offaug"
"""The key of ``metadata.json`` that holds offaug's provenance and info-column description."""
INFO_ALIGNMENT = (
    "infos row t holds the value of the transition that starts at observation t; the last row "
    "of every episode (its final observation) is padding"
)
EXTRA_INFO_PREFIX = "infos/"
"""How :class:`Transitions` extras that are step infos are named (``infos/qpos``)."""
STEP_KEYS = ("actions", "rewards", "terminations", "truncations")
"""The per-step arrays of a Minari episode (N rows), besides the N+1 observations."""


# --------------------------------------------------------------------------- metadata


def data_dir_of(path: Path) -> Path:
    """The ``data/`` directory of a Minari dataset given the dataset or its ``data/`` folder."""
    if (path / METADATA_NAME).is_file():
        return path
    if (path / "data" / METADATA_NAME).is_file():
        return path / "data"
    raise DataError(
        "not a Minari dataset: no metadata.json here or in data/",
        path=path,
        hint="pass the dataset directory (the one that holds data/) or a dataset id",
    )


def read_metadata(data_dir: Path) -> dict[str, Any]:
    """Minari's ``metadata.json`` of a dataset."""
    path = data_dir / METADATA_NAME
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        # ValueError covers JSON syntax errors and bytes that are not UTF-8.
        raise DataError(
            f"cannot read Minari metadata ({exc})",
            path=path,
            hint="the file is corrupted; re-download or regenerate the dataset",
        ) from exc


def _as_list(value: str | Sequence[str] | None) -> list[str] | None:
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


def minari_metadata(
    *,
    dataset_id: str,
    data_format: str,
    episodes: int,
    steps: int,
    spaces_text: tuple[str, str],
    jpeg_encoding: bool,
    env_spec: str | None,
    eval_env_spec: str | None,
    author: str | Sequence[str] | None,
    author_email: str | Sequence[str] | None,
    code_permalink: str | None,
    algorithm_name: str | None,
    description: str | None,
    ref_scores: tuple[float, float] | None,
    requirements: Sequence[str] | None,
    offaug: Mapping[str, Any],
) -> dict[str, Any]:
    """Minari's metadata keys, in the order ``create_dataset_from_buffers`` writes them."""
    metadata: dict[str, Any] = {
        "total_episodes": episodes,
        "total_steps": steps,
        "data_format": data_format,
        "jpeg_encoding": jpeg_encoding,
        "observation_space": spaces_text[0],
        "action_space": spaces_text[1],
    }
    if env_spec is not None:
        metadata["env_spec"] = env_spec
    metadata["dataset_id"] = dataset_id
    optional = {
        "code_permalink": code_permalink,
        "author": _as_list(author),
        "author_email": _as_list(author_email),
        "algorithm_name": algorithm_name,
        "description": description,
    }
    metadata.update({k: v for k, v in optional.items() if v is not None})
    metadata["minari_version"] = importlib.metadata.version("minari")
    if eval_env_spec is not None:
        metadata["eval_env_spec"] = eval_env_spec
    if ref_scores is not None:
        metadata["ref_max_score"] = ref_scores[1]
        metadata["ref_min_score"] = ref_scores[0]
    if requirements is not None:
        metadata["requirements"] = list(requirements)
    metadata[METADATA_KEY] = dict(offaug)
    return metadata


def validate_dataset_id(dataset_id: str) -> None:
    """Refuse an id Minari cannot parse (``[namespace/]name-vK``)."""
    try:
        parse_dataset_id(dataset_id)
    except (ValueError, TypeError) as exc:
        raise DataError(
            "not a Minari dataset id: [namespace/]name-vK",
            field=f"dataset_id={dataset_id!r}",
        ) from exc


def mark_namespaces(root: Path, dataset_id: str) -> None:
    """Mark each namespace of the id as Minari's ``create_namespace`` does (empty metadata)."""
    namespaces = dataset_id.split("/")[:-1]
    for depth in range(1, len(namespaces) + 1):
        marker = root.joinpath(*namespaces[:depth]) / NAMESPACE_METADATA_FILENAME
        if not marker.exists():
            try:
                write_text_atomic(marker, "{}")
            except OSError:  # cosmetic: Minari reads datasets without these markers
                return


# --------------------------------------------------------------------------- spaces


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One stored observation array: a Box/Discrete space or one leaf of a Dict space."""

    path: tuple[str, ...]
    """Keys from the Dict root (empty for a plain Box or Discrete space)."""
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    offset: int
    """First column of this leaf in offaug's flattened observation."""

    @property
    def width(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Spaces:
    """What a writer needs to know about the observation and action spaces."""

    observation_space: Any
    action_space: Any
    leaves: tuple[Leaf, ...]
    observation_discrete: bool
    observation_dict: bool
    action_shape: tuple[int, ...]
    action_dtype: np.dtype[Any]
    action_discrete: bool
    has_image: bool


def resolve_spaces(observation_text: str, action_text: str) -> Spaces:
    """Deserialise the spaces to publish and lay out their leaves.

    Raises:
        DataError: A space does not deserialise or is not one offaug publishes.
    """
    try:
        observation_space = deserialize_space(observation_text)
        action_space = deserialize_space(action_text)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise DataError(
            f"cannot deserialise the spaces ({exc})",
            field="observation_space/action_space",
            hint="pass Minari-serialised spaces (minari.serialization.serialize_space)",
        ) from exc
    leaves: list[Leaf] = []
    has_image = False

    def walk(space: Any, path: tuple[str, ...]) -> None:
        nonlocal has_image
        if isinstance(space, gym.spaces.Dict):
            for key, sub in space.spaces.items():
                walk(sub, (*path, str(key)))
        elif isinstance(space, gym.spaces.Box):
            offset = sum(leaf.width for leaf in leaves)
            leaves.append(Leaf(path, tuple(space.shape), np.dtype(space.dtype), offset))
            has_image = has_image or bool(is_image_space(space))
        elif isinstance(space, gym.spaces.Discrete) and not path:
            leaves.append(Leaf(path, (), np.dtype(space.dtype), 0))
        else:
            raise DataError(
                f"unsupported observation space {space}: offaug publishes Box, Discrete and "
                "Dict-of-Box observations",
                field="observation_space" + ("/" + "/".join(path) if path else ""),
            )

    walk(observation_space, ())
    if isinstance(action_space, gym.spaces.Box):
        action_discrete = False
        has_image = has_image or bool(is_image_space(action_space))
    elif isinstance(action_space, gym.spaces.Discrete):
        action_discrete = True
    else:
        raise DataError(
            f"unsupported action space {action_space}: offaug publishes Box and Discrete actions",
            field="action_space",
        )
    return Spaces(
        observation_space=observation_space,
        action_space=action_space,
        leaves=tuple(leaves),
        observation_discrete=isinstance(observation_space, gym.spaces.Discrete),
        observation_dict=isinstance(observation_space, gym.spaces.Dict),
        action_shape=tuple(action_space.shape or ()),
        action_dtype=np.dtype(action_space.dtype),
        action_discrete=action_discrete,
        has_image=has_image,
    )


def read_spaces(metadata: Mapping[str, Any], data_dir: Path) -> tuple[Any, Any]:
    """The observation and action spaces a dataset's metadata declares."""
    try:
        observation_space = deserialize_space(metadata["observation_space"])
        action_space = deserialize_space(metadata["action_space"])
    except KeyError as exc:
        raise DataError(
            "metadata has no serialised space", path=data_dir / METADATA_NAME, field=str(exc)
        ) from exc
    except (ValueError, TypeError, AttributeError) as exc:
        raise DataError(
            f"cannot parse the serialised spaces ({exc})",
            path=data_dir / METADATA_NAME,
            field="observation_space/action_space",
        ) from exc
    return observation_space, action_space


ObservationLayout = Sequence[tuple[str, tuple[int, ...]]]
"""``(leaf path, shape)`` of every stored observation array, ``""`` for a plain space."""


def flatten_layout(space: Any, prefix: str = "") -> list[tuple[str, tuple[int, ...]]]:
    """Leaf paths and shapes of an observation space, in Gymnasium's flattening order.

    A Dict space's leaves come in the space's own key order (the order
    ``gymnasium.spaces.flatten`` uses); the flattened observation concatenates them.
    """
    if isinstance(space, gym.spaces.Dict):
        out: list[tuple[str, tuple[int, ...]]] = []
        for key, sub in space.spaces.items():
            out.extend(flatten_layout(sub, f"{prefix}{key}/"))
        return out
    if isinstance(space, gym.spaces.Box):
        return [(prefix.rstrip("/"), tuple(space.shape))]
    if isinstance(space, gym.spaces.Discrete) and not prefix:
        return [("", ())]
    raise DataError(
        f"unsupported space {space}: offaug reads Box, Discrete and Dict-of-Box spaces",
        field=prefix.rstrip("/") or "observations",
    )


def check_action_space(space: Any) -> None:
    """Refuse an action space offaug cannot read."""
    if not isinstance(space, (gym.spaces.Box, gym.spaces.Discrete)):
        raise DataError(
            f"unsupported action space {space}: offaug reads Box and Discrete actions",
            field="actions",
        )


# --------------------------------------------------------------------------- N+1 rows, infos


@dataclasses.dataclass(frozen=True)
class InfoColumn:
    """One per-step column written as ``infos/<key>``."""

    key: str
    """Name under ``infos/``."""
    column: str
    """Contract column (``importance_weight``) or extra (``infos/qpos``) it comes from."""
    dtype: np.dtype[Any]
    row_shape: tuple[int, ...]
    missing_fill: float | int | None
    """Value for rows of a part that lacks the column (None: every part must have it)."""

    @property
    def pad(self) -> float | int | bool:
        """The value of the last (padding) row of every episode."""
        kind = self.dtype.kind
        if kind == "f":
            return math.nan
        if kind == "i":
            return -1
        if kind == "b":
            return False
        return 0

    def describe(self) -> dict[str, Any]:
        """What ``metadata.json["offaug"]["info_columns"]`` records of the column."""
        described: dict[str, Any] = {
            "column": self.column,
            "dtype": str(self.dtype),
            "shape": list(self.row_shape),
            "pad": str(self.pad),
        }
        if self.missing_fill is not None:
            described["missing_fill"] = str(self.missing_fill)
        return described


@dataclasses.dataclass(frozen=True)
class StoredEpisodes:
    """Whole episodes in Minari's per-episode layout, ready to be written.

    ``R`` steps in ``E`` episodes; episode ``e`` owns stored rows ``starts[e] + e`` to
    ``starts[e] + e + lengths[e]`` inclusive (N+1 rows) and step rows ``starts[e]`` to
    ``starts[e] + lengths[e]`` exclusive.
    """

    lengths: npt.NDArray[np.int64]  # (E,)
    starts: npt.NDArray[np.int64]  # (E,) first step row of each episode
    final_rows: npt.NDArray[np.int64]  # (E,) stored row of each episode's final observation
    step_rows: npt.NDArray[np.int64]  # (R,) stored row of each step
    observations: tuple[npt.NDArray[Any], ...]  # per leaf: (R + E, *leaf_shape), space dtype
    actions: npt.NDArray[Any]  # (R, *act), space dtype
    rewards: npt.NDArray[np.float64]  # (R,)
    terminations: npt.NDArray[np.bool_]  # (R,)
    truncations: npt.NDArray[np.bool_]  # (R,)
    infos: tuple[npt.NDArray[Any], ...]  # per info column: (R + E, *row_shape), padded

    @property
    def stored_rows(self) -> int:
        return int(self.step_rows.shape[0] + self.lengths.shape[0])

    def pad_steps(self, values: npt.NDArray[Any], pad: Any = 0) -> npt.NDArray[Any]:
        """A step column spread to the stored rows, ``pad`` on each episode's last row."""
        out = np.empty((self.stored_rows, *values.shape[1:]), dtype=values.dtype)
        out[self.step_rows] = values
        out[self.final_rows] = pad
        return out


def transition_rows(
    lengths: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Row indices into episodes' stacked N+1 observations: (current, next) per transition."""
    total = int(lengths.sum())
    stored_starts = np.concatenate(([0], np.cumsum(lengths + 1)[:-1]))
    step_starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    # Position of every step inside its own episode: 0, 1, ..., N_i - 1.
    within = np.arange(total, dtype=np.int64) - np.repeat(step_starts, lengths)
    current = np.repeat(stored_starts, lengths) + within
    return current, current + 1
