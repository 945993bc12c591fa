"""Episodes built by the rollout algorithm: a search over short noisy windows, step by step.

Bertsekas' rollout algorithm (Bertsekas & Tsitsiklis 1996, "Neuro-Dynamic Programming", §6.1;
Bertsekas 2019, "Reinforcement Learning and Optimal Control", ch. 2) improves a base policy pi by
simulating it: at a state s, each candidate first move is followed by pi, and the move whose
simulated return is highest is taken. Rollout classification policy iteration (Lagoudakis & Parr
2003, "Reinforcement Learning as Classification: Leveraging Modern Classifiers") then trains the
next policy to copy the improved moves on the states they visit. Here, with ``rollout.lookahead``:

* every ``window`` steps of an episode the environment's state is read
  (:func:`~offaug.pipeline.rollouts.env_state.read_state`) and ``candidates`` continuations are
  simulated from it: candidate 0 is the noiseless policy (its noise centre), the others take
  ``window`` noisy actions (``rollout.noise``) and then follow the noiseless policy;
* each is scored by its return over ``depth`` steps from the decision point (to the episode's end
  when ``depth`` is None; nothing after a termination), or with ``bootstrap`` by its discounted
  return over the depth plus ``gamma^depth V(s_depth)``, ``V`` and ``gamma`` the rollout
  learner's own (no ``V`` after a termination, nor where the depth reaches the time limit):
  the rollout algorithm with a truncated horizon and a learned cost-to-go (Bertsekas 2019,
  §2.1), as MVE's H-step target (Feinberg et al. 2018) and ``filter: value``
  (:mod:`.references`) bootstrap a short branch, so a short search still sees what its
  window's end state is worth (a fall further on, say);
* the window of the best is committed to the episode (ties go to the policy itself), the
  environment continues from the state it reached, and the search repeats.

In a deterministic environment with ``depth`` to the end the committed episode's return is never
below the noiseless policy's from the same start: at each decision the policy's own continuation
of the previous choice is candidate 0. Unlike a filter that keeps whole noisy episodes, every
committed window is the best of its own decision, so a policy trained on these episodes has an
improved action to copy at every state it visits, not a small bias spread over 200 steps.

Every transition carries the same columns as a noisy pass (:mod:`.simulator`): ``log mu`` is the
noise's density of the committed action (at its centre for the policy's own windows, as
``keep_reference`` records them). The per-episode record is a :class:`FilterRecord` whose score is
the episode's return and whose reference is the noiseless policy's return from the same start
(rolled out to the end as the first decision's candidate 0), all kept. ``simulator_steps`` counts
every candidate's steps. Continuous actions only; envs whose state can be read and set (MuJoCo,
classic control).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

from offaug.pipeline.contracts import FilterRecord
from offaug.pipeline.rollouts.behaviour import RolloutPolicy, at_centre, noise_centre, policy_step
from offaug.pipeline.rollouts.config import (
    Fault,
    Lookahead,
    RolloutConfig,
    RolloutError,
    RolloutResult,
)
from offaug.pipeline.rollouts.data import RESET_START, draw_start_row
from offaug.pipeline.rollouts.env_state import (
    StartStates,
    StateError,
    env_state_kind,
    read_state,
    set_state,
)
from offaug.pipeline.rollouts.episodes import EpisodeStaging, simulator_transitions
from offaug.pipeline.rollouts.noise import ContinuousNoise
from offaug.pipeline.rollouts.references import DiscountedValue

StateRow = dict[str, npt.NDArray[Any]]
Outcome = tuple[npt.NDArray[Any], float, bool]
"""One env step: the next observation, the reward and whether the episode terminated."""


def lookahead_rollout(
    policy: RolloutPolicy,
    env_factory: Callable[[], Any],
    config: RolloutConfig,
    *,
    start_states: StartStates | None = None,
    start_probabilities: npt.NDArray[np.float64] | None = None,
    meta: Mapping[str, Any] | None = None,
    close_envs: bool = True,
    value: DiscountedValue | None = None,
) -> RolloutResult:
    """``config.episodes`` episodes, each built by the rollout algorithm's search
    (``config.lookahead``), ``config.n_envs`` episodes at a time.

    Args:
        policy: The base policy: its noise centre is followed, its noise perturbs the windows.
        env_factory: A zero-argument callable that makes one environment
            (``n_envs * candidates`` are made).
        config: Episodes, noise, seed, start, horizon and the search (``lookahead``).
        start_states: The dataset's states when ``config.start == "dataset"``.
        start_probabilities: (N,) how likely each start state is drawn (None: uniformly).
        meta: Copied into the result's ``Transitions.meta``.
        close_envs: Close the environments at the end (False when they come from a pool).
        value: The rollout learner's ``V(s)`` and discount: ``lookahead.bootstrap`` needs them.
    """
    search = config.lookahead
    if search is None:
        raise ValueError("lookahead_rollout needs config.lookahead")
    if search.candidates < 2 or search.window <= 0 or (search.depth or 1) <= 0:
        raise ValueError("lookahead needs candidates >= 2, window > 0 and depth > 0 (or None)")
    if config.filter != "none" or config.tries > 1 or config.keep_reference:
        raise ValueError(
            "lookahead chooses every window itself: it takes filter 'none', tries 1 and no"
            " keep_reference"
        )
    if config.simulator_steps is not None:
        raise ValueError("lookahead counts episodes: set episodes, not simulator_steps")
    if search.bootstrap and value is None:
        raise ValueError(
            "lookahead.bootstrap adds V(s) of the rollout learner at each candidate's depth: pass"
            " its value (rollout.policy a learner with one: iql, td3bc, cql, rebrac)"
        )
    if config.start == "dataset" and start_states is None:
        raise RolloutError("start='dataset' needs the dataset's recorded states (infos/...)")
    if policy.discrete:
        raise RolloutError(
            "rollout.lookahead perturbs continuous actions around the policy's own: it supports"
            " continuous action spaces only; remove lookahead for a discrete env"
        )
    with threadpool_limits(limits=1):
        starts = (start_states, start_probabilities)
        bootstrap = value if search.bootstrap else None
        run = _Search(policy, env_factory, config, search, starts, bootstrap)
        try:
            while run.started < config.episodes:
                run.episodes_batch(min(run.parallel, config.episodes - run.started))
            return run.result(meta)
        finally:
            if close_envs:
                for env in run.envs:
                    env.close()


@dataclasses.dataclass
class _Decision:
    """The candidates simulated from one decision point of ``n`` episodes (rows: episode-major,
    ``candidates`` per episode)."""

    scores: npt.NDArray[np.float64]
    """(rows,) return over the depth (discounted with ``bootstrap``, ``V`` added once every
    candidate has run); -inf where the candidate failed."""
    totals: npt.NDArray[np.float64]
    """(rows,) return over every simulated step (the reference's whole episode)."""
    window: dict[str, npt.NDArray[Any]]
    """column -> (rows, window, ...) the first ``window`` transitions of every candidate."""
    window_steps: npt.NDArray[np.int64]
    """(rows,) how many of them each candidate took (fewer where it terminated)."""
    ended: npt.NDArray[np.bool_]
    """(rows,) it terminated within the window."""
    states: list[StateRow | None]
    """Each candidate's state at the window's end (None: it ended or failed)."""
    depth_observations: npt.NDArray[np.float32]
    """(rows, obs) each candidate's observation after its ``depth`` steps (``bootstrap``)."""
    bootstraps: npt.NDArray[np.bool_]
    """(rows,) the candidate reached its depth alive and short of the time limit: ``V`` of its
    observation there is added to its score (``bootstrap``)."""


class _Search:
    """The environments, noise and episodes of one lookahead rollout."""

    def __init__(
        self,
        policy: RolloutPolicy,
        env_factory: Callable[[], Any],
        config: RolloutConfig,
        search: Lookahead,
        starts: tuple[StartStates | None, npt.NDArray[np.float64] | None],
        value: DiscountedValue | None = None,
    ) -> None:
        self.policy, self.config, self.search = policy, config, search
        self.value = value
        """The rollout learner's value, bootstrapped at every candidate's depth (None: off)."""
        self.start_states, self.start_probabilities = starts
        self.rng = np.random.default_rng(config.seed)
        self.parallel = min(config.n_envs, config.episodes)
        self.k = search.candidates
        self.envs = [env_factory() for _ in range(self.parallel * self.k)]
        try:
            self.envs[0].reset(seed=config.seed)  # classic control has a state after a reset
            self.state_kind = env_state_kind(self.envs[0])
        except StateError as exc:
            raise RolloutError(f"rollout.lookahead reads and sets env states: {exc}") from exc
        self.observation_dim = int(np.prod(self.envs[0].observation_space.shape))
        action_dim = int(np.prod(self.envs[0].action_space.shape))
        self.noise = ContinuousNoise(config.noise, len(self.envs), action_dim, self.rng)
        spec_limit = getattr(self.envs[0].spec, "max_episode_steps", None)
        self.limit = config.max_episode_steps or spec_limit or 1000
        if config.horizon is not None:
            self.limit = min(self.limit, config.horizon)
        self.columns: dict[str, tuple[tuple[int, ...], Any]] = {
            "observations": ((self.observation_dim,), np.float32),
            "actions": ((action_dim,), np.float32),
            "rewards": ((), np.float32),
            "next_observations": ((self.observation_dim,), np.float32),
            "terminals": ((), np.bool_),
            "timeouts": ((), np.bool_),
            "rollout_log_prob": ((), np.float64),
            "behaviour_log_prob": ((), np.float64),
        }
        self.episodes = EpisodeStaging(self.columns, self.parallel, self.limit)
        self.references: list[float] = []
        """Per finished episode: the noiseless policy's return from the same start."""
        self.faults: list[Fault] = []
        self.started = 0
        self.simulator_steps = 0
        self.decisions = 0
        self.improved = 0
        """Decisions where a noisy window beat the policy's own continuation."""
        self.gain = 0.0
        """Summed score of the chosen candidate over the policy's own, over every decision."""

    # -- one batch of episodes --------------------------------------------------------------------

    def episodes_batch(self, n: int) -> None:
        """Build ``n`` episodes side by side, decision by decision, and finish them in order."""
        seeds = np.zeros(n, dtype=np.int64)
        rows = np.full(n, RESET_START, dtype=np.int64)
        states: list[StateRow] = []
        for e in range(n):
            seeds[e] = int(self.config.seed * 100_003 + (self.started + e) * 7)
            env = self.envs[e * self.k]
            try:
                env.reset(seed=int(seeds[e]))
                if self.config.start == "dataset":
                    assert self.start_states is not None
                    rows[e] = draw_start_row(
                        self.rng, len(self.start_states), self.start_probabilities
                    )
                    set_state(env, self.start_states.kind, self.start_states.row(int(rows[e])))
            except StateError as exc:
                raise RolloutError(str(exc)) from exc
            states.append(read_state(env, self.state_kind))
        self.started += n
        alive = np.ones(n, dtype=bool)
        references = np.full(n, np.nan)
        t = 0
        while alive.any() and t < self.limit:
            episodes = np.flatnonzero(alive)
            decision = self._simulate(episodes, [states[e] for e in episodes], t)
            for j, e in enumerate(episodes.tolist()):
                block = slice(j * self.k, (j + 1) * self.k)
                if t == 0:
                    references[e] = decision.totals[block][0]
                scores = decision.scores[block]
                if not np.isfinite(scores).any():
                    # Every candidate failed here: the episode ends at its last committed step.
                    self.episodes.mark_last_timeout(e)
                    alive[e] = False
                    continue
                best = int(np.argmax(scores))  # the first of equals: the policy's own
                self.decisions += 1
                self.improved += int(best != 0)
                if np.isfinite(scores[0]):
                    self.gain += float(scores[best] - scores[0])
                row = j * self.k + best
                steps = int(decision.window_steps[row])
                self.episodes.record_steps(
                    e, {name: values[row] for name, values in decision.window.items()}, steps
                )
                chosen_state = decision.states[row]
                if decision.ended[row] or chosen_state is None:
                    alive[e] = False
                else:
                    states[e] = chosen_state
            t += self.search.window
        for e in range(n):
            if alive[e]:
                self.episodes.mark_last_timeout(e)  # the time limit (or horizon) ends it
            if self.episodes.lengths[e] > 0:
                self.references.append(float(references[e]))
            self.episodes.finish(e, int(rows[e]), int(seeds[e]))

    # -- one decision: every candidate of every episode, stepped together -------------------------

    def _simulate(
        self, episodes: npt.NDArray[np.int64], states: list[StateRow], t: int
    ) -> _Decision:
        """Simulate the candidates of ``episodes`` (at step ``t``, from ``states``)."""
        k, left = self.k, self.limit - t
        window = min(self.search.window, left)
        depth = min(self.search.depth or left, left)
        n_rows = len(episodes) * k
        envs = (episodes[:, None] * k + np.arange(k)[None, :]).reshape(-1)  # env per row
        candidate = np.tile(np.arange(k), len(episodes))
        # The first decision's policy continuation runs to the end: the episode's reference.
        caps = np.full(n_rows, max(depth, window))
        if t == 0:
            caps[candidate == 0] = left
        observations = np.zeros((n_rows, self.observation_dim), dtype=np.float32)
        for row, env_index in enumerate(envs.tolist()):
            env = self.envs[env_index]
            env.reset()  # a fresh time limit; the state set next replaces the reset's
            observations[row] = np.asarray(
                set_state(env, self.state_kind, states[row // k]), dtype=np.float32
            ).reshape(-1)
        self.noise.reset(envs)
        decision = _Decision(
            scores=np.zeros(n_rows),
            totals=np.zeros(n_rows),
            window={
                name: np.zeros((n_rows, window, *shape), dtype=dtype)
                for name, (shape, dtype) in self.columns.items()
            },
            window_steps=np.zeros(n_rows, dtype=np.int64),
            ended=np.zeros(n_rows, dtype=bool),
            states=[None] * n_rows,
            depth_observations=np.zeros((n_rows, self.observation_dim), dtype=np.float32),
            bootstraps=np.zeros(n_rows, dtype=bool),
        )
        active = np.ones(n_rows, dtype=bool)
        step = 0
        while active.any():
            rows = np.flatnonzero(active)
            current = observations[rows]
            mean, log_std = self.policy(current)
            centre = noise_centre(self.policy, current, mean)
            if not (np.isfinite(mean).all() and np.isfinite(centre).all()):
                raise RolloutError(
                    f"the policy returned NaN/inf during the lookahead at episode step {t + step};"
                    " the checkpoint is broken: retrain it"
                )
            assert log_std is not None
            chosen = policy_step(self.policy, self.noise, mean, log_std, envs[rows], centre)
            quiet = (candidate[rows] == 0) | (step >= window)
            if quiet.any():
                chosen = at_centre(self.policy, self.noise, chosen, quiet, mean, log_std, centre)
            outcomes = self._transitions(envs[rows], chosen.env_actions)
            for j, row in enumerate(rows.tolist()):
                self._record(
                    decision,
                    active,
                    observations,
                    (row, int(envs[row]), step),
                    (window, depth),
                    (chosen, j),
                    outcomes[j],
                )
            active &= step + 1 < caps
            step += 1
        if self.value is not None and depth < left:
            self._bootstrap(decision, depth)
        return decision

    def _bootstrap(self, decision: _Decision, depth: int) -> None:
        """Add ``gamma^depth V(s_depth)`` to the score of every candidate that reached its depth
        alive (one batched call of the learner's value)."""
        assert self.value is not None
        rows = np.flatnonzero(decision.bootstraps & np.isfinite(decision.scores))
        if len(rows) == 0:
            return
        values = np.asarray(
            self.value.value(decision.depth_observations[rows]), dtype=np.float64
        ).reshape(-1)
        if not np.isfinite(values).all():
            raise RolloutError(
                "the rollout learner's V(s) is NaN/inf at a lookahead candidate's depth; the"
                " checkpoint is broken: retrain it, or set rollout.lookahead.bootstrap false"
            )
        decision.scores[rows] += self.value.gamma**depth * values

    def _transitions(
        self, env_indices: npt.NDArray[np.int64], actions: npt.NDArray[Any]
    ) -> list[Outcome | Exception]:
        """Step the envs ``env_indices`` once each, with ``actions`` (one row each): by their
        class's ``step_batch`` where it has one (one call for all), else env by env."""
        envs = [self.envs[i] for i in env_indices.tolist()]
        self.simulator_steps += len(envs)
        step_batch = getattr(type(envs[0]), "step_batch", None)
        if step_batch is not None:
            return list(step_batch(envs, actions))
        outcomes: list[Outcome | Exception] = []
        for env, action in zip(envs, actions, strict=True):
            try:
                next_obs, reward, terminated, _, _ = env.step(action)
            except Exception as exc:  # arbitrary environment code: this candidate is out
                outcomes.append(exc)
                continue
            outcomes.append((np.asarray(next_obs), float(reward), bool(terminated)))
        return outcomes

    def _record(
        self,
        decision: _Decision,
        active: npt.NDArray[np.bool_],
        observations: npt.NDArray[np.float32],
        where: tuple[int, int, int],
        horizon: tuple[int, int],
        action: tuple[Any, int],
        outcome: Outcome | Exception,
    ) -> None:
        """Record what candidate ``row`` (on env ``env_index``, at search step ``step``) did:
        ``where`` is (row, env_index, step), ``horizon`` (window, depth)."""
        (row, env_index, step), (window, depth) = where, horizon
        chosen, j = action
        if isinstance(outcome, Exception):
            self.faults.append(Fault(type(outcome).__name__, str(outcome), env_index, step))
            self._fail(decision, active, row)
            return
        next_obs, reward, terminated = outcome
        next_observation = np.asarray(next_obs, dtype=np.float32).reshape(-1)
        if not (np.isfinite(next_observation).all() and np.isfinite(reward)):
            self.faults.append(Fault("NonFinite", "NaN/inf observation or reward", env_index, step))
            self._fail(decision, active, row)
            return
        if len(self.faults) > self.config.max_faults:
            raise RolloutError(f"{len(self.faults)} environment faults; last: {self.faults[-1]}")
        reward32 = float(np.float32(reward))
        decision.totals[row] += reward32
        if step < depth:
            discount = 1.0 if self.value is None else self.value.gamma**step
            decision.scores[row] += discount * reward32
            if step == depth - 1 and not terminated:
                decision.depth_observations[row] = next_observation
                decision.bootstraps[row] = True
        if step < window:
            values = {
                "observations": observations[row],
                "actions": chosen.env_actions[j],
                "rewards": reward32,
                "next_observations": next_observation,
                "terminals": bool(terminated),
                "timeouts": False,
                "rollout_log_prob": chosen.rollout_log_prob[j],
                "behaviour_log_prob": chosen.behaviour_log_prob[j],
            }
            for name, value in values.items():
                decision.window[name][row, step] = value
            decision.window_steps[row] = step + 1
            if terminated:
                decision.ended[row] = True
            elif step == window - 1:
                decision.states[row] = read_state(self.envs[env_index], self.state_kind)
        observations[row] = next_observation
        if terminated:
            active[row] = False

    def _fail(self, decision: _Decision, active: npt.NDArray[np.bool_], row: int) -> None:
        decision.scores[row] = decision.totals[row] = -np.inf
        decision.states[row] = None
        active[row] = False

    # -- the result -------------------------------------------------------------------------------

    def result(self, meta: Mapping[str, Any] | None) -> RolloutResult:
        """The built episodes as simulator transitions, with every weight column."""
        data = self.episodes.output.result()
        lengths = np.asarray(self.episodes.episode_lengths, dtype=np.int64)
        returns = np.asarray(self.episodes.returns, dtype=np.float64)
        search = {
            "decisions": self.decisions,
            "improved": self.improved,
            "mean_gain": self.gain / self.decisions if self.decisions else 0.0,
        }
        rollout_meta = {
            **self.config.to_json(),
            "faults": len(self.faults),
            "episodes_dropped": 0,
            "lookahead_search": search,
        }
        transitions, weights = simulator_transitions(
            data, lengths, {**dict(meta or {}), "rollout": rollout_meta}, self.config.max_weight
        )
        record = FilterRecord(
            scores=tuple(returns.tolist()),
            references=tuple(self.references),
            kept=(True,) * len(returns),
            reset_seeds=tuple(int(s) for s in self.episodes.reset_seeds),
            start_rows=tuple(int(r) for r in self.episodes.start_rows),
        )
        return RolloutResult(
            transitions,
            self.faults,
            returns.tolist(),
            weights.stats,
            [],
            0,
            record,
            self.simulator_steps,
        )
