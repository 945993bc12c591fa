"""Process set-up for training, in one place: threads, denormals, kept memory, seeds, device.

Every training process (the ``offaug train`` command, an online run, every Dask stage) calls
:func:`configure_torch` before its first step; these switches are process-wide, so they live
here and not in a learner.
"""

from __future__ import annotations

import ctypes
import platform
import random
import sys

import numpy as np
import torch


def configure_torch(threads: int | None = None) -> None:
    """Set torch up for CPU training: flush denormals, pin the thread count and keep freed
    memory for reuse (:func:`keep_freed_memory`).

    Without flushing, CPU training slows several-fold as small weights and gradients become
    denormal floats. ``threads`` is set deliberately: in a Dask worker it should be 1.
    """
    torch.set_flush_denormal(True)
    if threads is not None:
        torch.set_num_threads(threads)
    keep_freed_memory()


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
HEAP_ALLOCATION_LIMIT = 32 * 2**20
"""Allocations up to this size come from the heap, not from a fresh ``mmap`` (glibc's cap)."""
KEPT_FREE_BYTES = 256 * 2**20
"""Freed heap memory glibc keeps for reuse before it hands any back to the kernel."""


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of returning it to the kernel.

    A training step frees and allocates the same activation-sized buffers every step. Returned
    to the kernel, they are page-faulted (and zeroed) in again on the next step; Dask's nanny
    starts its workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which returns almost everything.
    Process-wide; the process then holds up to :data:`KEPT_FREE_BYTES` more than it uses.
    Returns whether the settings took (False where the C library is not glibc).
    """
    return set_malloc(HEAP_ALLOCATION_LIMIT, KEPT_FREE_BYTES)


def set_malloc(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` (``mallopt``), process-wide;
    False, changing nothing, where the C library is not glibc."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, numpy and torch; return a torch generator for the trainer's own draws."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 - third-party code draws from the global RNG
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def choose_device(device: str | None = None) -> torch.device:
    """The device to train on, chosen once: ``device`` if given, else CUDA when present."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
