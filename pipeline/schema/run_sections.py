"""The sections of a workflow that say how policies are judged, what a run reports and where
it runs: evaluation, diagnostics, publish, report, cluster (one pydantic model each).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from offaug.pipeline.schema.rank_metric import RankMetric, parse_rank_metric
from offaug.pipeline.schema.sections import StrictSection


class EvaluationModel(StrictSection):
    """Evaluation of trained policies in the environment."""

    episodes: int = Field(
        10,
        gt=0,
        description="Episodes per evaluation of each trained policy (reset seeds from its training"
        " seed only, so every recipe of a seed is evaluated from the same starts).",
    )
    every: int = Field(
        0, ge=0, description="Evaluate every N training steps too (0: only at the end)."
    )


class DiagnosticsModel(StrictSection):
    """Distribution-shift diagnostics."""

    enabled: bool = Field(True, description="Run the diagnostics stage.")
    k: int = Field(5, gt=0, description="Neighbours for the out-of-distribution score.")
    quantile: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="OOD threshold: this quantile of the dataset's own k-NN distances.",
    )
    gamma: float = Field(0.99, gt=0, lt=1, description="Discount for Monte-Carlo returns.")
    max_states: int = Field(5000, gt=0, description="States sampled for the k-NN and value checks.")
    rank_metric: str | None = Field(
        None,
        description=(
            "Rank the trained policies by a weighted score of their evaluation episodes, e.g. "
            "'return:0.6,success:0.3,length:0.1' (metrics return, success, length; -NAME: lower "
            "is better). Unset: by mean return, then success rate, then length."
        ),
    )

    @field_validator("rank_metric")
    @classmethod
    def _check_rank_metric(cls, value: str | None) -> str | None:
        if value is not None:
            parse_rank_metric(value)  # RankMetricError is a ValueError: pydantic reports it
        return value

    @property
    def rank_weights(self) -> RankMetric | None:
        """``rank_metric`` parsed (None when unset)."""
        return None if self.rank_metric is None else parse_rank_metric(self.rank_metric)

    seeds: Literal["first", "all"] = Field(
        "first",
        description="Diagnose the policies and data of the first training seed only, or of all.",
    )


Include = Literal["original", "augmented", "both"]
"""What a run publishes: its original data, its augmented data, or both in that order."""


class PublishModel(StrictSection):
    """Publishing the augmented dataset as a Minari dataset."""

    dataset_id: str = Field(description="Minari id to write: [namespace/]name-vK.")
    include: Include = Field("both", description="Which data to publish.")
    format: Literal["hdf5", "arrow"] = Field("hdf5", description="Minari storage format.")
    overwrite: bool = Field(False, description="Replace an existing dataset with this id.")
    root: str | None = Field(None, description="Datasets root (default MINARI_DATASETS_PATH).")


class ReportModel(StrictSection):
    """What the run report shows beyond the metrics: videos and the dataset doctor."""

    videos: bool = Field(
        False,
        description=(
            "Film each trained policy's best and worst evaluation episode and a few original and"
            " augmented episodes (offscreen OpenGL; without it the report says so)."
        ),
    )
    best_video: bool = Field(
        True,
        description=(
            "Film the study's best policy (the arm with the highest IQM over its seeds, plain or"
            " augmented; the primary seed's run) in its best evaluation episode, shown below the"
            " report's opening verdict (offscreen rendering; without it the report says so)."
        ),
    )
    video_episodes: int = Field(
        2,
        gt=0,
        description=(
            "Episodes shown per trained policy and per kind of data, at evenly spaced return "
            "ranks: 1 the best, 2 the best and the worst, 3 adds the median."
        ),
    )
    max_report_mb: float = Field(
        20.0,
        gt=0,
        description=(
            "Bound on report.html: animations lose frames, then resolution, then whole episodes"
            " until it fits, and the report says what it left out."
        ),
    )
    width: int | None = Field(None, gt=0, description="Frame width (default the renderer's).")
    height: int | None = Field(None, gt=0, description="Frame height (default the renderer's).")
    frame_skip: int | None = Field(
        None, gt=0, description="Film every k-th step (default the renderer's)."
    )
    max_frames: int | None = Field(
        None, gt=0, description="At most this many frames per episode (default the renderer's)."
    )
    doctor: bool = Field(
        True, description="Run the dataset doctor on the source and on the augmented data."
    )


class ClusterModel(StrictSection):
    """Where the Dask graph runs."""

    kind: Literal["local", "address", "slurm", "kubernetes"] = Field(
        "local",
        description=(
            "A LocalCluster, an existing scheduler, or one built with dask-jobqueue / "
            "dask-kubernetes."
        ),
    )
    address: str | None = Field(
        None, description="Scheduler address (tcp://HOST:PORT) for kind 'address'."
    )
    workers: int | None = Field(None, gt=0, description="Workers (local: default one per core).")
    threads_per_worker: int = Field(1, gt=0, description="Threads per worker (and torch threads).")
    memory_limit: str = Field("auto", description="Memory per worker.")
    job: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for the SLURM/Kubernetes cluster class.",
    )

    @model_validator(mode="after")
    def _address_given(self) -> ClusterModel:
        if self.kind == "address" and not self.address:
            raise ValueError("cluster.kind 'address' needs cluster.address: tcp://HOST:PORT")
        return self
