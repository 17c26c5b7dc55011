"""The compiler: graph passes, fusion planning, scheduling and code generation.

Layers above reach it through this module: `compile` turns a pending graph into a `Plan`, under a
`CompileContext`; the rest is what a plan holds (its signature, kernels and their kinds).
"""

from ember.compiler.context import CompileContext
from ember.compiler.fusion import KernelKind
from ember.compiler.passes import Signature, signature
from ember.compiler.pipeline import CompiledKernel, Plan, compile

__all__ = ["CompileContext", "CompiledKernel", "KernelKind", "Plan", "Signature", "compile", "signature"]
