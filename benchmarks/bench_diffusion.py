"""The diffusion backend's cost: training the denoiser and sampling transitions, on this CPU.

offaug's side is the product's own stages (``pipeline/stages/rollouts.py``), as a workflow with
``rollout.backend: diffusion`` runs them: ``train_denoiser_stage`` (load the dataset, fit, save
the checkpoint) and ``diffusion_sample_task`` (load the checkpoint, sample, write one shard).
Baselines, in the same process, one torch thread, interleaved with offaug's side:

* ``bare_edm_training``: the same network and EDM loss in a plain torch loop on tensors already
  in memory (no dataset loading, no diffusers preconditioning calls, no checkpoint);
* ``bare_euler_sampler``: the same trained network in a plain Karras-schedule Euler loop with as
  many network evaluations (no diffusers scheduler, no un-standardising, no shard write).

The ratios are what the stages' loading, scheduler and writing cost over the bare work. The
``absolute`` fields are the figures a cost record needs: training seconds of the CPU default
config (timed over 3,000 steps and scaled to the default's) and sampling seconds per 100,000
transitions.

A third record is about quality, not speed: the quality report's dynamics error of the trained
denoiser's samples against that of the learned-dynamics ensemble (the model backend's defaults)
predicting the next state and reward at the same sampled (s, a), both stepped in the true env
(the denoiser trained once more, at the default's full steps); the goal is at most 2x.

Usage: ``python benchmarks/bench_diffusion.py [--quick]``; JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Reporter,
    ensure_dataset,
    interleave,
    log,
    one_cpu_thread,
    protect_stdout,
    scratch_dir,
    throughput_record,
)

PER_100K = 100_000
QUALITY_ROWS = 2000
"""Generated rows put back into the env for the dynamics-error record."""


def _bare_training(net: Any, vectors: Any, steps: int, batch_size: int) -> float:
    """Seconds of ``steps`` EDM steps on ``net``, written out in plain torch."""
    import torch

    from offaug.pipeline.models import diffusion as edm

    optimizer = torch.optim.Adam(net.parameters(), lr=3e-4)
    data = torch.as_tensor(vectors)
    started = time.perf_counter()
    for _ in range(steps):
        x = data[torch.randint(0, len(data), (batch_size,))]
        sigma = torch.exp(edm.P_MEAN + edm.P_STD * torch.randn(batch_size, 1))
        noisy = x + sigma * torch.randn_like(x)
        scale = sigma**2 + edm.SIGMA_DATA**2
        c_skip, c_out = edm.SIGMA_DATA**2 / scale, sigma * edm.SIGMA_DATA / scale.sqrt()
        out = net(noisy / scale.sqrt(), 0.25 * sigma.log())
        weight = scale / (sigma * edm.SIGMA_DATA) ** 2
        loss = (weight * (c_skip * noisy + c_out * out - x) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return time.perf_counter() - started


def _bare_sampling(model: Any, n: int, steps: int) -> float:
    """Seconds of ``n`` samples by a plain Euler loop over the Karras schedule."""
    import torch

    from offaug.pipeline.models import diffusion as edm

    net, dim = model.diffusion.net, model.layout.dim
    ramp = torch.linspace(0, 1, steps)
    lo, hi = edm.SIGMA_MIN ** (1 / edm.RHO), edm.SIGMA_MAX ** (1 / edm.RHO)
    sigmas = torch.cat([(hi + ramp * (lo - hi)) ** edm.RHO, torch.zeros(1)])
    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, n, 16_384):
            x = torch.randn(min(16_384, n - start), dim) * sigmas[0]
            for i in range(steps):
                sigma = sigmas[i].expand(len(x), 1)
                scale = sigma**2 + edm.SIGMA_DATA**2
                out = net(x / scale.sqrt(), 0.25 * sigma.log())
                denoised = (
                    edm.SIGMA_DATA**2 / scale * x + sigma * edm.SIGMA_DATA / scale.sqrt() * out
                )
                x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return time.perf_counter() - started


TIMED_STEPS = 3000
"""Training steps timed per repeat (the default's time is scaled from them)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a size that takes about a minute")
    args = parser.parse_args()
    reporter = Reporter(protect_stdout())
    one_cpu_thread()

    from offaug.datasets import load_transitions
    from offaug.pipeline.contracts import DatasetRef
    from offaug.pipeline.models.diffusion import (
        Diffusion,
        DiffusionConfig,
        TransitionLayout,
        load_diffusion,
    )
    from offaug.pipeline.schema.rollout_section import DiffusionModel, RolloutModel
    from offaug.pipeline.stages.rollouts import diffusion_sample_task, train_denoiser_stage

    defaults = DiffusionModel()
    steps = 150 if args.quick else TIMED_STEPS
    samples = 8_192 if args.quick else PER_100K
    repeats = 3
    generated = ensure_dataset("Hopper-v5", 10_000 if args.quick else 50_000, "hdf5", seed=0)
    data = load_transitions(generated.path)
    source = DatasetRef(str(generated.path), len(data), data.num_episodes, "", False, data.meta)
    settings = {"steps": steps, "samples": samples}
    config = RolloutModel(backend="diffusion", tasks=1, diffusion=settings)  # type: ignore[arg-type]
    size = {
        "dataset_rows": len(data),
        "width": defaults.width,
        "blocks": defaults.blocks,
        "batch_size": defaults.batch_size,
        "train_steps": steps,
        "samples": samples,
        "sampler_steps": defaults.sampler_steps,
    }
    with scratch_dir("bench-diffusion-") as workdir:
        checkpoint = workdir / "denoiser.pt"
        train_metrics: list[dict[str, Any]] = []

        def offaug_training() -> float:
            started = time.perf_counter()
            ref = train_denoiser_stage(source, config, str(checkpoint), 0)
            train_metrics.append(ref.metrics)
            return time.perf_counter() - started

        layout = TransitionLayout.of(data, delta=defaults.next_state == "delta")
        vectors = layout.standardise(data)

        def baseline_training() -> float:
            net = Diffusion(layout.dim, DiffusionConfig()).net
            return _bare_training(net, vectors, steps, defaults.batch_size)

        log(f"training: {steps} steps x {repeats} repeats a side")
        offaug_times, baseline_times = interleave(offaug_training, baseline_training, repeats)
        train_seconds = defaults.steps * statistics.median(offaug_times) / steps
        reporter.emit(
            throughput_record(
                benchmark="diffusion_train_hopper_cpu",
                unit="steps/s",
                work=steps,
                offaug_times=offaug_times,
                baseline_times=baseline_times,
                baseline_name="bare_edm_training",
                goal=None,
                size=size,
                notes=(
                    "train_denoiser_stage (load, fit, save) against the same network and EDM"
                    " loss in a plain torch loop on tensors in memory; one torch thread"
                ),
                absolute={
                    # The stage's time scaled to the CPU default's steps, spread over its samples.
                    "train_seconds_default_config": train_seconds,
                    "train_seconds_per_100k_samples_default_config": train_seconds
                    * PER_100K
                    / defaults.samples,
                    "stage_fit_seconds": [m["train_seconds"] for m in train_metrics],
                },
            )
        )

        trained = load_diffusion(checkpoint)
        if not args.quick:  # the quality record's denoiser is the default one, fully trained
            full = RolloutModel(backend="diffusion", tasks=1)
            log(f"quality: the default denoiser, {defaults.steps} steps")
            quality = load_diffusion(
                train_denoiser_stage(source, full, str(workdir / "full.pt"), 0).path
            )
        else:
            quality = trained

        def offaug_sampling() -> float:
            started = time.perf_counter()
            diffusion_sample_task(source, _ref(checkpoint), config, str(workdir / "s.arrow"), 0, 0)
            return time.perf_counter() - started

        def baseline_sampling() -> float:
            return _bare_sampling(trained, samples, defaults.sampler_steps)

        log(f"sampling: {samples} samples x {repeats} repeats a side")
        offaug_times, baseline_times = interleave(offaug_sampling, baseline_sampling, repeats)
        median = statistics.median(offaug_times)
        reporter.emit(
            throughput_record(
                benchmark="diffusion_sample_hopper_cpu",
                unit="samples/s",
                work=samples,
                offaug_times=offaug_times,
                baseline_times=baseline_times,
                baseline_name="bare_euler_sampler",
                goal=None,
                size=size,
                notes=(
                    "diffusion_sample_task (load the checkpoint, DPM-Solver++ 2M through"
                    " diffusers, un-standardise, write one shard) against a plain Euler loop"
                    " with as many network evaluations; one torch thread"
                ),
                absolute={
                    "sample_seconds_per_100k_samples": median * PER_100K / samples,
                    "baseline_seconds_per_100k_samples": statistics.median(baseline_times)
                    * PER_100K
                    / samples,
                },
            )
        )

        size_quality = {**size, "train_steps": steps if args.quick else defaults.steps}
        reporter.emit(_dynamics_error_record(quality, data, args.quick, size_quality))


def _dynamics_error_record(trained: Any, data: Any, quick: bool, size: dict[str, Any]) -> Any:
    """The quality report's dynamics error of the denoiser's samples against the learned-dynamics
    ensemble's one-step predictions on the same (s, a): both put back into the true env
    (``quality_report`` rebuilds Hopper's state from the observation and steps the action)."""
    import dataclasses

    from offaug.pipeline.diagnostics.quality import QualitySettings, quality_report
    from offaug.pipeline.models.diffusion import generate
    from offaug.pipeline.models.dynamics import DynamicsConfig, train_dynamics
    from offaug.pipeline.schema.rollout_section import DynamicsModel

    rows = 500 if quick else QUALITY_ROWS
    dyn = DynamicsModel()
    config = DynamicsConfig(
        members=dyn.members, hidden=dyn.hidden, steps=500 if quick else dyn.steps, seed=0
    )
    log(f"dynamics error: an ensemble of {config.members} for {config.steps} steps, {rows} rows")
    started = time.perf_counter()
    ensemble, _ = train_dynamics(data, config)
    ensemble_seconds = time.perf_counter() - started
    samples = generate(trained, rows, seed=1, meta=data.meta)
    next_observations, rewards = ensemble.expected_step(samples.observations, samples.actions)
    # The same rows with the ensemble's s' and r: both reports step the same sampled rows.
    predicted = dataclasses.replace(samples, next_observations=next_observations, rewards=rewards)
    settings = QualitySettings(max_rows=rows, max_states=2000)
    reports = {
        "diffusion": quality_report(samples, data, settings=settings),
        "ensemble": quality_report(predicted, data, settings=settings),
    }
    errors = {}
    for name, report in reports.items():
        if report["dynamics_error"] is None:
            raise RuntimeError(f"no dynamics error for the {name} rows: {report['state']}")
        errors[name] = report["dynamics_error"]["median"]
    return {
        "benchmark": "diffusion_dynamics_error_vs_ensemble_hopper",
        "unit": "median dynamics error (RMS of (s'_env - s') / sigma)",
        "offaug": errors["diffusion"],
        "baseline": errors["ensemble"],
        "baseline_name": (
            f"the learned-dynamics ensemble's mean one-step prediction at the same (s, a)"
            f" ({config.members} x {list(config.hidden)}, {config.steps} steps)"
        ),
        "ratio": errors["diffusion"] / errors["ensemble"],
        "goal": 2.0,
        "goal_direction": "at most",
        "repeats": 1,
        "size": {**size, "quality_rows": rows, "ensemble_steps": config.steps},
        "absolute": {
            name: {
                "dynamics_error": report["dynamics_error"],
                "reward_error": report["reward_error"],
                "terminal_mismatch": report["terminal_mismatch"],
                "rows_checked": report["state"].get("rows_checked"),
                "rows_unset": report["state"].get("rows_unset"),
            }
            for name, report in reports.items()
        }
        | {"ensemble_train_seconds": ensemble_seconds},
        "notes": (
            "ratio = the denoiser's median dynamics error / the ensemble's on the same sampled"
            " (s, a) rows (issue 34: at most 2); the diffusion rows' own s' and r against the"
            " ensemble's members-mean prediction, each stepped in the true Hopper-v5"
        ),
    }


def _ref(checkpoint: Path) -> Any:
    from offaug.datasets.shards import file_checksum
    from offaug.pipeline.contracts import ModelRef

    return ModelRef("diffusion", str(checkpoint), file_checksum(checkpoint), {})


if __name__ == "__main__":
    main()
