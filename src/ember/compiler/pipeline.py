"""One way from a pending graph to generated kernels, for the runtime, `ember.explain` and the tests:
passes, then the fusion planner, then code generation, all under one compile context."""

from __future__ import annotations

from dataclasses import dataclass

from ember.compiler import fusion, passes
from ember.compiler.codegen import triton as codegen
from ember.compiler.context import CompileContext
from ember.ir import Node


@dataclass
class Compiled:
    """A graph compiled for the cuda device, before scheduling: the lowered graph, its fused kernels in
    dependency order, the nodes that get buffers, and the source of every generated kernel (a GEMM's
    split form included), by id of its FusedKernel; a vendor call (cuBLAS, cuDNN) has none."""

    lowered: passes.Lowered
    kernels: list[fusion.FusedKernel]
    stored: set[int]
    sources: dict[int, codegen.KernelSource]


def compile(order: list[Node], keep: set[int], signature: passes.Signature,  # noqa: A001
            context: CompileContext) -> Compiled:
    lowered = passes.lower(order, keep, signature)
    kernels, stored = fusion.plan(lowered.nodes, lowered.outputs, context)
    sources: dict[int, codegen.KernelSource] = {}

    def generate(kernel: fusion.FusedKernel, stored: set[int]) -> None:
        if kernel.kind not in fusion.VENDOR_KINDS or kernel.core is not None:
            sources[id(kernel)] = codegen.generate(kernel, stored, context)
        for part in kernel.split if kernel.core is not None else ():
            generate(part, stored | kernel.split_stored)

    for kernel in kernels:
        generate(kernel, stored)
    return Compiled(lowered, kernels, stored, sources)
