"""The equal-steps accounting of a plan: how many gradient steps each run spent in all.

An augmented arm is judged against plain learners trained for as many gradient steps as went
into it: its own, its rollout policy's (and every earlier round's), a plain run it continues
from, a dynamics model's or a denoiser's, and the BC clone's where the clone shapes its data.
:class:`StepAccount` records each stage's own steps as the planner adds it and walks a run's
dependencies to total them (:meth:`StepAccount.total_steps`).
"""

from __future__ import annotations

import dataclasses

from offaug.pipeline.contracts import is_plain
from offaug.pipeline.engine.stage_plan import Plan


@dataclasses.dataclass
class StepAccount:
    """Each stage's own gradient steps and what a run's steps depend on."""

    gradient_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    """Stage -> the gradient steps it trains one model for (BC, learners, dynamics, the
    denoiser)."""
    bc_stages: set[str] = dataclasses.field(default_factory=set)
    """The BC stages: counted in a run's steps only where the clone shapes its data."""
    bc_shapes_data: dict[str, bool] = dataclasses.field(default_factory=dict)
    """Recipe -> whether its augmented rows come from the BC clone or are weighted by its
    density (rollout.policy bc, or weighting behaviour)."""
    depends: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Stage -> what one seed's model depends on, where its stage's inputs say more (a
    fused seed's stage reads the fused stage, which reads every seed's rollouts)."""
    rollout_merges: set[str] = dataclasses.field(default_factory=set)
    """The rollout merges: the augmented data a run depends on."""

    def total_steps(self, plan: Plan, stage: str, count_bc: bool = True) -> tuple[int, list[str]]:
        """The gradient steps of every model ``stage``'s model depends on (itself included),
        each counted once, and the rollout merges among them in plan order. ``count_bc``
        False leaves the BC clone's steps out: a learner's rollouts carry the clone only for
        the diagnostics' behaviour density, which unweighted training never reads."""
        seen: set[str] = set()
        todo = [stage]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(self.depends.get(name, plan.stages[name].inputs))
        counted = seen if count_bc else seen - self.bc_stages
        steps = sum(self.gradient_steps.get(name, 0) for name in counted)
        return steps, [n for n in plan.names if n in seen and n in self.rollout_merges]

    def run_total(self, plan: Plan, stage: str, recipe: str) -> tuple[int, list[str]]:
        """:meth:`total_steps` of a run of ``recipe`` trained by ``stage``."""
        return self.total_steps(plan, stage, self.bc_shapes_data.get(recipe, True))

    def augmented_totals(self, plan: Plan) -> set[int]:
        """The total gradient steps of every augmented run in ``plan``'s index."""
        return {
            self.run_total(plan, run["stage"], run["recipe"])[0]
            for run in plan.index["runs"]
            if not is_plain(run["recipe"])
        }

    def account(self, plan: Plan) -> None:
        """Each run's total and own gradient steps and the rollouts it depends on, in the index."""
        for run in plan.index["runs"]:
            run["steps"], run["rollouts"] = self.run_total(plan, run["stage"], run["recipe"])
            run["own_steps"] = self.gradient_steps[run["stage"]]
