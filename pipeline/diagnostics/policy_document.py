"""The diagnostics schema, per-policy part: divergence from beta_hat, value, evaluation episodes,
OPE, ranking (TypedDicts).

The rest of the document is in :mod:`offaug.pipeline.diagnostics.document`.
"""

from __future__ import annotations

from typing import Any, TypedDict

# -- divergence -----------------------------------------------------------------------------------


class _PolicyDivergenceFields(TypedDict):
    kind: str
    """How the policy was treated: ``deterministic (act)``, ``gaussian (beta_hat)``, ..."""
    nll: float
    """-E_s log beta_hat(a|s) of the policy's actions (nats, normalised action box)."""
    kl_monte_carlo: float | None
    """Monte-Carlo KL(pi || beta_hat) at dataset states (None for a deterministic policy)."""
    action_distance: float
    """Mean L2 distance to the dataset action, normalised box (discrete: disagreement rate)."""


class PolicyDivergence(_PolicyDivergenceFields, total=False):
    """One policy's distance from the behaviour model beta_hat."""

    kl_on_rollout_states: float | None
    """Rollout policy only: mean(rollout_log_prob - behaviour_log_prob) on the states it
    visited (None without those log-probabilities)."""


class DivergenceSection(TypedDict):
    """``divergence``: every policy against beta_hat on the shared sample of dataset states."""

    states: int
    """Dataset states in the sample."""
    dataset_nll: float
    """-E log beta_hat(a_data|s): the reference level of ``nll``."""
    policies: dict[str, PolicyDivergence]
    """``bc`` (beta_hat itself), ``rollout`` (the noisy rollout policy mu, with augmented data)
    and every trained model."""


# -- value ----------------------------------------------------------------------------------------


class _ValueGapCount(TypedDict):
    n: int
    """Rows compared (0: no other field)."""


class ValueGap(_ValueGapCount, total=False):
    """Q-hat against discounted Monte-Carlo returns on some rows."""

    q_mean: float
    """Mean Q-hat."""
    mc_mean: float
    """Mean Monte-Carlo return."""
    gap_mean: float
    """Mean of Q - MC."""
    gap_std: float
    """Its standard deviation."""
    gap_median: float
    """Its median."""
    overestimated_fraction: float
    """Share of rows with Q > MC."""
    sign: str
    """``over``, ``under`` or ``exact`` (the sign of ``gap_mean``)."""
    complete_n: int
    """Rows whose MC return is complete (terminated, or >= 3 / (1 - gamma) steps left)."""
    complete_gap_mean: float | None
    """Mean gap over those rows (None without any)."""


class RandomActionGap(TypedDict):
    """Q-hat at uniform random actions against Q-hat at dataset actions, same states."""

    q_dataset_actions: float
    """Mean Q-hat at dataset actions."""
    q_random_actions: float
    """Mean Q-hat at random actions."""
    difference: float
    """Random minus dataset."""


class ScatterPoints(TypedDict):
    """Paired points of a Q-vs-MC scatter."""

    q: list[float]
    """Q-hat."""
    mc: list[float]
    """Monte-Carlo return."""


class ValueScatter(TypedDict):
    """At most ``scatter_points`` points of each comparison."""

    dataset: ScatterPoints
    """Dataset (s, a)."""
    rollout: ScatterPoints | None
    """Fresh evaluation episodes (None without an environment)."""


class ValueEntry(TypedDict):
    """One critic's value checks."""

    dataset: ValueGap
    """Q(s, a) at dataset (s, a) against the MC return from that step."""
    random_actions: RandomActionGap
    """Q at random against dataset actions."""
    rollout: ValueGap | None
    """Q(s, pi(s)) at states of fresh evaluation episodes (None without an environment)."""
    scatter: ValueScatter
    """Points for the report's scatter plot."""


# -- shared pieces --------------------------------------------------------------------------------


class EpisodeRecords(TypedDict):
    """Evaluation episodes of one policy."""

    returns: list[float]
    """Undiscounted return per episode."""
    lengths: list[int]
    """Steps per episode."""
    discounted_returns: list[float]
    """Discounted return per episode."""
    successes: list[bool]
    """``info["success"]`` at the last step, else "ran to the time limit"."""
    mean_return: float | None
    """Mean return (None without episodes)."""
    mean_discounted_return: float | None
    """Mean discounted return."""
    mean_length: float | None
    """Mean length."""
    success_rate: float | None
    """Share of successful episodes."""


class EvaluationEntry(EpisodeRecords):
    """``evaluation[model]``: fresh episodes of a trained policy from fixed reset seeds."""

    normalised_score: float | None
    """D4RL-normalised mean return (None without reference scores)."""


class CheckpointEvaluation(EpisodeRecords):
    """:func:`evaluate_checkpoint`'s result."""

    name: str
    """The checkpoint path."""
    path: str
    """The checkpoint path."""


class OpeEntry(TypedDict):
    """``ope[model]``: off-policy estimates of the policy's value against the truth."""

    fqe: float
    """Fitted-Q evaluation from the dataset's episode starts."""
    wpdis: float | None
    """Weighted per-decision importance sampling."""
    wpdis_ess_fraction: float | None
    """ESS / episodes of WPDIS's final weights."""
    true_discounted_return: float | None
    """Mean discounted return of the evaluation episodes (None without an environment)."""
    fqe_error: float | None
    """FQE minus the truth."""
    wpdis_error: float | None
    """WPDIS minus the truth."""


class OpeSettings(TypedDict):
    """``ope["settings"]``: how the estimates were made."""

    target_sigma: float
    """Std of the Gaussian standing in for a deterministic policy."""
    target_epsilon: float
    """Epsilon standing in for a discrete greedy policy."""
    fqe_steps: int
    """Adam steps of FQE."""
    fqe_tau: float
    """Polyak rate of FQE's target."""
    episodes: int
    """Dataset episodes in the shared sample."""
    transitions: int
    """Rows in the shared sample."""
    evaluation_max_length: int | None
    """Longest evaluation episode (FQE reads high against episodes cut by a time limit)."""


class WpdisResult(TypedDict):
    """:func:`weighted_per_decision_is`'s result."""

    estimate: float | None
    """The estimate (None without rows)."""
    episodes: int
    """Episodes used."""
    ess_fraction: float | None
    """ESS / episodes of the final weights."""


RankBy = TypedDict("RankBy", {"return": int, "success": int, "length": int})
"""A policy's rank on each criterion alone (1 is best; ties share the best rank)."""


class WeightedRanking(TypedDict):
    """A policy's weighted score (see :mod:`offaug.pipeline.schema.rank_metric` and
    :func:`~offaug.pipeline.diagnostics.ranking.weighted_scores`)."""

    metric: str
    """The weighting, normalised: e.g. ``return:0.6,success:0.3,length:0.1``."""
    score: float
    """Mean over start states of the weighted sum of the episode's scaled metrics (0 to 1)."""
    low: float
    """Lower end of the 95 % bootstrap interval (start states resampled)."""
    high: float
    """Upper end of that interval."""
    scaled_means: dict[str, float]
    """Each metric's mean on the common scale (0 worst to 1 best episode of any candidate)."""


class RankingEntry(TypedDict):
    """One entry of ``ranking``, best first."""

    name: Any
    """The policy's name (a checkpoint path for :func:`rank_checkpoints`)."""
    path: Any
    """Its checkpoint path, when known."""
    rank: int
    """1 is best: by the weighted score when there is one, else by mean return, then success
    rate, then length."""
    mean_return: Any
    """Mean return of its evaluation episodes."""
    mean_length: Any
    """Their mean length."""
    success_rate: Any
    """Their success rate."""
    rank_by: RankBy
    """Its rank on each criterion alone."""
    weighted: WeightedRanking | None
    """Its weighted score when ranked by a weighting (then ``rank`` follows it), else None."""


# -- a policy's part and the whole document -------------------------------------------------------


class PolicyPart(TypedDict):
    """:func:`diagnose_policy`'s result: one trained policy's checks, merged into the document."""

    name: str
    """The model's name."""
    divergence: PolicyDivergence
    """Its ``divergence.policies`` entry."""
    evaluation: EvaluationEntry | None
    """Its ``evaluation`` entry (None without an environment)."""
    value: ValueEntry | None
    """Its ``value`` entry (None without ``q_values``)."""
    ope: OpeEntry | None
    """Its ``ope`` entry (None without sampled rows)."""
    evaluation_max_length: int | None
    """Its longest evaluation episode."""
    seconds: float
    """Time taken."""
