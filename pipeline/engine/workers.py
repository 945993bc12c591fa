"""What runs on a Dask worker before and around every stage; kept free of heavy imports.

Unpickling a task or a plugin on a worker imports the module that defines it. This module
imports only the standard library and ``distributed``, so the worker plugin registers in
milliseconds and the first stage starts at once; torch is imported in the background.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin


class WorkerSetup(WorkerPlugin):
    """A Dask worker plugin: pin torch and BLAS threads, and import torch in the background.

    Importing torch takes seconds; done in :meth:`setup` it held the whole run back (the
    client waits for every worker's setup) while the first stage, which needs no torch, could
    already run. So setup only pins the thread pools that are loaded and sets the OpenMP
    variables a later torch import reads, and a background thread imports torch while the
    first stages run. Each stage then pins torch and flushes denormals in its own thread
    (:func:`run_stage`): the flush-to-zero flag is per thread.
    """

    name = "offaug-worker-setup"

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def setup(self, worker: Any) -> None:
        from threadpoolctl import threadpool_limits

        for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[variable] = str(self.threads)
        threadpool_limits(limits=self.threads)
        threading.Thread(
            target=pin_torch, args=(self.threads,), name="offaug-import-torch", daemon=True
        ).start()


def pin_torch(threads: int) -> None:
    """Pin torch's thread pool and flush denormals in the calling thread (imports torch)."""
    from offaug.algorithms.runtime import configure_torch

    configure_torch(threads)


def run_stage(
    function: Callable[..., Any], threads: int, *args: Any
) -> tuple[Any, float, str | None]:
    """Run a stage function on a worker; return its result, seconds and the worker's address."""
    start = time.perf_counter()
    if "torch" in sys.modules:
        # Per thread (flush-to-zero) and cheap once torch is imported; a stage that imports
        # torch itself configures it where it trains (offaug.algorithms.training.loop).
        pin_torch(threads)
    result = function(*args)
    worker: str | None = None
    try:
        from distributed import get_worker

        worker = get_worker().address
    except ValueError:
        worker = None
    return result, time.perf_counter() - start, worker
