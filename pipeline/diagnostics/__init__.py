"""Distribution-shift diagnostics: how far augmented data and trained policies move from the data.

One module per section of the output (typed in :mod:`.document` and
:mod:`.policy_document`):

========================  ==========================================================
:mod:`.document`          the output document as TypedDicts
:mod:`.policy_document`   its per-policy part: divergence, value, evaluation, OPE, ranking
:mod:`.settings`          :class:`DiagnosticsSettings`, the sizes the workflow does not set
:mod:`.sampling`          the shared sample of dataset episodes, batched policy calls, JSON
:mod:`.policy_models`     the action box, the behaviour model beta_hat, the rollout policy mu
:mod:`.data`              ``data``: dataset summaries
:mod:`.returns`           Monte-Carlo returns per episode
:mod:`.histograms`        quantiles and shared-edge histograms
:mod:`.importance`        ``weights``: importance weights, ESS, clipping
:mod:`.coverage`          ``coverage``: k-NN OOD score, range violations
:mod:`.divergence`        ``divergence``: each policy against beta_hat
:mod:`.value`             ``value``: Q-hat against Monte-Carlo returns
:mod:`.evaluation`        ``evaluation``: fresh episodes of each policy
:mod:`.ope`               ``ope``: FQE and WPDIS
:mod:`.ranking`           ``ranking`` (default or weighted); ranking many checkpoints
:mod:`.run`               the stages: :func:`run_diagnostics`, :func:`diagnose_policy`,
                          :func:`diagnose_run`
========================  ==========================================================

Each metric is also a pure function of arrays, tested on its own.
"""

from offaug.datasets.weights import effective_sample_size, effective_sample_size_from_logs
from offaug.pipeline.diagnostics.coverage import (
    knn_distances,
    range_violations,
    standardiser,
    state_coverage,
)
from offaug.pipeline.diagnostics.data import data_section, data_summary
from offaug.pipeline.diagnostics.divergence import policy_divergence
from offaug.pipeline.diagnostics.document import QUANTILE_LEVELS, SCHEMA_VERSION, Diagnostics
from offaug.pipeline.diagnostics.evaluation import (
    Episode,
    episode_records,
    evaluate_checkpoint,
    run_episodes,
)
from offaug.pipeline.diagnostics.histograms import quantiles, shared_histogram
from offaug.pipeline.diagnostics.importance import (
    episode_log_weights,
    importance_weight_diagnostics,
    log_weight_histogram,
    weight_summary,
)
from offaug.pipeline.diagnostics.ope import (
    fitted_q_evaluation,
    target_log_ratio,
    weighted_per_decision_is,
)
from offaug.pipeline.diagnostics.policy_models import ActionSpace, BehaviourModel
from offaug.pipeline.diagnostics.ranking import (
    WeightedScore,
    rank_checkpoints,
    rank_results,
    weighted_scores,
)
from offaug.pipeline.diagnostics.returns import (
    complete_returns,
    discounted_returns,
    steps_to_end,
)
from offaug.pipeline.diagnostics.run import diagnose_policy, diagnose_run, run_diagnostics
from offaug.pipeline.diagnostics.sampling import (
    batched_act,
    batched_q,
    jsonable,
    sample_episodes,
)
from offaug.pipeline.diagnostics.settings import DiagnosticsSettings
from offaug.pipeline.diagnostics.value import random_action_gap, value_gap

__all__ = [
    "QUANTILE_LEVELS",
    "SCHEMA_VERSION",
    "ActionSpace",
    "BehaviourModel",
    "Diagnostics",
    "DiagnosticsSettings",
    "Episode",
    "WeightedScore",
    "batched_act",
    "batched_q",
    "complete_returns",
    "data_section",
    "data_summary",
    "diagnose_policy",
    "diagnose_run",
    "discounted_returns",
    "effective_sample_size",
    "effective_sample_size_from_logs",
    "episode_log_weights",
    "episode_records",
    "evaluate_checkpoint",
    "fitted_q_evaluation",
    "importance_weight_diagnostics",
    "jsonable",
    "knn_distances",
    "log_weight_histogram",
    "policy_divergence",
    "quantiles",
    "random_action_gap",
    "range_violations",
    "rank_checkpoints",
    "rank_results",
    "run_diagnostics",
    "run_episodes",
    "sample_episodes",
    "shared_histogram",
    "standardiser",
    "state_coverage",
    "steps_to_end",
    "target_log_ratio",
    "value_gap",
    "weight_summary",
    "weighted_per_decision_is",
    "weighted_scores",
]
