"""Compiling a plan's kernels in parallel, before its first run launches them one by one.

A job compiles one kernel under one configuration without running it (Triton's `warmup`), filling the
same in-process and on-disk caches a launch would. Jobs run on a pool of threads: Triton's compiler spends
most of its time in its MLIR passes and in ptxas, outside the Python interpreter's lock, so threads compile
side by side; they need no CUDA context of their own, nothing is pickled, and a compiled kernel is ready in
this process at once (a worker process would leave it in the disk cache, to be loaded again here).
`EMBER_COMPILE_THREADS` sets the pool's size (1: one after another).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None  # one per process, whichever threads' plans it compiles
_pool_made = threading.Lock()


def threads() -> int:
    value = os.environ.get("EMBER_COMPILE_THREADS", "")
    return max(1, int(value)) if value.strip().isdigit() else min(16, os.cpu_count() or 1)


def run(jobs: list[Callable[[], object]]) -> None:
    """Run the jobs, in parallel where there are several; a job that fails is left for its launch, which
    fails again with its error where the user sees it."""
    global _pool
    if len(jobs) <= 1 or threads() <= 1:
        for job in jobs:
            _attempt(job)
        return
    with _pool_made:
        if _pool is None:
            _pool = ThreadPoolExecutor(threads(), thread_name_prefix="ember-compile")
    for future in [_pool.submit(_attempt, job) for job in jobs]:
        future.result()


def compile_and_load(fn, args: list, grid, options: dict) -> None:
    """Compile a Triton launch without running it, then make it ready to run: its binary loaded on the device
    and Triton's launcher for its signature built (a C compile the first time a signature is seen, which a
    first launch would otherwise do, one kernel after another)."""
    kernel = fn.warmup(*args, grid=grid, **options)
    init = getattr(kernel, "_init_handles", None)
    if init is not None:
        init()


def _attempt(job: Callable[[], object]) -> None:
    try:
        job()
    except Exception:  # e.g. a configuration needing more shared memory than this GPU has
        pass
