"""Targets: what the compiler makes code for.

A target names the device it runs on, the costs the fusion planner assumes of that device, and its
renderer: the function that turns a planned kernel (through the kernel IR, compiler/lower.py) into
source. Compiling, loading and launching that source are the runtime's (ember/runtime/launcher.py for
Triton); so are the vendor libraries a target calls (cuBLAS and cuDNN through torch).

- triton (device cuda): one `@triton.jit` source per planned kernel (targets/triton.py, its helper
  library targets/triton_lib.py);
- reference (device cpu): no planner and no source: the graph as written, evaluated node by node with
  NumPy (targets/reference.py), the oracle every other target is tested against.

Adding a target means one renderer module here, one entry in TARGETS, and its launcher in the runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ember.compiler.fused import NOMINAL_GPU, Costs
from ember.compiler.targets import triton


@dataclass(frozen=True)
class Target:
    name: str
    device: str  # the device type its code runs on
    costs: Costs | None  # None: the graph runs as written, unplanned
    render: Callable | None  # (FusedKernel, stored ids, CompileContext) -> source; None: nothing generated


TARGETS = {
    "triton": Target("triton", "cuda", NOMINAL_GPU, triton.generate),
    "reference": Target("reference", "cpu", None, None),
}
