"""The fusion planner: a lowered graph becomes a list of FusedKernels (compiler/fused.py says what a kernel,
its space and the levels of its values are). The generic steps are the `Planner`'s (compiler/planner.py); the
fusion patterns (compiler/patterns/) add theirs at the stage each runs at (`Stage`), in the order of PATTERNS.

Planning goes in six steps:
1. choose what must be stored: outputs, results of matmuls and convolutions,
   the operands of the vendor ones, reductions for now, shared producers that
   the cost model (`Planner._store_is_cheaper`) says are cheaper to store than
   to recompute, and GEMM operands whose prologue the cost model rejects;
2. every stored node roots a kernel that inlines everything unstored above it;
3. a reduction referenced by exactly one kernel, at ROW level over that kernel's
   space, is pulled into it instead of being stored;
4. GEMM kernels take the pointwise kernels over their output space that read
   them (epilogues) and the reductions of their operands along K; a pointwise
   kernel reading a requested value that another pointwise kernel writes, at
   positions other than its own (a flip, a transpose, another space), computes
   it again instead where the cost model says that costs less than a launch
   after its writer and a read of it (`recompute_requested`);
5. kernels over the same space are merged when no path through a third kernel
   joins them (vertical and horizontal fusion);
6. GEMM kernels that feed each other through narrow activations (an MLP) become
   one kernel that keeps the activations on chip, writing only those other kernels
   read; a GEMM summing over such a kernel's rows (a weight gradient) joins it, its
   products summed per program as the rows pass, and so does a sum over its rows
   of values its layers compute (a loss); then the pointwise kernels left are
   grouped, level by level, into segmented launches (one launch, many tensors).

Each GEMM kernel also carries its *split* form: the same nodes planned with the
matmul as a vendor call (operands stored, epilogue in kernels of its own), which
the runtime times against the fused kernel and runs when it is faster.

Patterns' steps: gemm stores the operands whose prologue does not pay (STORE), takes epilogues and operand sums
(CLAIM, step 4) and plans each GEMM kernel's split form (FINISH); rows pulls reductions into their only reader
(CLAIM, step 3); mlp chains, absorbs weight gradients and sums over rows (CHAIN, step 6).
"""

from __future__ import annotations

from ember.compiler.context import CompileContext
from ember.compiler.fused import Costs, FusedKernel, Stage
from ember.compiler.patterns import PATTERNS
from ember.compiler.planner import Planner
from ember.ir import Node


def plan(nodes: list[Node], outputs: list[Node], context: CompileContext, costs: Costs, fuse_gemms: bool = True,
         given: set[int] = frozenset()) -> tuple[list[FusedKernel], set[int]]:
    """Fused kernels in launch order, and the ids of the nodes that get buffers."""
    planner = Planner(nodes, outputs, context, costs, plan, fuse_gemms, given)
    planner.choose_stored()
    _run(Stage.STORE, planner, [])
    kernels = planner.root_kernels()
    kernels = _run(Stage.CLAIM, planner, kernels)
    kernels = planner.recompute_requested(kernels)
    kernels = planner.merge(kernels)
    kernels = _run(Stage.CHAIN, planner, kernels)
    kernels = planner.segment(kernels)
    for i, k in enumerate(kernels):
        k.index = i
        for part in k.parts():
            part.index = i
        planner.describe(k)
    kernels = _run(Stage.FINISH, planner, kernels)
    return kernels, set(planner.stored) - set(given)


def stored_values(nodes: list[Node], outputs: list[Node], context: CompileContext, costs: Costs) -> set[int]:
    """The ids of the values `plan` would store (step 1 and the patterns' STORE steps): each is written by a
    kernel of its own or as an extra output of one; every other value is computed inside its readers."""
    planner = Planner(nodes, outputs, context, costs, plan)
    planner.choose_stored()
    _run(Stage.STORE, planner, [])
    return set(planner.stored)


def _run(stage: Stage, planner: Planner, kernels: list[FusedKernel]) -> list[FusedKernel]:
    """The patterns' steps of one stage, in order."""
    for pattern in PATTERNS:
        for at, step in pattern.steps:
            if at is stage:
                kernels = step(planner, kernels)
    return kernels
