"""The run directory: where every stage's outputs live, and the records stages pass on.

::

    RUN_DIR/
      workflow.yaml        the resolved workflow (every default filled in)
      stages.json          one record per finished stage: key, inputs, outputs, seconds, worker
      run.lock             held by the run in progress (host, pid, start time)
      metrics.json         training scores, weight statistics and diagnostics (documented schema)
      report.html          the self-contained report
      diagnostics.json     the default recipe's diagnostics (diagnostics/<stage>.json: others)
      videos/*.gif         the report's videos (report.videos)
      shards/augmented/    the augmented shard set (one shard per rollout task) + manifest
      models/bc/           the BC policy (checkpoint.pt, metrics.jsonl, config.json)
      models/dynamics.pt   the learned-dynamics ensemble (model backend only)
      models/denoiser.pt   the diffusion model of the transitions (diffusion backend only)
      models/<algo>-<data>/  one training run per learner and data: original / augmented
      logs/run.log         when runs started and finished, and locks taken over

Records are frozen dataclasses of paths, sizes and hashes, never arrays.
:mod:`offaug.pipeline.rundir.files` reads and writes what these paths hold.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """Paths inside one run directory."""

    root: Path
    shards_root: Path | None = None

    @property
    def workflow(self) -> Path:
        return self.root / "workflow.yaml"

    @property
    def stages(self) -> Path:
        return self.root / "stages.json"

    @property
    def lock(self) -> Path:
        return self.root / "run.lock"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    @property
    def diagnostics(self) -> Path:
        return self.root / "diagnostics.json"

    def diagnostics_of(self, stage: str) -> Path:
        """Where a diagnose stage other than the default recipe's first seed writes."""
        return self.root / "diagnostics" / f"{stage}.json"

    @property
    def videos(self) -> Path:
        return self.root / "videos"

    @property
    def augmented(self) -> Path:
        return (self.shards_root or self.root / "shards") / "augmented"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def model(self, name: str) -> Path:
        return self.models / name
