"""Python's cyclic garbage collector, kept out of a lazy step's way.

A lazy training step allocates tens of thousands of short-lived graph objects (a ResNet-18 step about 10,000
nodes and 17,000 Tensors), and the collector's full passes, due every few steps, rescan the hundreds of
thousands of long-lived objects torch, triton and the model keep: a third of the step's host time. So once a
process has compiled a new plan, the objects alive then are moved out of the collector's sight (`gc.freeze`),
after a full collection (garbage is not frozen). The first `FREEZES` new plans of a process do it.

The cpu device compiles no plans: its evaluations count instead, and the 1st, 2nd, 4th, 8th... of a process
freeze (the first `FREEZES` of them).

A frozen object that later becomes part of an unreachable cycle (a dropped trainer holding its own bound
method, with its model and GPU buffers) is not collected while it is frozen, so ember thaws, collects and
freezes again (`refresh`): every `REFRESH_STEPS` lazy steps that are at least `REFRESH_SECONDS` apart, and
whenever a GPU allocation fails for want of memory, before it is tried again. `EMBER_GC_FREEZE=0` leaves the
collector as Python has it.
"""

from __future__ import annotations

import atexit
import gc
import os
import threading
import time

FREEZES = 16
REFRESH_STEPS = 500
REFRESH_SECONDS = 30.0
ENABLED = os.environ.get("EMBER_GC_FREEZE", "1") not in ("0", "")  # read once, at import

_freezes = 0
_steps = 0
_host_steps = 0  # lazy steps evaluated on the cpu device
_refreshed = time.monotonic()
_settling = threading.Lock()  # threads running plans at once freeze and refresh one at a time


def after_new_plan() -> None:
    """A plan was compiled: freeze what is alive now (the first FREEZES times)."""
    global _freezes
    if _freezes >= FREEZES or not ENABLED:
        return
    with _settling:
        if _freezes == 0:  # at exit the collector sees everything again, as extension modules expect
            atexit.register(gc.unfreeze)
        _freezes += 1
    _refreeze()


def after_step() -> None:
    """A lazy step ran a cached plan: now and then, let the collector see the frozen objects again."""
    global _steps
    if not _freezes:
        return
    _steps += 1
    if _steps >= REFRESH_STEPS and time.monotonic() - _refreshed >= REFRESH_SECONDS:
        _refreeze()


def after_host_step() -> None:
    """A lazy step was evaluated on the cpu device: freeze after the 1st, 2nd, 4th... of them (steps settle as
    plans do: the model, its optimizer's state, the data), else as after a cached plan's step."""
    global _host_steps
    _host_steps += 1
    if _host_steps & (_host_steps - 1) == 0 and _freezes < FREEZES:
        after_new_plan()
    else:
        after_step()


def refresh() -> bool:
    """Free what only unreachable cycles hold, frozen ones included once ember froze: whether anything was
    collected (so that memory may have been freed). A freeze the program made itself is left as it is."""
    return _refreeze() if _freezes else gc.collect() > 0


def _refreeze() -> bool:
    global _steps, _refreshed
    with _settling:
        gc.unfreeze()
        collected = gc.collect()
        gc.freeze()
        _steps, _refreshed = 0, time.monotonic()
    return collected > 0
