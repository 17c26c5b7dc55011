"""Lowering: a FusedKernel becomes a KernelIR (compiler/kernel.py), for any target to render, by the lowering of
the pattern that claims it (compiler/patterns/), each built on the shared emitter (compiler/emit.py). Every
lowered function is checked for names read where a compiled kernel has them undefined.
"""

from __future__ import annotations

from ember.compiler.context import CompileContext
from ember.compiler.emit import Context, unbound_reads
from ember.compiler.fused import FusedKernel, pattern_of
from ember.compiler.kernel import KernelIR
from ember.compiler.patterns import PATTERNS
from ember.errors import CompileError


def lower(kernel: FusedKernel, stored: set[int], context: CompileContext) -> KernelIR:
    """The kernel IR of a planned kernel that a pattern generates code for."""
    pattern = pattern_of(kernel, PATTERNS)
    if pattern is None:
        raise CompileError(f"no generated code for {kernel.kind} kernels")
    functions = pattern.lower(Context(stored, context), kernel)
    for function in functions:
        unbound = unbound_reads(function)
        if unbound:
            raise CompileError(f"kernel {kernel.index} ({kernel.kind}): {', '.join(sorted(unbound))} read where not "
                               "defined (a value of a loop read after it)")
    return KernelIR(str(kernel.kind), _header(kernel), functions)


def _header(kernel: FusedKernel) -> list[str]:
    numbering = {id(n): i for i, n in enumerate(kernel.reads + kernel.covers)}
    lines = [f"ember fused kernel: {kernel.kind} over {list(kernel.space)}"
             + (f" reducing axes {list(kernel.axes)}" if kernel.axes else "")]
    for n in kernel.reads:
        lines.append(f"  %{numbering[id(n)]} = load {list(n.shape)} {n.dtype.name}")
    for n in kernel.covers:
        args = ", ".join(f"%{numbering[id(i)]}" for i in n.inputs if id(i) in numbering)
        stored = "  -> stored" if n in kernel.outputs else ""
        lines.append(f"  %{numbering[id(n)]} = {n.op.label}({args}) {list(n.shape)} {n.dtype.name}{stored}")
    return lines
