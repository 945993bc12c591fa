"""The dataset card (``README.md``) of a published dataset.

:func:`render_card` says what the data is, where it came from, its parts, importance weights
and step infos, and how to load it. It reads the metadata :mod:`offaug.datasets.layout`
describes and the counts :mod:`offaug.datasets.parts` keeps.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from offaug.datasets.atomic import json_default
from offaug.datasets.layout import CHECKSUMS_NAME, INFO_ALIGNMENT, InfoColumn, Spaces
from offaug.datasets.parts import PartInfo, PartStats
from offaug.datasets.shards import CHECKSUM_ALGORITHM
from offaug.datasets.transitions import Source


def render_card(
    *,
    dataset_id: str,
    metadata: Mapping[str, Any],
    spaces: Spaces,
    parts: Sequence[tuple[PartInfo, PartStats]],
    columns: Sequence[InfoColumn],
    weights: Mapping[str, Any] | None,
    provenance: Mapping[str, Any],
    card: str | None,
) -> str:
    """The dataset card: what the data is, where it came from, how to load it."""
    data_format = metadata["data_format"]
    lines = [f"# {dataset_id}", ""]
    if metadata.get("description"):
        lines += [str(metadata["description"]), ""]
    lines += [
        f"Published by offaug {provenance['offaug_version']} in Minari's `{data_format}` layout "
        f"(Minari {metadata['minari_version']}).",
        "",
        "```python",
        "import minari",
        "from offaug.datasets.publish import load_published",
        "",
        f'dataset = minari.load_dataset("{dataset_id}")',
        f'transitions = load_published("{dataset_id}")  # per-step infos back as columns',
        "```",
        "",
        "## Contents",
        "",
        "| | |",
        "|---|---|",
        f"| episodes | {metadata['total_episodes']} |",
        f"| steps | {metadata['total_steps']} |",
    ]
    env_id = None
    if metadata.get("env_spec"):
        env_id = json.loads(metadata["env_spec"]).get("id")
    lines += [
        f"| environment | {env_id or 'not recorded'} |",
        f"| observation space | `{_one_line(spaces.observation_space)}` |",
        f"| action space | `{_one_line(spaces.action_space)}` |",
    ]
    if "ref_min_score" in metadata:
        lines.append(
            f"| reference scores | {metadata['ref_min_score']} (min) .. "
            f"{metadata['ref_max_score']} (max) |"
        )
    lines += ["", "## Parts", ""]
    lines += [
        "| part | kind | episodes | steps | mean return | sources | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for info, stats in parts:
        mean_return = stats.returns_sum / stats.episodes if stats.episodes else float("nan")
        sources = ", ".join(
            f"{_source_name(code)}: {count}" for code, count in sorted(stats.sources.items())
        )
        what = info.description.get("dataset_id") or info.description.get("directory") or ""
        lines.append(
            f"| {info.index} | {info.kind} | {stats.episodes} | {stats.rows} | "
            f"{mean_return:.4g} | {sources or 'not recorded'} | {what} |"
        )
    lines += ["", "## Importance weights", ""]
    if weights is None:
        lines.append("No part carries `importance_weight`.")
    else:
        lines += [
            "Over the rows that carry a weight: ESS = (Σw)² / Σw².",
            "",
            "| rows | mean | min | max | ESS | ESS / N |",
            "|---|---|---|---|---|---|",
            f"| {weights['rows']} | {weights['mean']:.4g} | {weights['min']:.4g} | "
            f"{weights['max']:.4g} | {weights['effective_sample_size']:.6g} | "
            f"{weights['ess_fraction']:.4f} |",
        ]
        per_part = [
            (info.index, stats.weights.summary()) for info, stats in parts if stats.weights.rows
        ]
        if len(per_part) > 1:
            lines += ["", "| part | rows | ESS | ESS / N |", "|---|---|---|---|"]
            for index, summary in per_part:
                assert summary is not None
                lines.append(
                    f"| {index} | {summary['rows']} | {summary['effective_sample_size']:.6g} | "
                    f"{summary['ess_fraction']:.4f} |"
                )
    lines += ["", "## Per-step infos", ""]
    if not columns:
        lines.append("None.")
    else:
        lines += [
            f"Alignment: {INFO_ALIGNMENT}.",
            "",
            "| info | from | dtype | shape | last-row pad | fill where a part lacks it |",
            "|---|---|---|---|---|---|",
        ]
        for column in columns:
            fill = "—" if column.missing_fill is None else str(column.missing_fill)
            lines.append(
                f"| `infos/{column.key}` | `{column.column}` | {column.dtype} | "
                f"{column.row_shape} | {column.pad} | {fill} |"
            )
    lines += ["", "## Provenance", ""]
    scalars = {k: v for k, v in provenance.items() if not isinstance(v, (Mapping, list, tuple))}
    for key, value in scalars.items():
        lines.append(f"- **{key}**: `{value}`")
    nested = {k: v for k, v in provenance.items() if k not in scalars}
    if nested:
        lines += [
            "",
            "```json",
            json.dumps(nested, indent=2, default=json_default, sort_keys=True),
            "```",
        ]
    lines += [
        "",
        "## Files",
        "",
        f"`{CHECKSUMS_NAME}` holds the {CHECKSUM_ALGORITHM} digest of every other file; "
        "`offaug.datasets.publish.verify_published` checks them.",
    ]
    if card:
        lines += ["", "## Notes", "", card.strip()]
    return "\n".join(lines) + "\n"


def _one_line(space: Any) -> str:
    return " ".join(repr(space).split())


def _source_name(code: int) -> str:
    try:
        return Source(code).name.lower()
    except ValueError:
        return f"unknown ({code})"
