"""The compiler: graph passes, fusion planning, scheduling and code generation.

Layers above reach it through this module: `compile` turns a pending graph into a `Plan`, under a
`CompileContext`; the rest is what a plan holds (its signature, kernels and their kinds, generated sources and
their launches, and the kinds of a launch's arguments).
"""

from pathlib import Path

from ember.compiler.context import CompileContext
from ember.compiler.fused import KernelKind
from ember.compiler.kernel import ParamKind
from ember.compiler.pipeline import CompiledKernel, Plan, compile
from ember.compiler.signatures import Signature, signature
from ember.compiler.targets.triton import KernelSource, Launch

# the helpers generated Triton kernels import, as a file: the runtime loads one copy per way of running
TRITON_LIBRARY = Path(__file__).parent / "targets" / "triton_lib.py"

__all__ = ["CompileContext", "CompiledKernel", "KernelKind", "KernelSource", "Launch", "ParamKind", "Plan",
           "Signature", "TRITON_LIBRARY", "compile", "signature"]
