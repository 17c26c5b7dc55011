"""`compile`: the one way from a pending graph to a runnable `Plan`, for the runtime, `ember.explain`
and the tests, under one compile context.

- target "triton" (device cuda): passes (per-channel affines folded into the convolutions before them
  where that saves a pass, compiler/conv_folding.py), then the fusion planner, then the schedule (launch order,
  streams, arena slots), then one generated Triton source per planned kernel (a GEMM's split form
  included); a vendor call (cuBLAS, cuDNN) has none.
- target "reference" (device cpu): the graph as written, evaluated node by node with NumPy: the
  oracle every other target is tested against, so no pass rewrites it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ember.compiler import conv_folding, fusion, passes, schedule, signatures
from ember.compiler.context import CompileContext
from ember.compiler.fused import VENDOR_KINDS, FusedKernel, KernelKind, pattern_of
from ember.compiler.patterns import PATTERNS, gemm
from ember.compiler.targets import TARGETS, Target, reference
from ember.compiler.targets.triton import KernelSource
from ember.ir import Kind, Node
from ember.ir.ops import RULES


@dataclass
class CompiledKernel:
    """A planned kernel with its generated source (None for a vendor call) and, for a GEMM, its split
    form and the outputs its tiles reduce into atomically (with the reduction's identity to start from)."""

    kernel: FusedKernel
    source: KernelSource | None = None
    split: list[CompiledKernel] = field(default_factory=list)
    atomic_outputs: list[tuple[Node, float]] = field(default_factory=list)
    workspace: list[Node] = field(default_factory=list)  # the intermediates its split form stores
    # an MLP kernel whose programs hold the weights on chip: the same kernel streaming them, for a GPU
    # with less shared memory than the plan assumed
    fallback: KernelSource | None = None


@dataclass
class Plan:
    """A compiled graph. For "triton": the lowered graph, its kernels in launch order, the nodes that
    get buffers and the schedule. For "reference": the nodes to evaluate in order and those to keep."""

    target: str
    lowered: passes.Lowered | None = None
    kernels: list[CompiledKernel] = field(default_factory=list)
    stored: set[int] = field(default_factory=set)
    schedule: schedule.Schedule | None = None
    nodes: list[Node] = field(default_factory=list, repr=False)
    keep: set[int] = field(default_factory=set, repr=False)
    compile_seconds: float = 0.0
    context: CompileContext | None = None  # the settings it was compiled under, which its launches follow too

    def evaluate(self) -> dict:
        """Run a reference plan: the values of the kept nodes, by node id."""
        return reference.run(self.nodes, self.keep)

    def writes_in_place(self, input_index: int, output_index: int) -> bool | None:
        """Whether the plan can write output `output_index` into the buffer of input `input_index`:
        None when the output is that input itself (nothing to write), True when the kernel computing it
        is the last to read the input and reads it element for element where it writes."""
        source = self.lowered.inputs[input_index]
        result = self.lowered.outputs[output_index]
        if result is source:
            return None
        kernels = [ck.kernel for ck in self.kernels]
        writer = next((i for i, k in enumerate(kernels) if result in k.outputs), None)
        if writer is None or result.shape != source.shape or result.dtype is not source.dtype:
            return False
        group_start = next((a for a, b in self.schedule.groups if a <= writer < b), writer)
        for i, k in enumerate(kernels):
            if i != writer and source in k.reads and i >= group_start:
                return False
        kernel = kernels[writer]
        if source not in kernel.reads:
            return True
        # the part writing it: a segment of a segmented launch, or a gradient an MLP kernel sums (its finishing launch
        # runs after the layers', so only the finishing use counts); no other part may read the source
        parts = kernel.parts()
        part = next((s for s in parts if result in s.outputs), kernel)
        if any(source in s.reads for s in parts if s is not part):
            return False
        # a GEMM's epilogue (an optimizer update fused after a weight gradient) and a row kernel's (a batch norm's
        # running statistic, updated after its batch's sums) read element for element too, each position in one
        # program once its row is reduced; a value read by a mainloop or a row's loop is used at other positions
        # (broadcast along what is summed), which _elementwise_use rejects
        elementwise_kernel = part.kind is KernelKind.POINTWISE and not part.reductions or \
            part.kind is KernelKind.REDUCE or part.core is not None
        return elementwise_kernel and _elementwise_use(part, source) and _read_for(part, source, result)


def _read_for(kernel: FusedKernel, source: Node, result: Node) -> bool:
    """Whether every node of the kernel reading `source` goes into `result`: each is then computed before
    `result` is stored over `source` (a kernel emits its other outputs after, or among, its stores)."""
    cone, stack = set(), [result]
    while stack:
        n = stack.pop()
        if id(n) not in cone:
            cone.add(id(n))
            stack.extend(i for i in n.inputs if i is not source)
    return all(id(n) in cone for n in kernel.covers if any(i is source for i in n.inputs))


def _elementwise_use(kernel: FusedKernel, source: Node) -> bool:
    """Every value of the kernel derived from `source` is computed element for element (no view,
    broadcast or gather moves an element of `source` to another position)."""
    derived = {id(source)}
    for n in kernel.covers:
        if any(id(i) in derived for i in n.inputs):
            if n.op.kind not in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) or n.shape != source.shape:
                return False
            derived.add(id(n))
    return True


def compile(order: list[Node], keep: set[int], target: str, context: CompileContext,  # noqa: A001
            signature: signatures.Signature | None = None) -> Plan:
    """Compile the pending graph `order` (the nodes whose ids are in `keep` are its results) for
    `target`; `signature` is `signatures.signature(order, keep)` where the caller already has it."""
    if target not in TARGETS:
        raise ValueError(f"compile: unknown target {target!r}; expected one of {', '.join(TARGETS)}")
    chosen = TARGETS[target]
    if chosen.costs is None:  # the reference backend evaluates a composite node by its expansion
        return Plan(target, nodes=order, keep=keep)
    start = time.perf_counter()
    sig = signature or signatures.signature(order, keep)  # of the graph as built: the plan's key and arguments
    order, results = passes.expand_composites(order, keep)
    splitting = context.split_k and context.gemm_backend != "cublas"  # generated GEMMs that split a long K
    lowered = passes.lower(order, {id(n) for n in results}, sig,
                           channels_last=context.conv_memory_format == "channels_last",
                           multiprocessors=context.multiprocessors if splitting else 0, results=results,
                           gpu_multiprocessors=context.multiprocessors)
    lowered = conv_folding.fold_affines(lowered, context, chosen.costs)
    kernels, stored = fusion.plan(lowered.nodes, lowered.outputs, context, chosen.costs)
    compiled = [_generate(k, stored, context, chosen) for k in kernels]
    small = [_is_small(ck, context.multiprocessors) for ck in compiled]
    sched = schedule.schedule(kernels, lowered.outputs, small, context.max_streams)
    compiled = [compiled[i] for i in sched.order]
    return Plan(target, lowered, compiled, stored, sched, compile_seconds=time.perf_counter() - start,
                context=context)


def _generate(kernel: FusedKernel, stored: set[int], context: CompileContext, target: Target) -> CompiledKernel:
    if kernel.kind in VENDOR_KINDS and kernel.core is None:
        return CompiledKernel(kernel)
    ck = CompiledKernel(kernel, target.render(kernel, stored, context))
    pattern = pattern_of(kernel, PATTERNS)
    other = pattern.fallback(kernel) if pattern.fallback is not None else None
    if other is not None:
        fallback = target.render(other, stored, context)
        ck.fallback = fallback if fallback.text != ck.source.text else None
    if isinstance(kernel.payload, gemm.SplitForm):
        ck.split = [_generate(part, stored | kernel.payload.stored, context, target) for part in kernel.payload.kernels]
        ck.workspace = kernel.payload.stored_nodes()
        ck.atomic_outputs = [(o, RULES[op].identity(o.dtype)) for o, op in gemm.epilogue_reduction_outputs(kernel)]
    return ck


def _is_small(ck: CompiledKernel, multiprocessors: int) -> bool:
    """Whether a kernel leaves most of the GPU idle, so another may run beside it."""
    if ck.kernel.kind in VENDOR_KINDS:  # its grid comes from the tuned configuration
        return math.prod(ck.kernel.space) < 64 * 64 * multiprocessors  # fewer 64 x 64 tiles than SMs
    return max((launch.grid for launch in ck.source.launches), default=0) < multiprocessors // 2
