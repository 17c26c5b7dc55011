"""What the fusion planner makes and every fusion pattern speaks: a planned kernel (`FusedKernel`), its kind,
the levels of the values inside it, the costs the planner assumes of a device, and the interface of a fusion
pattern (`Pattern`: what it claims in the graph at which stage of planning, and how it lowers).

A kernel iterates over a *space*: a shape S and the axes A of S it reduces over (none for a pointwise kernel).
Inside it, a node sits at one of three *levels*:

- FULL: indexed like S itself, element (row m, column n) of the kernel's grid;
- ROW:  one value per row m (the shape of S with A kept as size 1, or any shape with as many elements in the
        same order);
- OTHER: indexed some other way (a transpose, a gather, a broadcast along a non-reduced axis); only loads and
        pointwise math may sit below it.

A reduction over A of a FULL value is a ROW value, and a ROW value broadcast back along A is FULL again, which is
what lets softmax, layer norm or cross entropy be one kernel: each reduction is computed in registers for the
rows the kernel holds.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember import dtypes
from ember.compiler.context import CompileContext
from ember.ir import Kind, Node, Op

if TYPE_CHECKING:
    from ember.compiler.emit import Context
    from ember.compiler.kernel import Function
    from ember.compiler.planner import Planner


class Level(enum.Enum):
    """Where in a kernel a value is computed, relative to its reductions: at every element of its space (FULL),
    once per row of a row kernel (ROW), apart from both (OTHER), or in a GEMM's mainloop (MAINLOOP: its operand
    reductions, which no other kernel reads in registers)."""

    FULL = "full"
    ROW = "row"
    OTHER = "other"
    MAINLOOP = "mainloop"


FULL, ROW, OTHER, MAINLOOP = Level.FULL, Level.ROW, Level.OTHER, Level.MAINLOOP
GEMM_DTYPES = (dtypes.float16, dtypes.bfloat16, dtypes.float32)  # matmuls generated as Triton GEMMs


class KernelKind(enum.Enum):
    """What a fused kernel is built around."""

    POINTWISE = "pointwise"  # elementwise work over one iteration space
    REDUCE = "reduce"  # rows reduced along some axes, with their producers and consumers
    MATMUL = "matmul"  # a GEMM: generated (with a core) or the vendor's
    CONV2D = "conv2d"  # the vendor's convolution, or one of its gradients
    SCATTER_ADD = "scatter_add"
    SEGMENTED = "segmented"  # independent small kernels sharing one launch
    MLP = "mlp"  # a chain of narrow GEMMs with pointwise work between: several cores, intermediates on chip
    ATTENTION = "attention"  # softmax(q @ kᵀ) @ v with key tiles streamed on chip, or its gradients
    SORT = "sort"  # the vendor's sort along an axis (torch's)
    COLLECTIVE = "collective"  # a collective of the process group, by torch.distributed (NCCL or gloo)

    def __str__(self) -> str:
        return self.value


# kernels a vendor library runs (cuBLAS, cuDNN, torch's sort, torch.distributed's collectives)
VENDOR_KINDS = (KernelKind.MATMUL, KernelKind.CONV2D, KernelKind.SORT, KernelKind.COLLECTIVE)

# the ops whose results are always stored, each the core of a kernel of its own kind: the vendor's, or generated
OPAQUE_KINDS = {Op.MATMUL: KernelKind.MATMUL, Op.CONV2D: KernelKind.CONV2D, Op.CONV2D_INPUT_GRAD: KernelKind.CONV2D,
                Op.CONV2D_WEIGHT_GRAD: KernelKind.CONV2D, Op.ATTENTION: KernelKind.ATTENTION,
                Op.ATTENTION_GRAD: KernelKind.ATTENTION, Op.ARGSORT: KernelKind.SORT,
                Op.COLLECTIVE: KernelKind.COLLECTIVE}
OPAQUE = tuple(OPAQUE_KINDS)
DRAWS_INLINE = (Op.ATTENTION, Op.ATTENTION_GRAD)  # kernels computing a random input at each position they read


@dataclass(frozen=True)
class Costs:
    """What the planner's cost model assumes of the device a target runs on, in seconds and bytes (only
    the ratios matter). A prologue is applied to an operand tile once per output tile that loads it, on
    the vector units, while the matrix units run the dot; it pays while that work fits beside the dot,
    and it must not read more bytes than storing the operand would move (its write and its read)."""

    tile: int  # output tile edge: an operand element is loaded once per tile across the other edge
    alu_rate: float  # float32 operations per second on the vector units
    dot_rate: tuple[tuple[str, float], ...]  # ("half" | "tf32" | "float32", multiply-adds x 2 per second)
    prologue_share: float  # of the dot's time, what the prologue's work may take
    bandwidth: float  # bytes per second of device memory
    launch_seconds: float  # what a kernel of its own costs beyond its bytes

    def dot(self, kind: str) -> float:
        return dict(self.dot_rate)[kind]


NOMINAL_GPU = Costs(tile=128, alu_rate=60e12, dot_rate=(("half", 700e12), ("tf32", 350e12), ("float32", 50e12)),
                    prologue_share=0.25, bandwidth=3e12, launch_seconds=3e-6)  # a Hopper GPU


class Payload:
    """What one pattern keeps of a kernel it planned, beyond the fields every kernel has (an MLP kernel's
    layers and the kernels it took in, a GEMM's vendor form)."""

    def parts(self) -> list[FusedKernel]:
        """The kernels the pattern took into this one, computed by its launches."""
        return []


@dataclass(eq=False)
class FusedKernel:
    """One planned kernel: what it iterates over (`space`, reducing `axes`), the nodes it writes and computes
    in registers, what it loads, and, once described, its nodes by role."""

    kind: KernelKind
    space: tuple[int, ...]
    axes: tuple[int, ...]
    outputs: list[Node] = field(default_factory=list)
    levels: dict[int, Level] = field(default_factory=dict)  # id(output) -> FULL or ROW
    reductions: list[Node] = field(default_factory=list)  # computed in registers, inputs first
    covers: list[Node] = field(default_factory=list)  # every node computed inside, for explain
    reads: list[Node] = field(default_factory=list)  # stored nodes and inputs it loads
    segments: list[FusedKernel] = field(default_factory=list)  # a segmented launch's parts
    core: Node | None = None  # a generated GEMM's matmul (None: a vendor matmul, or no matmul)
    # The kernel's nodes by role, filled by `describe`: its cores (matmuls, convolutions, the reductions of
    # a row kernel; a chain of small GEMMs would hold several), per operand of its cores the nodes computed
    # as that operand is loaded (the mainloop, or prologue), and the nodes applied to the cores' results
    # (the epilogue). A pointwise kernel has no core: all its nodes are epilogue.
    cores: list[Node] = field(default_factory=list)
    prologues: list[list[Node]] = field(default_factory=list)
    epilogue: list[Node] = field(default_factory=list)
    # stored values it computes again rather than loading: requested values it reads at other positions than
    # the kernel writing them (see `Planner.recompute_requested`)
    recomputed: list[Node] = field(default_factory=list)
    payload: Payload | None = None  # what its pattern keeps of it (see Payload)
    decisions: list[str] = field(default_factory=list)  # the cost model's choices, for explain
    index: int = 0

    def parts(self) -> list[FusedKernel]:
        """The kernels its launches compute besides its own nodes: a segmented launch's segments, and those its
        pattern took in (an MLP kernel's weight gradients and sums over its rows)."""
        return self.segments + (self.payload.parts() if self.payload is not None else [])

    @property
    def rows(self) -> int:
        return math.prod(s for i, s in enumerate(self.space) if i not in self.axes)

    @property
    def cols(self) -> int:
        return math.prod(self.space[i] for i in self.axes)

    @property
    def root(self) -> Node:
        return self.outputs[0]


class Stage(enum.Enum):
    """When a pattern's planner step runs (`fusion.plan`): STORE after the generic choice of stored values,
    before any kernel exists (its kernels argument is empty); CLAIM on the kernels rooted at stored values,
    before requested values are recomputed and kernels over one space merged; CHAIN on the merged kernels,
    before pointwise kernels are grouped into segmented launches; FINISH on the described kernels in launch
    order."""

    STORE = "store"
    CLAIM = "claim"
    CHAIN = "chain"
    FINISH = "finish"


Step = Callable[["Planner", list[FusedKernel]], list[FusedKernel]]


@dataclass(frozen=True)
class Pattern:
    """A fusion pattern: the planner steps by which it claims nodes and kernels (in the stage each runs at), which
    planned kernels it lowers and how (to the kernel IR's functions), and the other form of a kernel the runtime
    may run instead (None: none)."""

    name: str
    steps: tuple[tuple[Stage, Step], ...]
    lowers: Callable[[FusedKernel], bool]
    lower: Callable[[Context, FusedKernel], list[Function]]
    fallback: Callable[[FusedKernel], FusedKernel | None] | None = None


def pattern_of(kernel: FusedKernel, patterns: tuple[Pattern, ...]) -> Pattern | None:
    """The pattern that lowers `kernel` (None for a vendor call)."""
    return next((p for p in patterns if p.lowers(kernel)), None)


def row_shape(space: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else s for i, s in enumerate(space))


def is_leaf(node: Node) -> bool:
    return node.op.kind is Kind.LEAF


# A pointwise kernel computing more nodes than this at each element (gathers and the index arithmetic that places
# them: image sampling) gives each program a quarter of the usual elements: its many live values per element
# otherwise take so many registers that few programs fit on an SM
POINTWISE_HEAVY = 64


def element_nodes(nodes) -> int:
    """How many of a kernel's computed `nodes` it computes at each element: a single value (an optimizer's step
    count, its bias corrections) is computed once a program, a scalar beside the block's values."""
    return sum(1 for n in nodes if n.numel != 1)


def input_level(node: Node, level: Level, space: tuple[int, ...], axes: tuple[int, ...], position: int) -> Level:
    """The level of input `position` of `node`, when `node` sits at `level` in a kernel over (space, axes)."""
    if level == OTHER:
        return OTHER
    kind = node.op.kind
    if kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY):
        return level
    if kind is Kind.REDUCE:
        if level == ROW and node.inputs[0].shape == space and tuple(node.attrs["axes"]) == axes:
            return FULL
        return OTHER
    if node.op is Op.RESHAPE and (level == ROW or level == FULL and not axes):
        # a reshape of a row-major value keeps each element's linear position: over a space without reduced axes,
        # an element's input is at the element's own position (a bias add over (8192, 3072) read back by a GELU over
        # (8, 1024, 3072) is one kernel's work)
        return level
    if node.op is Op.EXPAND and level == FULL and axes:
        source = node.inputs[0].shape
        if source == row_shape(space, axes):
            return ROW
        return OTHER
    if node.op is Op.GATHER:
        if position == 1:
            return level
        axis = node.attrs["axis"]
        if level == ROW and axis in axes and len(axes) == 1 and node.inputs[0].shape[:axis] == space[:axis] \
                and node.inputs[0].shape[axis + 1:] == space[axis + 1:]:
            return FULL  # a pick along the reduced axis of each row
        return OTHER
    return OTHER


def under_reshapes(node: Node) -> Node:
    while node.op is Op.RESHAPE:
        node = node.inputs[0]
    return node


def summed_output(kernel: FusedKernel, output: Node) -> Node | None:
    """The reduction of a GEMM kernel (an operand's sum along K, or a reduction of its epilogue) that
    `output` stores, itself or through a reshape; None for any other output."""
    source = under_reshapes(output)
    return source if source in kernel.reductions else None


def operand_sums(kernel: FusedKernel) -> list[Node]:
    """A GEMM kernel's reductions computed in its mainloop (operands summed along K); the others reduce
    rows or columns of its epilogue."""
    return [r for r in kernel.reductions if summed_operand(kernel.core, r) is not None]


def summed_operand(core: Node, reduction: Node) -> int | None:
    """The operand of a 2-d GEMM that `reduction` sums along K, if it is one: the operand is the
    summed value itself or its transpose (stored or not, the same values)."""
    if len(core.shape) != 2 or reduction.op is not Op.SUM or len(reduction.attrs["axes"]) != 1:
        return None
    summed = reduction.inputs[0]
    for position, operand in enumerate(core.inputs):
        transposed = operand.op is Op.PERMUTE
        source = operand.inputs[0] if transposed else operand
        if source is not summed:
            continue
        k_axis = 1 if position == 0 else 0
        if reduction.attrs["axes"] == ((1 - k_axis) if transposed else k_axis,):
            return position
    return None


def summed_views(r: Node) -> tuple[Node, list[Node], Node | None]:
    """For a sum `r`: the value it adds up (below reshapes, zero pads and a first stage's sum), the views between
    (reshapes and pads), and that first stage, if any (`passes` splits a long reduction in two)."""
    x = under_reshapes(r.inputs[0])
    first = x if x.op is Op.SUM else None
    if first is not None:
        x = first.inputs[0]
    views = []
    while x.op in (Op.RESHAPE, Op.PAD):
        views.append(x)
        x = x.inputs[0]
    return x, views, first


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f} us"


def dot_kind(dtype, context: CompileContext) -> str:
    if dtype is not dtypes.float32:
        return "half"
    return "float32" if context.dot_precision(dtype) == "ieee" else "tf32"
