"""The workflow's ``rollout`` section: how augmented data is made (the simulator with a policy
and noise, a learned-dynamics ensemble, or a diffusion model), one pydantic model each, every
field documented. The other data sections are :mod:`offaug.pipeline.schema.sections`'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PlainSerializer,
    PlainValidator,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from offaug.algorithms.names import (
    OfflineLearner,
)
from offaug.pipeline.rollouts.noise import DEFAULT_NOISE, NoiseSpec, NoiseSpecError, parse_noise
from offaug.pipeline.schema.sections import StrictSection


def _noise_spec(value: Any) -> NoiseSpec:
    if isinstance(value, NoiseSpec):
        return value
    if not isinstance(value, str):
        raise ValueError(f"noise is a string such as 'gaussian:0.1', not {value!r}")
    try:
        return parse_noise(value)
    except NoiseSpecError as exc:
        raise ValueError(str(exc)) from exc


Noise = Annotated[
    NoiseSpec,
    PlainValidator(_noise_spec),
    PlainSerializer(lambda spec: spec.text, return_type=str),
    WithJsonSchema({"type": "string"}),
]
"""A noise specification: parsed once at validation, written back as the text it came from."""


class DynamicsModel(StrictSection):
    """The learned-dynamics ensemble (rollout backend 'model')."""

    members: int = Field(7, gt=0, description="Ensemble size.")
    hidden: tuple[int, ...] = Field((200, 200, 200), description="Hidden widths.")
    steps: int = Field(5000, gt=0, description="Training steps.")
    horizon: int = Field(
        5,
        gt=0,
        description=(
            "Model rollout length H (rollout.horizon replaces it when set; MOPO and MOBILE use"
            " 1 to 10)."
        ),
    )
    penalty: Literal["mopo", "mobile"] = Field(
        "mopo",
        description=(
            "The reward penalty: 'mopo', the largest predicted std over members (Yu et al."
            " 2020); 'mobile', the std over members of the Bellman target r + gamma * V(s')"
            " (Sun et al. 2023), V the rollout learner's own value (its critics at its action,"
            " IQL's V), so rollout.policy must be a learner that has one (iql, td3bc, cql, rebrac)."
        ),
    )
    penalty_coefficient: float = Field(
        1.0, ge=0, description="Its coefficient: MOPO's lambda, MOBILE's beta."
    )
    mobile_samples: int = Field(
        10, gt=0, description="MOBILE: draws of (s', r) per member averaged in its target."
    )
    starts: int = Field(1000, gt=0, description="Dataset states to branch from per task.")
    invariants: bool = Field(
        False,
        description=(
            "Project every predicted next state onto the quadratic functions of the observation"
            " that the data keeps constant (Pendulum's cos^2 + sin^2 = 1; none in most MuJoCo"
            " observations, which are then unchanged), so long rollouts and the search in the"
            " model stay on states the env can be in."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _number_is_mopo(cls, value: Any) -> Any:
        # Workflows written before there was a choice give MOPO's lambda as the penalty.
        if isinstance(value, Mapping) and isinstance(value.get("penalty"), (int, float)):
            value = dict(value)
            penalty = value.pop("penalty")
            if isinstance(penalty, bool):
                raise ValueError(f"penalty is 'mopo' or 'mobile', not {penalty!r}")
            value.setdefault("penalty_coefficient", float(penalty))
            value["penalty"] = "mopo"
        return value


class DiffusionModel(StrictSection):
    """The generative model of rollout backend 'diffusion' (SynthER): a denoiser trained on the
    dataset's transitions, then sampled. The defaults train in minutes on two CPU cores;
    SynthER's own sizes, for a GPU: width 2048, blocks 6, steps 100000, batch_size 1024,
    sampler_steps 128 (docs/rollouts.md)."""

    width: int = Field(256, gt=0, description="Width of the denoiser's residual blocks.")
    blocks: int = Field(3, gt=0, description="Residual blocks of the denoiser.")
    steps: int = Field(30_000, gt=0, description="Training steps (cosine learning-rate decay).")
    batch_size: int = Field(256, gt=0, description="Transitions per training step.")
    learning_rate: float = Field(3e-4, gt=0, description="Adam's initial learning rate.")
    samples: int = Field(
        100_000, gt=0, description="Transitions to generate in all, split over rollout.tasks."
    )
    sampler_steps: int = Field(
        32, gt=0, description="Solver steps from pure noise to a sample (DPM-Solver++ 2M)."
    )
    next_state: Literal["absolute", "delta"] = Field(
        "delta",
        description=(
            "How s' is modelled: absolute (SynthER) or delta, the change s' - s standardised"
            " on its own, as dynamics models predict it (docs/rollouts.md)."
        ),
    )
    seed: int | None = Field(
        None,
        description=(
            "Seed of the denoiser's training and sampling; null: the run's training seed (each"
            " seed of a several-seed run then trains its own denoiser)."
        ),
    )


class NoiseCalibrationModel(StrictSection):
    """Rollout noise chosen against the episode filter before rolling out."""

    scales: tuple[float, ...] = Field(
        min_length=1,
        description=(
            "Gaussian sigmas to try, largest first, in place of rollout.noise: the largest whose"
            " probe episodes the filter keeps often enough is used (the smallest when none is)."
        ),
    )
    episodes: int = Field(16, gt=0, description="Probe episodes per sigma.")
    keep: float = Field(
        0.5, gt=0, le=1, description="Share of the probe episodes the filter must keep."
    )

    @field_validator("scales")
    @classmethod
    def _positive(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if min(value) <= 0:
            raise ValueError(f"noise_calibration.scales must all be positive, not {list(value)}")
        return tuple(sorted(value, reverse=True))


class LookaheadModel(StrictSection):
    """The rollout algorithm's search (rollout.lookahead): how each episode is built."""

    candidates: int = Field(
        8,
        ge=2,
        description=(
            "Continuations compared at every decision point: the noiseless policy and"
            " candidates - 1 with noisy windows."
        ),
    )
    window: int = Field(
        10,
        gt=0,
        description="Steps committed per decision; the noisy candidates perturb only these.",
    )
    depth: int | None = Field(
        None,
        gt=0,
        description=(
            "Steps each continuation is simulated for from the decision point, the noiseless"
            " policy after the window (null: to the episode's end)."
        ),
    )
    bootstrap: bool = Field(
        False,
        description=(
            "Score each continuation by its discounted return over the depth plus gamma^depth"
            " V(s) of the rollout learner at the depth's end (its value and discount; none"
            " after a termination or at the time limit), so a short search sees what its end"
            " state is worth. Needs depth and a rollout.policy with a value (iql, td3bc, cql,"
            " rebrac)."
        ),
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A search without the bootstrap dumps, and so keys its stages, as it did before the
        # field existed: the finished stages of such a run are reused, not rerun.
        data: dict[str, Any] = handler(self)
        if not self.bootstrap:
            data.pop("bootstrap", None)
        return data


class RolloutModel(StrictSection):
    """Noisy rollouts of the BC policy, or of a trained learner's policy."""

    backend: Literal["simulator", "model", "diffusion", "none"] = Field(
        "simulator",
        description=(
            "The dataset's simulator, a learned dynamics ensemble, a diffusion model of the"
            " transitions that generates new ones (SynthER: the policy, noise, episode, start"
            " and filter fields do not apply, so a recipe may inherit them), or none (a recipe"
            " without rollouts)."
        ),
    )
    policy: OfflineLearner = Field(
        "bc",
        description=(
            "What the noise is centred on: 'bc' (the BC stage's clone) or a learner name (its"
            " policy trained on the original data with the same seed, e.g. bcq). log mu is the"
            " noise's density around that action; log beta_hat is always the BC density."
        ),
    )
    rounds: int = Field(
        1,
        ge=1,
        description=(
            "Rounds of train -> roll out -> retrain. Round 1 rolls out the policy (the BC clone,"
            " or the learner's plain run); each later round retrains it (the clone as learner"
            " bc) on the original data plus the previous round's rollouts (this recipe's train"
            " settings) and rolls that out. The last round's rollouts are the recipe's augmented"
            " data."
        ),
    )
    rounds_learner: OfflineLearner | None = Field(
        None,
        description=(
            "The learner each later round retrains (null: the rollout policy's own learner)."
            " With policy iql and rounds_learner bc, IQL's plain run rolls out in round 1 and BC,"
            " trained on the data and IQL's kept episodes, rolls out and improves on itself in"
            " the rounds after (needs rounds > 1)."
        ),
    )
    policy_steps: int | None = Field(
        None,
        gt=0,
        description=(
            "With a learner as the policy: the gradient steps of the run that rolls out (a plain"
            " run of that learner, recorded as baseline[STEPS]); null: the learner's plain run"
            " with train.steps. Counted in the augmented arms' total gradient steps."
        ),
    )
    noise: Noise = Field(
        DEFAULT_NOISE,
        description="gaussian:SIGMA, ou:SIGMA[:THETA], uniform, +epsilon:EPS, mixtures W*C+W*C.",
    )
    episodes: int = Field(100, gt=0, description="Episodes in total (simulator backend).")
    simulator_steps: int | None = Field(
        None,
        gt=0,
        description=(
            "The rollout's budget in simulator steps (env.step calls, dropped episodes"
            " included), in place of episodes (which is then not used; simulator backend):"
            " episodes start while budget is left, and those still running when it is spent end"
            " there as truncated. Split over the tasks like episodes."
        ),
    )
    tasks: int = Field(4, gt=0, description="Units of parallel work; one shard each.")
    n_envs: int = Field(16, gt=0, description="Environments stepped together per task.")
    start: Literal["reset", "dataset"] = Field(
        "reset",
        description=(
            "Start from env resets or branch from dataset states (MuJoCo qpos/qvel or a"
            " classic-control env's state, as the dataset records them)."
        ),
    )
    horizon: int | None = Field(
        None,
        gt=0,
        description=(
            "End every episode as truncated after H steps (short branched rollouts, as in"
            " MBPO/MOPO); null: at the time limit. The model backend uses it in place of"
            " dynamics.horizon when set."
        ),
    )
    starts: Literal["uniform", "sparse", "disagreement"] = Field(
        "uniform",
        description=(
            "Which dataset states branches start from: uniformly, 'sparse' (in proportion to"
            " each state's k-NN distance to the rest of the data, standardised), or"
            " 'disagreement' (model backend: in proportion to the ensemble's spread at the"
            " dataset action)."
        ),
    )
    filter: Literal["none", "data", "policy", "value"] = Field(
        "none",
        description=(
            "'data': drop augmented episodes that earn less than the data (a branch: the"
            " data's own continuation from its start over as many steps, or the data's mean"
            " reward per step times its length; a reset: the data's mean reward per step, or its"
            " mean episode return when the episode ended by termination). 'policy'"
            " (self-improvement): keep an episode only when its return beats the noiseless"
            " policy's from the same start (same reset seed, same dataset state); with rounds,"
            " policy iteration on real transitions. 'value' (start: dataset, a learner with a"
            " value as the policy: iql, td3bc, rebrac, cql): keep a branch of L steps only when"
            " its discounted return plus gamma^L V(s_L) of the learner's own value beats the"
            " data's discounted return-to-go from its start row. Both need the simulator backend."
        ),
    )
    filter_margin: float = Field(
        0.0,
        description=(
            "Reward per step an episode may fall short of the data (or its reference) by and"
            " still be kept (negative: it must beat it by that much)."
        ),
    )
    filter_tolerance: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description=(
            "Fraction of the data's expected return (its magnitude) an episode may fall short"
            " by and still be kept; unlike filter_margin it does not grow with the episode's"
            " length."
        ),
    )
    tries: int = Field(
        1,
        ge=1,
        description=(
            "Simulator backend: episodes per start (the same reset seed, or the same dataset"
            " row), each with its own noise; of those the filter keeps, only the one of highest"
            " return stays: best of K from every start, so hard starts are kept as often as"
            " easy ones. Counted in episodes (episodes 100, tries 4: 25 starts)."
        ),
    )
    keep_reference: bool = Field(
        False,
        description=(
            "filter 'policy' with tries > 1: the first try of every start is the noiseless"
            " policy itself (its return is the reference the noisy tries must beat, so no"
            " separate reference is rolled out) and it is kept where no noisy try beats it:"
            " every start keeps its best known episode, so a policy trained on the kept episodes"
            " sees every start, not only those where noise helped. Continuous actions only."
        ),
    )
    lookahead: LookaheadModel | None = Field(
        None,
        description=(
            "Build every episode by the rollout algorithm (Bertsekas): every window steps, the"
            " env's state is read and the candidates are simulated from it (the noiseless"
            " policy, and noisy windows followed by the policy), and the window of the one with"
            " the highest return over depth steps is committed. Every state an episode visits"
            " then carries an improved action. Simulator backend (envs whose state can be set:"
            " MuJoCo, classic control) or model backend (the search runs in the ensemble's mean"
            " prediction with the penalised reward, episodes start from dataset states and run"
            " rollout.horizon steps); continuous actions; filter 'none', tries 1."
        ),
    )
    noise_calibration: NoiseCalibrationModel | None = Field(
        None,
        description=(
            "Choose the Gaussian noise by probe episodes through the filter (needs a filter"
            " and the simulator backend), e.g. {scales: [0.1, 0.03, 0.01, 0.003]}: a policy"
            " whose noisy episodes all fail the filter adds nothing after it."
        ),
    )
    max_weight: float = Field(100.0, gt=0, description="Importance weights are clipped here.")
    max_episode_steps: int | None = Field(None, gt=0, description="Override the time limit.")
    env: str | None = Field(None, description="Roll out in this env id instead of the dataset's.")
    dynamics: DynamicsModel = Field(
        default_factory=DynamicsModel, description="Model backend settings."
    )
    diffusion: DiffusionModel = Field(
        default_factory=DiffusionModel, description="Diffusion backend settings."
    )

    @model_validator(mode="after")
    def _tasks_fit(self) -> RolloutModel:
        if self.simulator_steps is not None:
            if self.backend != "simulator":
                raise ValueError("simulator_steps is the simulator backend's budget")
            if self.tasks > self.simulator_steps:
                raise ValueError(
                    f"tasks ({self.tasks}) must not exceed simulator_steps ({self.simulator_steps})"
                )
        elif self.backend == "simulator" and self.tasks > self.episodes:
            raise ValueError(f"tasks ({self.tasks}) must not exceed episodes ({self.episodes})")
        if self.policy_steps is not None and self.policy == "bc":
            raise ValueError(
                "policy_steps is the budget of a learner that rolls out (policy: td3bc, say);"
                " the BC clone's is bc.steps"
            )
        if self.noise_calibration is not None and (
            self.filter == "none" or self.backend != "simulator"
        ):
            raise ValueError(
                "noise_calibration needs filter 'data', 'policy' or 'value' and backend"
                " 'simulator': it keeps the largest noise whose episodes the filter keeps"
            )
        if self.rounds_learner is not None and self.rounds == 1:
            raise ValueError(
                "rounds_learner is the learner later rounds retrain: it needs rounds > 1"
            )
        if self.tries > 1 and self.backend != "simulator":
            raise ValueError("tries is the simulator backend's: K episodes from each start")
        self._check_filter()
        self._check_lookahead()
        self._check_penalty()
        if self.starts == "disagreement" and self.backend != "model":
            raise ValueError("starts 'disagreement' needs backend 'model' (the ensemble)")
        if self.backend == "diffusion" and self.tasks > self.diffusion.samples:
            raise ValueError(
                f"tasks ({self.tasks}) must not exceed diffusion.samples ({self.diffusion.samples})"
            )
        return self

    def _check_filter(self) -> None:
        """The filters against the policy's own reference: where they can run."""
        if self.filter in ("policy", "value") and self.backend != "simulator":
            raise ValueError(
                f"filter '{self.filter}' needs backend 'simulator': its references are rolled"
                " out from the same starts in the dataset's simulator"
            )
        if self.filter == "value" and self.start != "dataset":
            raise ValueError(
                "filter 'value' needs start 'dataset': a branch is compared with the data's"
                " return-to-go from the row it starts at"
            )
        if self.keep_reference and (self.filter != "policy" or self.tries < 2):
            raise ValueError(
                "keep_reference needs filter 'policy' and tries > 1: the first try of each start"
                f" is the noiseless reference the other tries must beat (filter {self.filter!r},"
                f" tries {self.tries})"
            )
        if self.filter == "value":
            # Lazy: the registry imports torch; a workflow without this filter never pays.
            from offaug.algorithms.registry import state_value_refusal

            if (refusal := state_value_refusal(self.policy)) is not None:
                raise ValueError(f"rollout.policy {self.policy!r}: {refusal}")

    def _check_lookahead(self) -> None:
        """The search builds whole episodes itself: nothing else may select or budget them."""
        if self.lookahead is None:
            return
        if self.backend == "model" and self.horizon is None:
            raise ValueError(
                "lookahead with backend 'model' searches in the learned ensemble, which has no"
                " time limit of its own: set rollout.horizon (the steps of each episode, e.g. 50)"
            )
        if self.backend == "model" and self.tasks > self.episodes:
            raise ValueError(f"tasks ({self.tasks}) must not exceed episodes ({self.episodes})")
        clashes = {
            "backend": self.backend not in ("simulator", "model"),
            "filter": self.filter != "none",
            "tries": self.tries > 1,
            "simulator_steps": self.simulator_steps is not None,
            "noise_calibration": self.noise_calibration is not None,
        }
        named = [name for name, clash in clashes.items() if clash]
        if named:
            raise ValueError(
                "lookahead simulates its candidates (in the dataset's simulator, or the learned"
                " ensemble) and commits the best window itself: it needs backend 'simulator' or"
                " 'model', filter 'none', tries 1, no simulator_steps and no noise_calibration"
                f" (set: {', '.join(named)})"
            )
        if self.lookahead.bootstrap:
            if self.lookahead.depth is None:
                raise ValueError(
                    "lookahead.bootstrap adds V(s) at each candidate's depth: set"
                    " lookahead.depth (e.g. 30); without one every candidate runs to the"
                    " episode's end, where nothing is left to bootstrap"
                )
            self._check_policy_value("lookahead.bootstrap")

    def _check_penalty(self) -> None:
        """MOBILE's penalty needs V(s') of the rollout policy: a learner with a value."""
        if self.backend == "model" and self.dynamics.penalty == "mobile":
            self._check_policy_value("dynamics.penalty 'mobile'")

    def _check_policy_value(self, use: str) -> None:
        """``use`` reads V(s) of the rollout policy: refuse one without a value of its own."""
        # Lazy: the registry imports torch; a workflow that reads no value never pays.
        from offaug.algorithms.registry import state_value_refusal

        refusal = state_value_refusal(self.policy, use=use)
        if refusal is not None:
            clone = " (the BC clone has no critic)" if self.policy == "bc" else ""
            raise ValueError(f"rollout.policy {self.policy!r}{clone}: {refusal}")
