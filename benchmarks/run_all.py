"""Run every ``benchmarks/bench_*.py`` and collect their results.

Each script runs as its own subprocess (its stderr passes through, its stdout is parsed as one
JSON record per line). The results, the date and a description of the machine are written to
``benchmarks/results.json`` atomically, and ``benchmarks/RESULTS.md`` (a markdown table) is
generated from them. A script that fails or prints something that is not JSON is recorded
under ``failures``; the others still run, and the exit status is then 1.

Usage: ``python benchmarks/run_all.py [--quick] [--only io,rollout] [--output PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
PACKAGES = ("numpy", "torch", "pyarrow", "h5py", "minari", "d3rlpy", "gymnasium", "mujoco")


def log(message: str) -> None:
    """Progress on stderr."""
    print(f"[run_all {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    """The CPU model named in ``/proc/cpuinfo`` (or what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
    """The installed version of a distribution, or ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_description() -> dict[str, Any]:
    """CPU, cores, memory, OS and the versions of the libraries the benchmarks exercise."""
    memory_gb = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": memory_gb,
        "platform": platform.platform(),
        "python": platform.python_version(),
        **{name: package_version(name) for name in PACKAGES},
    }


def parse_records(stdout: str, script: str, problems: list[str]) -> list[dict[str, Any]]:
    """The benchmark records among a script's stdout lines; anything else goes to ``problems``."""
    records = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            problems.append(f"not a JSON line on stdout: {line[:200]!r}")
            continue
        if not isinstance(record, dict) or "benchmark" not in record:
            problems.append(f"not a benchmark record: {line[:200]!r}")
            continue
        record["script"] = script
        records.append(record)
    return records


def saved_run(script: Path, output: Path) -> dict[str, Any]:
    """A script's run from its saved stdout (a long run started by hand), as :func:`run_script`
    reports one; its records replace only the previous records of the same benchmark names."""
    problems: list[str] = []
    records = parse_records(output.read_text(), script.name, problems)
    finished = datetime.datetime.fromtimestamp(output.stat().st_mtime, datetime.timezone.utc)
    for record in records:
        record.setdefault("measured", finished.isoformat(timespec="seconds"))
    log(f"{script.name}: {len(records)} results read from {output}")
    return {
        "script": script.name,
        "returncode": 0,
        "seconds": 0.0,
        "records": records,
        "problems": problems,
        "partial": True,
    }


def run_script(
    script: Path, quick: bool, timeout: float | None, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """Run one benchmark script; return its records and, if it failed, why."""
    command = [sys.executable, str(script), *(["--quick"] if quick else []), *extra]
    log(f"running {' '.join([script.name, *command[2:]])}")
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        completed = subprocess.run(
            command,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            timeout=timeout,
            check=False,
        )
        stdout, returncode = completed.stdout, completed.returncode
    except subprocess.TimeoutExpired as exc:
        raw = exc.stdout or ""
        stdout = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        returncode = None
        problems.append(f"timed out after {timeout} s")
    records.extend(parse_records(stdout, script.name, problems))
    if returncode not in (0, None):
        problems.append(f"exited with status {returncode}")
    elapsed = time.perf_counter() - start
    log(
        f"{script.name}: {len(records)} results in {elapsed:.1f} s" + (" (FAILED)" * bool(problems))
    )
    return {
        "script": script.name,
        "returncode": returncode,
        "seconds": elapsed,
        "records": records,
        "problems": problems,
        "partial": bool(extra),
    }


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _number(value: Any) -> str:
    """Three significant digits with an SI suffix (12.3k, 4.56M); a dash when missing."""
    if not isinstance(value, (int, float)):
        return "–" if value is None else str(value)
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


def met(record: dict[str, Any]) -> bool | None:
    """Whether a record reached its goal ratio (``None`` without a goal or ratio).

    A record's own ``goal_met`` decides where the goal is more than the ratio (the augmentation
    records also need an interval above zero and a probability of improvement)."""
    if isinstance(record.get("goal_met"), bool):
        return bool(record["goal_met"])
    ratio, goal = record.get("ratio"), record.get("goal")
    absolute = record.get("absolute")
    if goal is None and isinstance(absolute, dict) and isinstance(absolute.get("goal_met"), bool):
        return bool(absolute["goal_met"])  # an absolute goal (bench_gpu: minutes per 1M steps)
    if not isinstance(ratio, (int, float)) or not isinstance(goal, (int, float)):
        return None
    if record.get("goal_direction") == "at most":
        return ratio <= goal
    return ratio >= goal


def markdown(report: dict[str, Any]) -> str:
    """The RESULTS.md table generated from a results.json report."""
    machine = report["machine"]
    lines = [
        "# offaug benchmark results",
        "",
        "<!-- Generated by benchmarks/run_all.py from benchmarks/results.json; do not edit. -->",
        "",
        f"Report of {report['date']} ({report['mode']} size; each record's run time is in the "
        f"'measured' column) on {machine['cpu']}, "
        f"{machine['cores']} cores; Python {machine['python']}, numpy {machine['numpy']}, "
        f"torch {machine['torch']}, pyarrow {machine['pyarrow']}, h5py {machine['h5py']}, "
        f"minari {machine['minari']}, d3rlpy {machine['d3rlpy']}.",
        "",
        "Every ratio is offaug ÷ baseline, both measured in the same process, interleaved, "
        "median of the repeats (see the notes in results.json for what each side does).",
        "",
        "| benchmark | unit | offaug | baseline | ratio | goal | met? | measured |",
        "|---|---|---:|---:|---:|---:|:---:|---|",
    ]
    for record in report["results"]:
        reached = met(record)
        name = record.get("baseline_name")
        lines.append(
            f"| {record['benchmark']} | {record.get('unit', '')} | "
            f"{_number(record.get('offaug'))} | {_number(record.get('baseline'))}"
            f"{f' ({name})' if name else ''} | {_number(record.get('ratio'))} | "
            f"{_number(record.get('goal'))} | "
            f"{'–' if reached is None else ('yes' if reached else '**no**')} | "
            f"{_when(record.get('measured', report['date']))} |"
        )
    if report["failures"]:
        lines += ["", "## Failures", ""]
        for failure in report["failures"]:
            lines.append(f"- `{failure['script']}`: {'; '.join(failure['problems'])}")
    return "\n".join(lines) + "\n"


def _when(stamp: str) -> str:
    """``2026-11-29T16:27:40+00:00`` -> ``2026-11-29 16:27`` (a ``<= `` prefix is kept)."""
    prefix = "≤ " if stamp.startswith("<=") else ""
    text = stamp.removeprefix("<=").strip()
    return prefix + text[:16].replace("T", " ")


GPU_SCRIPTS = frozenset({"gpu"})
"""Scripts that need a CUDA device (left out of a full run without one)."""


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _short_name(name: str) -> str:
    """``bench_io.py``, ``bench_io`` and ``io`` all name the script ``io``."""
    return name.strip().removeprefix("bench_").removesuffix(".py")


def select_scripts(only: str, *, cuda: bool | None = None) -> list[Path]:
    """The ``bench_*.py`` scripts named in ``only`` (comma-separated), or all of them.

    Without ``only``, the scripts in :data:`GPU_SCRIPTS` run only when a CUDA device is there
    (``cuda``, asked of torch when None; name one in ``only`` to run it anyway, e.g. with
    ``--script-args 'gpu=--device cpu'``).
    """
    scripts = sorted(BENCH_DIR.glob("bench_*.py"))
    if only:
        wanted = {_short_name(name) for name in only.split(",")}
        return [s for s in scripts if _short_name(s.name) in wanted]
    if not (_cuda_available() if cuda is None else cuda):
        log(f"no CUDA device: leaving out {', '.join(sorted(GPU_SCRIPTS))}")
        return [s for s in scripts if _short_name(s.name) not in GPU_SCRIPTS]
    return scripts


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks, write results.json and RESULTS.md; 1 when any script failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every script")
    parser.add_argument(
        "--only", default="", help="comma-separated script names to run, e.g. io,rollout"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="results file (default results.json, or results-quick.json with --quick)",
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="markdown table (default RESULTS.md, or RESULTS-quick.md with --quick)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds per script")
    parser.add_argument(
        "--script-args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help=(
            "extra arguments for one script, e.g. 'learning=--envs Hopper-v5'; that script's "
            "records then replace only the previous records of the same benchmark names"
        ),
    )
    parser.add_argument(
        "--from-output",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help=(
            "merge the JSON lines a script printed in an earlier run (e.g. "
            "'augmentation=aug.jsonl') instead of running it; with --only"
        ),
    )
    args = parser.parse_args(argv)
    saved = {_short_name(n): Path(f) for n, _, f in (i.partition("=") for i in args.from_output)}
    extra: dict[str, list[str]] = {}
    for item in args.script_args:
        name, _, rest = item.partition("=")
        extra[_short_name(name)] = shlex.split(rest)

    scripts = select_scripts(args.only)
    if not scripts:
        log("no benchmark scripts to run")
        return 1
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    # Quick runs never overwrite the full-size figures the README's table comes from.
    suffix = "-quick" if args.quick else ""
    if args.output is None:
        args.output = BENCH_DIR / f"results{suffix}.json"
    if args.markdown is None:
        args.markdown = BENCH_DIR / f"RESULTS{suffix}.md"
    runs = [
        saved_run(script, saved[_short_name(script.name)])
        if _short_name(script.name) in saved
        else run_script(script, args.quick, args.timeout, extra.get(_short_name(script.name), []))
        for script in scripts
    ]
    for run in runs:
        for record in run["records"]:
            record.setdefault("measured", date)
    failures = [
        {k: run[k] for k in ("script", "returncode", "problems")} for run in runs if run["problems"]
    ]
    report: dict[str, Any] = {
        "date": date,
        "mode": "quick" if args.quick else "full",
        "machine": machine_description(),
        "results": [record for run in runs for record in run["records"]],
        "failures": failures,
        "scripts": {run["script"]: round(run["seconds"], 1) for run in runs},
    }
    if args.only and args.output.is_file():
        # A partial run keeps the other scripts' records from the previous report.
        previous = json.loads(args.output.read_text())
        rerun = {run["script"] for run in runs if not run["partial"]}
        fresh = {r.get("benchmark") for run in runs for r in run["records"]}
        kept = [
            r
            for r in previous.get("results", [])
            if r.get("script") not in rerun and r.get("benchmark") not in fresh
        ]
        for record in kept:
            # Reports before records were stamped: the run was at or before the report's date.
            record.setdefault("measured", f"<= {previous.get('date', '?')}")
        report["results"] = kept + report["results"]
        report["scripts"] = {**previous.get("scripts", {}), **report["scripts"]}
    write_atomic(args.output, json.dumps(report, indent=2) + "\n")
    write_atomic(args.markdown, markdown(report))
    log(f"wrote {args.output} and {args.markdown}")
    if failures:
        log(f"failed: {', '.join(str(f['script']) for f in failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
