"""A metrics dict with every section, made by the diagnostics' own functions."""

from __future__ import annotations

from typing import Any

import numpy as np

from offaug.datasets import Transitions
from offaug.pipeline import diagnostics as diag


def _episodes(rng: np.random.Generator, lengths: list[int], shift: float) -> Transitions:
    n = sum(lengths)
    ids = np.repeat(np.arange(len(lengths)), lengths)
    observations = (rng.normal(size=(n, 3)) + shift).astype(np.float32)
    last = np.r_[ids[1:] != ids[:-1], True]
    log_ratio = rng.normal(0.0, 1.0, size=n)
    return Transitions(
        observations=observations,
        actions=rng.uniform(-1, 1, size=(n, 2)).astype(np.float32),
        rewards=rng.normal(1.0 + shift, 0.5, size=n).astype(np.float32),
        next_observations=observations,
        terminals=last & (rng.uniform(size=n) < 0.5),
        timeouts=last & ~(last & (rng.uniform(size=n) < 0.5)),
        episode_ids=ids.astype(np.int64),
        rollout_log_prob=np.zeros(n, dtype=np.float32),
        behaviour_log_prob=log_ratio.astype(np.float32),
        importance_weight=np.exp(np.minimum(log_ratio, np.log(10.0))).astype(np.float32),
    )


def full_metrics() -> dict[str, Any]:
    """A metrics dict with every section, made by the diagnostics' own functions."""
    rng = np.random.default_rng(0)
    original = _episodes(rng, [20, 35, 50, 12, 40, 33], 0.0)
    augmented = _episodes(rng, [15, 25, 30, 10], 0.7)
    mc = diag.discounted_returns(original.rewards, original.episode_ids, 0.99)
    q = mc + rng.normal(5.0, 2.0, size=len(mc))
    value_entry = {
        "dataset": diag.value_gap(q, mc),
        "rollout": diag.value_gap(q[:50] - 10, mc[:50]),
        "random_actions": {"q_dataset_actions": 3.0, "q_random_actions": 1.0, "difference": -2.0},
        "scatter": {
            "dataset": {"q": q.tolist(), "mc": mc.tolist()},
            "rollout": {"q": (q[:50] - 10).tolist(), "mc": mc[:50].tolist()},
        },
    }
    diagnostics = {
        "data": diag.data_section(original, augmented, 0.99, 20),
        "weights": diag.importance_weight_diagnostics([("shard-00000.arrow", augmented)], 10.0, 20),
        "coverage": diag.state_coverage(
            original.observations,
            augmented.observations,
            k=3,
            quantile=0.9,
            max_states=1000,
            rng=rng,
            bins=20,
        ),
        "divergence": {
            "states": 100,
            "dataset_nll": 1.5,
            "policies": {
                "bc": {"kind": "gaussian (beta_hat)", "nll": 1.2, "kl_monte_carlo": 0.0},
                "cql-augmented": {"kind": "deterministic (act)", "nll": 3.4},
            },
        },
        "value": {"cql-augmented": value_entry},
        "ope": {
            "settings": {"fqe_steps": 500, "fqe_tau": 0.1, "target_sigma": 0.2},
            "cql-augmented": {"fqe": 10.0, "wpdis": 8.0, "true_discounted_return": 9.0},
        },
        "ranking": diag.rank_results(
            [{"name": "cql-augmented", "mean_return": 9.0, "success_rate": 1.0, "mean_length": 30}]
        ),
        "timings": {"load": 0.5, "ope": 1.25},
    }
    return diag.jsonable(
        {
            "training": {
                "cql-plain": {"return": 100.0, "normalised_score": 10.0},
                "cql-augmented": {"return": 120.5, "normalised_score": 12.0},
                "bcq-plain": {"return": 90.0, "normalised_score": None},
            },
            "weights": {"n": 80, "ess_fraction": 0.4},
            "diagnostics": diagnostics,
        }
    )
