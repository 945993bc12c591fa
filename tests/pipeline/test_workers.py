"""A real Dask worker, started by a nanny as offaug's local cluster starts them, trains without
page-faulting its activations in again every step once offaug has set torch up there."""

from __future__ import annotations

import os
import resource

from distributed import Client, LocalCluster

from offaug.pipeline.engine.workers import pin_torch


def _faults_per_step(steps: int = 20) -> float:
    """Minor page faults per step of a loop that allocates and frees 2 MB activations."""
    import torch

    x, w = torch.randn(2048, 256), torch.randn(256, 256)
    # Warm-up steps grow the heap to its working size (after which nothing should fault).
    for _ in range(10):
        (x @ w).relu_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        (x @ w).relu_()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def _before_and_after_setup() -> tuple[str | None, float, float]:
    trim = os.environ.get("MALLOC_TRIM_THRESHOLD_")
    before = _faults_per_step()
    pin_torch(1)  # what every offaug stage runs first on a worker
    return trim, before, _faults_per_step()


def test_worker_setup_keeps_freed_memory_for_the_next_step() -> None:
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        trim, before, after = client.submit(_before_and_after_setup, pure=False).result()
    # Dask's nanny asks glibc to hand freed memory back at once: every 2 MB activation
    # is faulted in again, page by page (512 of them).
    assert trim == "65536"
    assert before > 100, before
    # ru_minflt counts the whole worker process: its Dask threads (heartbeats, comms) may fault
    # a page now and then on a busy machine, far below the 512 an activation costs.
    assert after < 10, after
