"""Runtime targets: what runs the plans of each compiler target, and which target realizes each device type's graphs.

The compiler's table (ember/compiler/targets) says what a target makes of a graph: the device type its code runs
on, the costs the planner assumes and the renderer of its source. This table says what runs the result: per
compiler target, the runtime module whose `run(order, keep)` realizes a pending graph with it (its plan through the
plan cache, what it generated loaded and launched) and returns the kept nodes' values by node id. That module is
imported when the target first realizes a graph, so torch and triton are imported only once a GPU value is needed.

- triton (device cuda): runtime/launcher.py launches the generated kernels, which runtime/disk.py loads, on the
  GPU; or, with `EMBER_INTERPRET=1` (read once, here: `running`), the interpreted variant of the same target:
  the same kernels through Triton's interpreter on torch CPU tensors (runtime/triton_interpreter.py), with
  nothing that needs a GPU (no ahead-of-time compiling, tuning or CUDA graphs). Code that behaves differently
  asks the target it runs (`for_plan`, `for_device`: its `interpret`), never the environment.
- reference (device cpu): runtime/reference.py evaluates the plan with NumPy.

Adding a target means one renderer module and one entry in the compiler's TARGETS, one runtime module and one
entry in TARGETS here (and in DEVICE_TARGETS for the device type it realizes).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember.errors import DeviceError

if TYPE_CHECKING:
    from types import ModuleType

    from ember.compiler import Plan
    from ember.ir import Node


@dataclass(frozen=True)
class RuntimeTarget:
    """What runs a compiler target's plans, and how."""

    name: str  # its compiler target, whose plans it runs
    runner: str  # the runtime module whose `run(order, keep)` realizes a graph with it
    interpret: bool = False  # Triton kernels run in Triton's interpreter, on torch CPU tensors

    def run(self, order: list[Node], keep: set[int]) -> dict:
        """Realize the pending graph `order`: the values of the nodes whose ids are in `keep`, by node id."""
        return self._runner.run(order, keep)

    @functools.cached_property
    def _runner(self) -> ModuleType:
        return importlib.import_module(self.runner)


TRITON = RuntimeTarget("triton", "ember.runtime.launcher")
INTERPRETED = dataclasses.replace(TRITON, interpret=True)  # the triton target's variant under EMBER_INTERPRET=1
REFERENCE = RuntimeTarget("reference", "ember.runtime.reference")

TARGETS = {"triton": TRITON, "reference": REFERENCE}  # per compiler target
DEVICE_TARGETS = {"cpu": "reference", "cuda": "triton"}  # the compiler target realizing each device type's graphs


@functools.cache
def running(name: str) -> RuntimeTarget:
    """The runtime target running compiler target `name`'s plans in this process: its entry in TARGETS, or for
    triton, under EMBER_INTERPRET=1, its interpreted variant. The variable is read once, when the target is first
    asked for (once a GPU value is needed): ember's choice alone, whatever Triton's own TRITON_INTERPRET says."""
    target = TARGETS[name]
    if target is TRITON and os.environ.get("EMBER_INTERPRET", "0") not in ("", "0"):
        return INTERPRETED
    return target


def for_plan(plan: Plan) -> RuntimeTarget:
    """The runtime target running `plan` (compiled for its compiler target)."""
    return running(plan.target)


def for_device(device_type: str) -> RuntimeTarget:
    """The runtime target realizing graphs on devices of `device_type` (every realization asks)."""
    target = _by_device.get(device_type)
    if target is None:
        if device_type not in DEVICE_TARGETS:
            raise DeviceError(f"no backend for device type {device_type!r}")
        target = _by_device[device_type] = running(DEVICE_TARGETS[device_type])
    return target


_by_device: dict[str, RuntimeTarget] = {}
