"""Targets: what the compiler makes code for.

A target names the device type it runs on, the costs the fusion planner assumes of that device, and its
renderer: the function that turns a planned kernel (through the kernel IR, compiler/lower.py) into
source. Loading, compiling and launching that source are the runtime's, in a table of its own
(ember/runtime/targets.py) that names, per target here, the runtime module running its plans (for Triton,
runtime/launcher.py, in Triton's interpreter or not) and which target realizes each device type's graphs;
so are the vendor libraries a target calls (cuBLAS and cuDNN through torch). The compiler knows nothing
of that table.

- triton (device cuda): one `@triton.jit` source per planned kernel (targets/triton.py, its helper
  library targets/triton_lib.py);
- reference (device cpu): no planner and no source: the graph as written, evaluated node by node with
  NumPy (targets/reference.py), the oracle every other target is tested against.

Adding a target means one renderer module here and one entry in TARGETS, then one runtime module and one
entry in the runtime's table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ember.compiler.fused import NOMINAL_GPU, Costs
from ember.compiler.targets import triton


@dataclass(frozen=True)
class Target:
    """What the compiler makes of a graph for one target."""

    name: str
    device: str  # the device type its code runs on
    costs: Costs | None  # None: the graph runs as written, unplanned
    render: Callable | None  # (FusedKernel, stored ids, CompileContext) -> source; None: nothing generated


TARGETS = {
    "triton": Target("triton", "cuda", NOMINAL_GPU, triton.generate),
    "reference": Target("reference", "cpu", None, None),
}
