"""The fusion planner: a lowered graph becomes a list of FusedKernels.

A kernel iterates over a *space*: a shape S and the axes A of S it reduces over
(none for a pointwise kernel). Inside it, a node sits at one of three *levels*:

- FULL: indexed like S itself, element (row m, column n) of the kernel's grid;
- ROW:  one value per row m (the shape of S with A kept as size 1, or any shape
        with as many elements in the same order);
- OTHER: indexed some other way (a transpose, a gather, a broadcast along a
        non-reduced axis); only loads and pointwise math may sit below it.

A reduction over A of a FULL value is a ROW value, and a ROW value broadcast back
along A is FULL again, which is what lets softmax, layer norm or cross entropy be
one kernel: each reduction is computed in registers for the rows the kernel holds.

A GEMM kernel (kind "matmul" with a `core`) iterates over the output of its
matmul: its *mainloop* (prologue) applies the cheap ops that produce each operand
to the tiles as they are loaded, and may sum an operand along K on the way (the
bias gradient beside a weight gradient); its *epilogue* is any pointwise DAG over
the accumulator, with broadcast and full-size loads and several outputs.

Planning goes in six steps:
1. choose what must be stored (`materialized`): outputs, results of matmuls and
   convolutions, the operands of the vendor ones, reductions for now, shared
   producers that the cost model below says are cheaper to store than to
   recompute, and GEMM operands whose prologue the cost model rejects;
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
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from dataclasses import dataclass, field

from ember import dtypes
from ember.compiler.context import CompileContext
from ember.ir import Kind, Node, Op
from ember.ir.ops import STRIDED_VIEWS


class Level(enum.Enum):
    """Where in a kernel a value is computed, relative to its reductions: at every element of its space (FULL),
    once per row of a row kernel (ROW), apart from both (OTHER), or in a GEMM's mainloop (MAINLOOP: its operand
    reductions, which no other kernel reads in registers)."""

    FULL = "full"
    ROW = "row"
    OTHER = "other"
    MAINLOOP = "mainloop"


FULL, ROW, OTHER, MAINLOOP = Level.FULL, Level.ROW, Level.OTHER, Level.MAINLOOP
OPAQUE = (Op.MATMUL, Op.CONV2D, Op.CONV2D_INPUT_GRAD, Op.CONV2D_WEIGHT_GRAD)  # the vendor's, or a GEMM core
MAX_SEGMENTS = 64  # pointwise kernels fused into one launch at most
MAX_RECOMPUTE_OPS = 48  # a shared producer with a larger cone is stored, not recomputed
# A shared producer whose recomputation reads at most this many bytes, and whose readers' elements times its ops
# come to at most TINY_RECOMPUTE_WORK, is recomputed: storing it would save a few bytes but could take a launch
# of its own (a few microseconds, megabytes' worth of traffic); per-box or per-channel values
TINY_RECOMPUTE_BYTES = 16 * 1024
TINY_RECOMPUTE_WORK = 1 << 22
RAND_OPS = 8  # a random number (Philox rounds), in pointwise ops
GEMM_DTYPES = (dtypes.float16, dtypes.bfloat16, dtypes.float32)  # matmuls generated as Triton GEMMs
MLP_MAX_WIDTH = 128  # widths of a chained MLP's layers (padded to powers of two) whose tiles stay on chip
# float32 elements of the weight-gradient accumulators one MLP kernel's programs keep in registers across their
# row tiles: two 64 x 64 gradients and a 16-wide output's (H100, a 5-layer 64-wide MLP's training step at 2^18
# rows, GPU time: 0.271 ms with two, 0.284 with three, 0.509 with all four (the backward kernel's registers
# spill); 8 warps instead of 4 did worse with two or three)
MLP_GRADIENT_ELEMENTS = 2 * 64 * 64 + 64 * 16
# Weights a persistent MLP program keeps on chip across its row tiles: up to the first size with 128-row
# tiles, up to the second with 64-row tiles (measured on H100/H200, 227 KiB of shared memory per block)
MLP_RESIDENT_BYTES = (48 * 1024, 144 * 1024)
MLP_MAX_SUMS = 8  # sums over its rows (see absorb_sums) an MLP kernel takes at most



class KernelKind(enum.Enum):
    """What a fused kernel is built around."""

    POINTWISE = "pointwise"  # elementwise work over one iteration space
    REDUCE = "reduce"  # rows reduced along some axes, with their producers and consumers
    MATMUL = "matmul"  # a GEMM: generated (with a core) or the vendor's
    CONV2D = "conv2d"  # the vendor's convolution, or one of its gradients
    SCATTER_ADD = "scatter_add"
    SEGMENTED = "segmented"  # independent small kernels sharing one launch
    MLP = "mlp"  # a chain of narrow GEMMs with pointwise work between: several cores, intermediates on chip

    def __str__(self) -> str:
        return self.value


VENDOR_KINDS = (KernelKind.MATMUL, KernelKind.CONV2D)  # kernels a vendor library can run (cuBLAS, cuDNN)


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


@dataclass(eq=False)
class FusedKernel:
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
    layers: dict[int, int] = field(default_factory=dict)  # an MLP kernel's id(output) -> the layer computing it
    # an MLP kernel's weight-gradient GEMMs (dot(P^T, Q) over its rows), summed per program beside its layers and
    # finished (partials added, epilogue run) by a function of their own
    absorbed: list[FusedKernel] = field(default_factory=list)
    # an MLP kernel's sums over its rows of values its layers compute (a loss, a column sum): row kernels whose
    # single sum it takes per program beside its layers; its finishing launch adds the partials and runs their
    # epilogues (see `Planner.absorb_sums`)
    summed: list[FusedKernel] = field(default_factory=list)
    streamed: bool = False  # an MLP kernel's form that holds no weights on chip: its fallback on a smaller GPU
    # stored values it computes again rather than loading: requested values it reads at other positions than
    # the kernel writing them (see `Planner.recompute_requested`)
    recomputed: list[Node] = field(default_factory=list)
    split: list[FusedKernel] = field(default_factory=list)  # a GEMM's vendor form: same nodes, several kernels
    split_stored: set[int] = field(default_factory=set)  # the intermediates the split form stores
    decisions: list[str] = field(default_factory=list)  # the cost model's choices, for explain
    index: int = 0

    def split_stored_nodes(self) -> list[Node]:
        return [n for k in self.split for n in k.outputs if id(n) in self.split_stored]

    @property
    def rows(self) -> int:
        return math.prod(s for i, s in enumerate(self.space) if i not in self.axes)

    @property
    def cols(self) -> int:
        return math.prod(self.space[i] for i in self.axes)

    @property
    def root(self) -> Node:
        return self.outputs[0]


def row_shape(space: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else s for i, s in enumerate(space))


def is_leaf(node: Node) -> bool:
    return node.op.kind is Kind.LEAF


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
    if node.op is Op.RESHAPE and level == ROW:
        return ROW
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


class Planner:
    def __init__(self, nodes: list[Node], outputs: list[Node], context: CompileContext, costs: Costs,
                 fuse_gemms: bool = True, given: set[int] = frozenset()):
        """`given`: nodes already stored elsewhere (a split plan's inputs); `fuse_gemms`: whether
        matmuls become generated GEMM kernels or vendor calls."""
        self.nodes = nodes
        self.context = context
        self.costs = costs
        self.generate_gemms = fuse_gemms
        self.position = {id(n): i for i, n in enumerate(nodes)}
        self.outputs = outputs
        self.output_ids = {id(o) for o in outputs}
        self.users: dict[int, list[Node]] = defaultdict(list)
        for n in nodes:
            for i in n.inputs:
                self.users[id(i)].append(n)
        self.given = set(given)
        self.stored: set[int] = set(given)
        self.decisions: dict[int, list[str]] = defaultdict(list)  # id(matmul) -> the cost model's choices
        self.shared: dict[int, str] = {}  # id(producer with several readers) -> why it is stored or recomputed
        self.operand_sums: set[int] = set()  # reductions that sum a GEMM's operand along K (see fuse_gemms)

    # -- step 1: what is stored --------------------------------------------------------
    def choose_stored(self) -> None:
        stored = self.stored
        stored |= self.output_ids
        for n in self.nodes:
            if id(n) in self.given:
                continue
            if n.op in OPAQUE:
                stored.add(id(n))
                if self.is_gemm(n):
                    continue
                for i in n.inputs:  # vendor ops read strided views of stored buffers
                    base = self._view_base(i)
                    if base.op is not Op.BUFFER:
                        stored.add(id(base))
            elif n.op is Op.SCATTER_ADD or n.op.kind is Kind.REDUCE:
                stored.add(id(n))
        for n in self.nodes:  # upstream first, so a cone is final when it is measured
            if id(n) in stored or is_leaf(n) or len(self.users[id(n)]) < 2:
                continue
            if self._store_is_cheaper(n):
                stored.add(id(self._narrowest_exact_source(n)))
        for n in self.nodes:
            if self.is_gemm(n):
                for position, operand in enumerate(n.inputs):
                    if not self._prologue_pays(n, position, operand):
                        stored.add(id(self._view_base(operand)))

    def _narrowest_exact_source(self, node: Node) -> Node:
        """What to store for a shared value: a widening float cast (half to float32, exact) is stored as
        its input, in half the bytes, and cast again by each reader for free."""
        source = node.inputs[0] if node.op is Op.CAST else None
        if (source is None or is_leaf(source) or not (source.dtype.is_floating_point and node.dtype.is_floating_point)
                or source.dtype.itemsize >= node.dtype.itemsize):
            return node
        self.shared[id(node)] += f"; stored as its {source.dtype.name} input, cast by each reader"
        return source

    def is_gemm(self, node: Node) -> bool:
        return self.generate_gemms and node.op is Op.MATMUL and node.dtype in GEMM_DTYPES

    def _prologue_pays(self, mm: Node, position: int, operand: Node) -> bool:
        """Whether a GEMM computes an operand's producers in its mainloop rather than loading it stored.
        The decision is kept for explain."""
        base = self._view_base(operand)
        if base.op is Op.BUFFER or id(base) in self.stored:
            return True  # a view of a stored value: strided loads, nothing to decide
        ops, reads = self._cone(operand)
        if ops == 0:
            return True
        m, k = mm.inputs[0].shape[-2:]
        n = mm.shape[-1]
        costs = self.costs
        passes = -(-(n if position == 0 else m) // costs.tile)
        own = operand.numel * operand.dtype.itemsize
        read = sum(min(r.numel, operand.numel) * r.dtype.itemsize for r in reads)
        work = ops * operand.numel * passes / costs.alu_rate
        dot = 2 * mm.numel * k / costs.dot(_dot_kind(mm.dtype, self.context))
        share = work / dot if dot else 0.0
        storing = 2 * own / costs.bandwidth + costs.launch_seconds  # a producer kernel's write, the GEMM's read of it
        pays = False
        if read > 2 * own:
            verdict = (f"stored: recomputing it would read {_mib(read)} to save writing and reading "
                       f"{_mib(own)}")
        elif share > costs.prologue_share and work > storing:
            verdict = (f"stored: {ops} ops x {passes} tile passes would take {share:.0%} of the dot's time "
                       f"(at most {costs.prologue_share:.0%}) and more than storing it costs")
        else:
            pays = True
            verdict = (f"recomputed in the mainloop: reads {_mib(read)} instead of writing and reading "
                       f"{_mib(own)}; {ops} ops x {passes} tile passes, {share:.0%} of the dot's time")
        self.decisions[id(mm)].append(f"operand {position} ({ops} ops over {list(operand.shape)}) {verdict}")
        return pays

    def _view_base(self, node: Node) -> Node:
        """The node under a chain of movement ops that a strided view can express."""
        while node.op in STRIDED_VIEWS and id(node) not in self.stored:
            node = node.inputs[0]
        return node

    def _inside(self, node: Node) -> tuple[list[Node], list[Node]]:
        """What a kernel computes to get `node` (itself included), and the stored nodes and inputs it reads."""
        inside, reads, seen = [], [], set()
        stack = [node]
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if n is not node and (id(n) in self.stored or n.op is Op.BUFFER):
                reads.append(n)
                continue
            inside.append(n)
            stack.extend(n.inputs)
        return inside, reads

    def _cone(self, node: Node) -> tuple[int, list[Node]]:
        """Pointwise work and stored inputs of everything `node` inlines."""
        inside, reads = self._inside(node)
        ops = sum(1 for n in inside if n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY, Kind.INDEX, Kind.REDUCE))
        return ops + RAND_OPS * sum(1 for n in inside if n.op is Op.RAND), reads

    def _store_is_cheaper(self, node: Node) -> bool:
        """Cost model for a producer with several users, in bytes moved.

        Recomputing it in each of its k users re-reads its cone's inputs k times;
        storing it writes it once and reads it k times, and reads the cone's inputs
        once. A producer whose cone holds much work is stored regardless.
        """
        ops, reads = self._cone(node)
        what = f"{node.op.label} {list(node.shape)} {node.dtype.name}, read by {len(self.users[id(node)])} ops,"
        if ops > MAX_RECOMPUTE_OPS:
            self.shared[id(node)] = f"{what} stored: {ops} ops are too many to recompute"
            return True
        k = len(self.users[id(node)])
        # a cone reads at most as many elements of an input as it produces (a slice reads a part)
        input_bytes = sum(min(r.numel, node.numel) * r.dtype.itemsize for r in reads)
        own_bytes = node.numel * node.dtype.itemsize
        # a reader that gathers from it recomputes only the elements it picks (a resize of a converted frame)
        passes = sum(min(1.0, u.numel / node.numel) if u.op is Op.GATHER and u.inputs[0] is node and node.numel
                     else 1.0 for u in self.users[id(node)])
        store, recompute = own_bytes * (1 + k) + input_bytes, passes * input_bytes
        tiny = recompute <= TINY_RECOMPUTE_BYTES and \
            ops * sum(u.numel for u in self.users[id(node)]) <= TINY_RECOMPUTE_WORK
        stored = store < recompute and not tiny
        verdict = "stored" if stored else "recomputed by each reader"
        self.shared[id(node)] = (f"{what} {verdict}: storing moves {_mib(store)}, recomputing reads "
                                 f"{_mib(recompute)}" + (" (less than a launch costs)" if tiny else ""))
        return stored

    # -- step 2: one kernel per stored node ----------------------------------------------
    def root_kernels(self) -> list[FusedKernel]:
        kernels = []
        for n in self.nodes:
            if id(n) not in self.stored or n.op is Op.BUFFER or id(n) in self.given:
                continue
            if n.op in OPAQUE:
                core = n if self.is_gemm(n) else None
                kind = KernelKind.MATMUL if n.op is Op.MATMUL else KernelKind.CONV2D
                kernels.append(FusedKernel(kind, n.shape, (), [n], {id(n): FULL}, core=core,
                                           decisions=self.decisions[id(n)]))
            elif n.op is Op.SCATTER_ADD:
                kernels.append(FusedKernel(KernelKind.SCATTER_ADD, n.shape, (), [n], {id(n): FULL}))
            elif n.op.kind is Kind.REDUCE:
                space, axes = n.inputs[0].shape, tuple(n.attrs["axes"])
                kernels.append(FusedKernel(KernelKind.REDUCE, space, axes, [n], {id(n): ROW}, [n]))
            else:
                kernels.append(self._pointwise_root(n))
        return kernels

    def _pointwise_root(self, n: Node) -> FusedKernel:
        """A pointwise root adopts the space of a stored reduction it reads, if one fits."""
        _, reads = self._cone(n)
        for r in reads:
            if r.op.kind is not Kind.REDUCE:
                continue
            space, axes = r.inputs[0].shape, tuple(r.attrs["axes"])
            if n.shape == space:
                return FusedKernel(KernelKind.REDUCE, space, axes, [n], {id(n): FULL})
            if n.numel == r.numel and r.numel != math.prod(space):
                return FusedKernel(KernelKind.REDUCE, space, axes, [n], {id(n): ROW})
        return FusedKernel(KernelKind.POINTWISE, n.shape, (), [n], {id(n): FULL})

    def references(self, kernel: FusedKernel) -> dict[int, set[Level]]:
        """Stored nodes the kernel reads, with the levels it reads them at."""
        refs: dict[int, set[Level]] = defaultdict(set)
        if kernel.kind is KernelKind.MLP:  # its layers, outputs and the values between them are computed inside
            inside = {id(n) for n in kernel.outputs + kernel.cores + [g.core for g in kernel.absorbed]}
            stack, seen = list(kernel.outputs), set()
            while stack:
                n = stack.pop()
                if id(n) in seen:
                    continue
                seen.add(id(n))
                if id(n) not in inside and (id(n) in self.stored or n.op is Op.BUFFER):
                    refs[id(n)].add(OTHER)
                else:
                    stack.extend(n.inputs)
            return refs
        if kernel.core is not None:
            seen = set()
            for i in kernel.core.inputs:
                self._walk(kernel, i, OTHER, refs, seen)
            for r in kernel.reductions:
                self._walk(kernel, r.inputs[0], OTHER, refs, seen)
            for o in kernel.outputs:
                if o is not kernel.core and o not in kernel.reductions:
                    self._walk(kernel, o, FULL, refs, seen, skip_root=True)
            return refs
        if kernel.kind in (KernelKind.MATMUL, KernelKind.CONV2D, KernelKind.SCATTER_ADD):
            for o in kernel.outputs:
                for i in o.inputs:
                    self._walk(kernel, i, OTHER, refs, set())
            return refs
        seen: set[tuple[int, str]] = set()
        for o in kernel.outputs:
            start = o.inputs if o in kernel.reductions else [o]
            level = FULL if o in kernel.reductions else kernel.levels[id(o)]
            for s in start:
                self._walk(kernel, s, level, refs, seen, skip_root=s is o)
        return refs

    def _walk(self, kernel, node, level, refs, seen, skip_root=False) -> None:
        stack = [(node, level, skip_root)]
        while stack:
            n, lv, is_root = stack.pop()
            if (id(n), lv) in seen:
                continue
            seen.add((id(n), lv))
            if n is kernel.core and not is_root:
                continue  # the accumulator, in registers
            if not is_root and (id(n) in self.stored or n.op is Op.BUFFER) and n not in kernel.reductions \
                    and n not in kernel.recomputed:
                refs[id(n)].add(lv)
                continue
            for p, i in enumerate(n.inputs):
                stack.append((i, input_level(n, lv, kernel.space, kernel.axes, p), False))

    # -- step 3: pull reductions into their only reader ---------------------------------
    def pull_reductions(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        by_root = {id(k.root): k for k in kernels}
        refs = {id(k): self.references(k) for k in kernels}
        for r in reversed(self.nodes):
            if r.op.kind is not Kind.REDUCE or id(r) not in self.stored or id(r) in self.given:
                continue
            readers = [k for k in kernels if id(r) in refs[id(k)]]
            if len(readers) != 1:
                continue
            (k,) = readers
            space, axes = r.inputs[0].shape, tuple(r.attrs["axes"])
            if refs[id(k)][id(r)] != {ROW} or (k.space, k.axes) != (space, axes) or k.kind is not KernelKind.REDUCE:
                continue
            own = by_root.get(id(r))
            k.reductions.append(r)
            k.reductions.sort(key=lambda n: self.position[id(n)])
            if id(r) in self.output_ids:
                k.outputs.append(r)
                k.levels[id(r)] = ROW
            else:
                self.stored.discard(id(r))
            if own is not None and own is not k:
                kernels.remove(own)
                del refs[id(own)]
            refs[id(k)] = self.references(k)
        return kernels

    # -- step 4: GEMM kernels take their epilogues and their operands' reductions ---------
    def fuse_gemms(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        refs = {id(k): self.references(k) for k in kernels}
        # a reduction that sums some GEMM's operand along K goes to that GEMM's mainloop (where the bias gradient
        # of a training step belongs: beside its weight gradient), not to the epilogue of the GEMM producing it
        cores = [k.core for k in kernels if k.core is not None]
        self.operand_sums = {id(r) for k in kernels if k.kind is KernelKind.REDUCE for r in k.reductions
                             if any(summed_operand(core, r) is not None for core in cores)}
        for gemm in [k for k in kernels if k.core is not None]:
            taken = True
            while taken:  # an epilogue may read another epilogue's output: repeat until none joins
                taken = False
                for other in list(kernels):
                    if other is gemm or not self._joins(gemm, other, refs):
                        continue
                    same_space = other.space == gemm.space
                    if not (self._mergeable if same_space else self._acyclic)(gemm, other, kernels, refs):
                        continue
                    self._absorb(gemm, other)
                    if other.kind is KernelKind.REDUCE:
                        gemm.levels.update({id(o): MAINLOOP for o in other.outputs})
                    kernels.remove(other)
                    del refs[id(other)]
                    refs[id(gemm)] = self.references(gemm)
                    taken = True
            core = gemm.core
            read_elsewhere = any(id(core) in r for key, r in refs.items() if key != id(gemm))
            if id(core) not in self.output_ids and not read_elsewhere and len(gemm.outputs) > 1:
                gemm.outputs.remove(core)  # the accumulator feeds the epilogue in registers only
                del gemm.levels[id(core)]
                self.stored.discard(id(core))
        return kernels

    def _joins(self, gemm: FusedKernel, other: FusedKernel, refs: dict) -> bool:
        """Whether `other` is an epilogue of `gemm` (pointwise over its output, reading it) or the
        sum of one of its operands along K."""
        if other.kind is KernelKind.POINTWISE and other.space == gemm.space:
            return any(id(o) in refs[id(other)] for o in gemm.outputs)
        if other.kind is KernelKind.POINTWISE and math.prod(other.space) == math.prod(gemm.space):
            return self._reads_in_order(other, gemm)
        if other.kind is not KernelKind.REDUCE:
            return False
        if not all(_under_reshapes(o) in other.reductions for o in other.outputs):
            return False
        if len(other.reductions) == 1 and summed_operand(gemm.core, other.reductions[0]) is not None:
            return True
        if any(id(r) in self.operand_sums for r in other.reductions):
            return False
        return self._reduces_tiles(other, gemm, refs)

    def _reduces_tiles(self, kernel: FusedKernel, gemm: FusedKernel, refs: dict) -> bool:
        """Whether a reduce kernel sums (or takes the max or min of) rows or columns of the GEMM's epilogue
        values, each reduction on its own: every tile then reduces its part, combined atomically, which
        needs a float32 result (the accumulator's type)."""
        if kernel.space != gemm.space or len(gemm.space) != 2 or kernel.axes not in ((0,), (1,)):
            return False
        if not any(id(o) in refs[id(kernel)] for o in gemm.outputs):
            return False
        for r in kernel.reductions:
            if r.op not in (Op.SUM, Op.MAX, Op.MIN) or r.dtype is not dtypes.float32:
                return False
            if self._cone_reaches(r.inputs[0], set(map(id, kernel.reductions))):
                return False  # one reduction needs another's result (softmax, variance): two passes
        return True

    def _cone_reaches(self, node: Node, targets: set[int]) -> bool:
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if id(n) in targets:
                return True
            if id(n) in seen or (id(n) in self.stored and n is not node) or n.op is Op.BUFFER:
                continue
            seen.add(id(n))
            stack.extend(n.inputs)
        return False

    def _reads_in_order(self, kernel: FusedKernel, gemm: FusedKernel) -> bool:
        """Whether a pointwise kernel over a reshape of the GEMM's output space reads the GEMM's results,
        and only through pointwise ops and reshapes: element i of its space reads element i of theirs
        (a linear layer over [batch, tokens, features], whose GEMM runs over [batch x tokens, features])."""
        results = {id(o): gemm.levels[id(o)] for o in gemm.outputs}
        reaches, seen = False, set()
        stack = [(o, True) for o in kernel.outputs]
        while stack:
            n, in_order = stack.pop()
            if (id(n), in_order) in seen:
                continue
            seen.add((id(n), in_order))
            if id(n) in results and n not in kernel.outputs:
                if not in_order or results[id(n)] != FULL:
                    return False
                reaches = True
                continue
            if n not in kernel.outputs and (id(n) in self.stored or n.op is Op.BUFFER):
                continue
            keeps = in_order and (n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) or n.op is Op.RESHAPE)
            stack.extend((i, keeps) for i in n.inputs)
        return reaches

    # -- step 4b: requested values read at other positions are computed again by their readers --
    def recompute_requested(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        """A pointwise kernel reading a requested value (an output, written anyway: a step of a pipeline the user
        holds in a variable) that another pointwise kernel writes, at positions other than that kernel's own (a
        channel flip, a transpose, a gather, another space), would have to run after it. It computes the value
        again instead, from what the writer reads, where `_recompute_pays` says so: the two kernels are then
        independent, and step 5 merges them or groups them into one launch. Repeated for what a recomputed
        value reads, so a chain of held steps is recomputed down to the first that does not pay. A value the
        reader only broadcasts (a step count each parameter's update reads) is loaded: such small values are
        mostly state that ember.jit overwrites in place, which a reader computing it again from the old value
        in the same launch would forbid (the replay would copy it instead)."""
        writers = {id(o): (o, k) for k in kernels if k.kind is KernelKind.POINTWISE for o in k.outputs
                   if id(o) in self.output_ids}
        for reader in kernels:
            if reader.kind is not KernelKind.POINTWISE:
                continue
            decided: set[int] = set()
            while True:
                refs = self.references(reader)
                waiting = [writers[r] for r in refs if r in writers and r not in decided
                           and writers[r][1] is not reader
                           and not (writers[r][1].space == reader.space and refs[r] <= {FULL})]  # step 5 merges those
                if not waiting:
                    break
                for node, _ in waiting:
                    decided.add(id(node))
                    if self._reaches_unbroadcast(reader, node) and self._recompute_pays(reader, node):
                        reader.recomputed.append(node)
        return kernels

    def _recompute_pays(self, reader: FusedKernel, node: Node) -> bool:
        """Whether `reader` computes the requested value `node` again where it reads it rather than loading it.
        Loading costs a launch after the kernel writing it and a read of it; recomputing costs, each time the
        reader evaluates it per element, its cone's work over the reader's elements and reads of what the cone
        loads. A cone of more than MAX_RECOMPUTE_OPS ops evaluated several times per element (a filter over
        resampled pixels) is loaded regardless, as such a shared producer is stored. The decision is kept for
        explain."""
        ops, reads = self._cone(node)
        times = self._evaluations(reader, node)
        elements = math.prod(reader.space)
        costs = self.costs
        read = sum(min(r.numel, elements) * r.dtype.itemsize for r in reads)
        recompute = times * (ops * elements / costs.alu_rate + read / costs.bandwidth)
        own = node.numel * node.dtype.itemsize
        load = own / costs.bandwidth + costs.launch_seconds
        what = (f"{node.op.label} {list(node.shape)} {node.dtype.name}, a requested value read at other positions "
                f"({'once' if times == 1 else f'{times} times'} per element)")
        if times > 1 and ops > MAX_RECOMPUTE_OPS:
            pays, why = False, f"its {ops} ops are too many to recompute {times} times"
        else:
            pays = recompute <= load
            why = (f"{ops} ops per element and reads of {_mib(read)}{'' if times == 1 else f', {times} times,'} take "
                   f"{_us(recompute)}, {'less' if pays else 'more'} than a launch after the kernel writing it and a "
                   f"read of {_mib(own)} ({_us(load)})")
        reader.decisions.append(f"recomputes {what} where it reads it: {why}" if pays else
                                f"loads {what} once it is written: {why}")
        return pays

    def _reaches_unbroadcast(self, kernel: FusedKernel, node: Node) -> bool:
        """Whether computing `kernel`'s outputs reads `node` along a path through no broadcast."""
        stack, seen = list(kernel.outputs), set()
        while stack:
            n = stack.pop()
            if n is node:
                return True
            if id(n) in seen or n.op is Op.EXPAND or (n not in kernel.outputs and n not in kernel.recomputed and (
                    id(n) in self.stored or n.op is Op.BUFFER)):
                continue
            seen.add(id(n))
            stack.extend(n.inputs)
        return False

    def _evaluations(self, kernel: FusedKernel, node: Node) -> int:
        """How many times computing one element of `kernel`'s outputs evaluates `node`: the paths to it through
        the values the kernel computes (two reaching the same position count twice)."""
        covers, _ = self._covers(kernel)
        paths: dict[int, int] = defaultdict(int)
        for o in kernel.outputs:
            paths[id(o)] += 1
        for n in reversed(covers):  # readers before what they read
            for i in {id(i): i for i in n.inputs}.values():
                paths[id(i)] += paths[id(n)]
        return paths[id(node)]

    # -- step 6: chains of narrow GEMM kernels become one MLP kernel ----------------------
    def chain_mlps(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        """GEMM kernels that feed each other, each one's outputs read by the next through its first
        operand (its mainloop, pointwise ops only), with the same rows, dtype and every width at most
        MLP_MAX_WIDTH, become one kernel: each program takes a tile of rows through all the layers, the
        activations between them kept on chip. An intermediate that other kernels read too (a training
        step's backward reads the forward's) is also written by the layer that computes it, from registers.
        A wider layer keeps per-layer GEMMs."""
        gemms = [k for k in kernels if self._chainable(k)]
        if len(gemms) < 2:
            return kernels
        refs = {id(k): self.references(k) for k in kernels}
        deps = self._dependencies(kernels, refs)
        feeds: dict[int, FusedKernel] = {}  # id(kernel) -> the kernel it feeds
        fed: set[int] = set()
        for k in gemms:
            for nxt in gemms:
                if nxt is not k and id(nxt) not in fed and self._feeds(k, nxt):
                    feeds[id(k)] = nxt
                    fed.add(id(nxt))
                    break
        chains = []
        starts = [k for k in gemms if id(k) not in fed and id(k) in feeds]
        for k in starts:
            chain = [k]
            while id(chain[-1]) in feeds:
                nxt = feeds[id(chain[-1])]
                if not self._extends(chain, nxt, refs, deps):  # it starts a chain of its own
                    if id(nxt) in feeds:
                        starts.append(nxt)
                    break
                chain.append(nxt)
            if len(chain) > 1:
                chains.append(chain)
        parts = []  # (the layers of one MLP kernel, what it says)
        for chain in chains:
            widths = [chain[0].core.inputs[0].shape[-1]] + [k.core.shape[-1] for k in chain]
            text = "-".join(map(str, widths))
            runs = _narrow_runs(widths)
            if not runs:  # no two narrow layers side by side: the whole chain is GEMMs
                wide = next(w for w in widths if w > MLP_MAX_WIDTH)
                for k in chain:
                    k.decisions.append(f"per-layer GEMMs: a chain of {len(chain)} layers, widths {text}; width {wide} "
                                       f"is over {MLP_MAX_WIDTH}, more than fits on chip")
                continue
            for i, k in enumerate(chain):
                if not any(start <= i < stop for start, stop in runs):
                    wide = max(widths[i], widths[i + 1])
                    why = (f"width {wide} is over {MLP_MAX_WIDTH}, more than fits on chip" if wide > MLP_MAX_WIDTH
                           else "no narrow layer beside it to share a kernel with")
                    k.decisions.append(f"per-layer GEMM for layer {i + 1} of a chain of {len(chain)} layers, widths "
                                       f"{text}: {why}")
            for start, stop in runs:
                said = f"one kernel: {stop - start} layers, widths {'-'.join(map(str, widths[start:stop + 1]))}"
                if stop - start < len(chain):
                    said += f" (layers {start + 1}-{stop} of a chain of {len(chain)}, widths {text})"
                parts.append((chain[start:stop], said))
        for chain, said in parts:
            last = chain[-1]
            members = {id(k) for k in chain}
            mlp = FusedKernel(KernelKind.MLP, last.space, (), [], {})
            sums = []
            for layer, k in enumerate(chain):
                sums += self._column_sums(k)
                for o in k.outputs:
                    if summed_output(k, o) is not None:
                        continue
                    read_elsewhere = any(id(o) in r for key, r in refs.items() if key not in members)
                    if k is last or read_elsewhere or id(o) in self.output_ids:
                        mlp.outputs.append(o)
                        mlp.levels[id(o)] = FULL
                        mlp.layers[id(o)] = layer
                    else:
                        self.stored.discard(id(o))
            mlp.cores = [k.core for k in chain]
            mlp.decisions = [said]
            for f in sums:  # described now that the chain's values stay on chip
                self._take_sum(mlp, f, "adding each row tile's sums atomically")
            _note_written(mlp)
            at = kernels.index(last)
            kernels[at] = mlp
            for k in chain[:-1]:
                kernels.remove(k)
        if not parts:
            return kernels
        # an intermediate's readers may have come before the last layer: launch in dependency order again
        return self._kernel_order(kernels, {id(k): self.references(k) for k in kernels})

    def _chainable(self, k: FusedKernel) -> bool:
        """A 2-d GEMM kernel whose outputs are its epilogue's values, or sums of them over its rows (each column's,
        which a chain takes per program: see `_column_sums`)."""
        core = k.core
        if k.kind is not KernelKind.MATMUL or core is None or len(core.shape) != 2 or core.shape[0] == 0:
            return False
        sums = self._column_sums(k)
        return sums is not None and len(sums) <= MLP_MAX_SUMS and all(
            o.shape == core.shape or summed_output(k, o) is not None for o in k.outputs)

    def _column_sums(self, k: FusedKernel) -> list[FusedKernel] | None:
        """A GEMM kernel's epilogue sums over its rows (one per column, which it would add across its row tiles
        atomically), each as a row kernel of its own that an MLP kernel takes per program (`absorb_sums`); None
        if it has other reductions."""
        found = []
        for r in k.reductions:
            if r.op is not Op.SUM or tuple(r.attrs["axes"]) != (0,) or not r.dtype.is_floating_point or (
                    r.inputs[0].shape != k.core.shape or summed_operand(k.core, r) is not None):
                return None
            outputs = [o for o in k.outputs if summed_output(k, o) is r]
            found.append(FusedKernel(KernelKind.REDUCE, k.core.shape, (0,), outputs, {id(o): ROW for o in outputs},
                                     [r]))
        return found

    def _feeds(self, k: FusedKernel, nxt: FusedKernel) -> bool:
        """Whether `nxt`'s first operand is computed from `k`'s outputs, element for element (pointwise ops
        only, so each program has the rows it needs in registers), with the same rows and element type, and
        its weight is not."""
        if nxt.core.dtype is not k.core.dtype or nxt.core.shape[0] != k.core.shape[0]:
            return False
        outputs = {id(o) for o in k.outputs}
        if outputs & self.given:
            return False
        operand, weight = nxt.core.inputs
        if id(weight) in outputs or any(id(r) in outputs for r in self._inside(weight)[1]):
            return False
        if id(operand) in outputs:
            return True
        inside, reads = self._inside(operand)
        if not any(id(r) in outputs for r in reads):
            return False
        # every op between the operand and k's outputs is elementwise over the same [rows, width] positions
        return all(n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) and n.shape == operand.shape
                   for n in inside if self._cone_reaches(n, outputs))

    def _extends(self, chain: list[FusedKernel], nxt: FusedKernel, refs: dict, deps: dict) -> bool:
        """Whether `nxt` can join the chain as its next layer: of the chain's outputs it reads only those of
        the layer before it (the registers it was fed from), and nothing it reads waits on the chain."""
        members = {id(k) for k in chain} | {id(nxt)}
        earlier = {id(o) for k in chain[:-1] for o in k.outputs}
        if earlier & set(refs[id(nxt)]):
            return False
        fed = {id(o) for o in chain[-1].outputs}
        stack, seen = [o for o in nxt.outputs if o is not nxt.core], set()
        while stack:  # the epilogue (above the accumulator) reads what fed the operand: not in registers there
            n = stack.pop()
            if id(n) in seen or n is nxt.core:
                continue
            seen.add(id(n))
            if id(n) in fed:
                return False
            if id(n) not in self.stored or n in nxt.outputs:
                stack.extend(n.inputs)
        seen, frontier = set(), [d for d in deps[id(nxt)] if d not in members]
        while frontier:
            d = frontier.pop()
            if d in members:
                return False  # a kernel outside the chain between two of its layers: a cycle
            if d not in seen:
                seen.add(d)
                frontier.extend(deps[d])
        return True

    # -- step 6b: weight gradients summed inside the MLP kernels that hold their operands --
    def absorb_gradients(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        """A GEMM summing over an MLP kernel's rows, dot(P^T, Q) with P and Q [rows, w] (a layer's weight
        gradient: P the gradient at the layer's output, Q its input), joins the MLP kernel whose row tiles
        compute or load most of its operands' bytes: each of its programs adds its row tiles' products (and
        the operands' sums along the rows, a bias gradient) to an accumulator in registers and stores one
        partial; a second function adds the partials and runs the GEMM's epilogue (an optimizer update).
        Operands the MLP kernel computes are then not written, and none is read again by a GEMM. Each MLP
        kernel takes gradients up to MLP_GRADIENT_ELEMENTS accumulator elements, the largest savings first."""
        mlps = [k for k in kernels if k.kind is KernelKind.MLP]
        candidates = [k for k in kernels if self._gradient_operands(k) is not None]
        if not mlps or not candidates:
            return kernels
        room = {id(k): MLP_GRADIENT_ELEMENTS for k in mlps}
        # the largest savings first; among equal ones, the gradient summed latest in a chain first: the kernel then
        # writes, for the GEMMs left, the values of its earlier layers (H100, a 64-wide training step's backward
        # kernel: 94 us summing its second and third layers' gradients, 115 us summing its first and second)
        for g in sorted(candidates, key=lambda g: (-self._operand_bytes(g), -self._chain_layer(g.core.inputs[0],
                                                                                                mlps))):
            refs = {id(k): self.references(k) for k in kernels}
            scored = [(self._absorb_score(mlp, g, kernels, refs, room[id(mlp)]), mlp) for mlp in mlps]
            scored = [(score, mlp) for score, mlp in scored if score]
            if not scored:
                continue
            _, mlp = max(scored, key=lambda s: s[0])
            p, q = self._gradient_operands(g)
            room[id(mlp)] -= padded_width(p.shape[1]) * padded_width(q.shape[1])
            self.describe(g)  # its epilogue, as planned alone: the finishing function's
            mlp.absorbed.append(g)
            for o in g.outputs:
                mlp.outputs.append(o)
                mlp.levels[id(o)] = g.levels[id(o)]
            mlp.reductions += g.reductions
            kernels.remove(g)
            mlp.decisions.append(
                f"sums the weight gradient {list(g.core.shape)} over its {p.shape[0]} rows (each program its row "
                f"tiles, one partial each) from values its tiles hold, instead of a GEMM reading "
                f"{_mib(self._operand_bytes(g))}; a second launch adds the partials")
            self._unstore_intermediates(mlp, kernels)
        return self._kernel_order(kernels, {id(k): self.references(k) for k in kernels})

    def _chain_layer(self, x: Node, mlps: list[FusedKernel], through_outputs: bool = False) -> int:
        """The latest layer of the MLP kernels `mlps` whose result computing `x` reads, not through a stored value
        (but through the values they write, with `through_outputs`); -1 for none."""
        layers = {id(c): i for mlp in mlps for i, c in enumerate(mlp.cores)}
        computed = {id(o) for mlp in mlps for o in mlp.outputs} if through_outputs else set()
        latest, stack, seen = -1, [x], set()
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if id(n) in layers:
                latest = max(latest, layers[id(n)])
                continue
            if n.op is Op.BUFFER or (id(n) in self.stored and id(n) not in computed):
                continue
            stack.extend(n.inputs)
        return latest

    def _gradient_operands(self, g: FusedKernel) -> tuple[Node, Node] | None:
        """(P, Q) of a 2-d GEMM kernel computing dot(P^T, Q), P and Q of widths an MLP kernel can hold,
        whose reductions all sum an operand along K; None for any other kernel."""
        core = g.core
        if g.kind is not KernelKind.MATMUL or core is None or len(core.shape) != 2:
            return None
        a, q = core.inputs
        if a.op is not Op.PERMUTE or tuple(a.attrs["order"]) != (1, 0) or id(a) in self.stored:
            return None
        p = a.inputs[0]
        if len(p.shape) != 2 or p.shape[0] != q.shape[0] or max(p.shape[1], q.shape[1]) > MLP_MAX_WIDTH:
            return None
        if any(summed_operand(core, r) is None for r in g.reductions):
            return None
        return p, q

    def _operand_bytes(self, g: FusedKernel) -> int:
        """What a weight-gradient GEMM kernel's operands load: their stored inputs' bytes."""
        return sum(n.numel * n.dtype.itemsize for n in self._operand_reads(g))

    def _operand_reads(self, g: FusedKernel) -> list[Node]:
        """The stored values and inputs a GEMM kernel's operands load (an operand stored itself included)."""
        reads: dict[int, Node] = {}
        for operand in g.core.inputs:
            if id(operand) in self.stored or operand.op is Op.BUFFER:
                reads[id(operand)] = operand
            else:
                reads.update((id(n), n) for n in self._inside(operand)[1])
        return list(reads.values())

    def _absorb_score(self, mlp: FusedKernel, g: FusedKernel, kernels: list[FusedKernel], refs: dict,
                      room: int) -> int:
        """The bytes of `g`'s operand reads that `mlp` computes (counted twice: their stores may go too) or loads
        anyway; 0 where `g` cannot join it: other rows or dtype, a width no layer has, no accumulator room left,
        weights that would no longer fit on chip, an operand needing a layer's value other than elementwise,
        `mlp` reading what `g` writes (its finishing launch runs after the layers), `g` and a gradient `mlp`
        already sums reading each other's results (one launch finishes both), or a cycle through a third
        kernel."""
        p, q = self._gradient_operands(g)
        core = mlp.cores[0]
        widths = mlp_widths(mlp)
        if p.shape[0] != core.shape[0] or g.core.dtype is not core.dtype or not {p.shape[1], q.shape[1]} <= set(widths):
            return 0
        if padded_width(p.shape[1]) * padded_width(q.shape[1]) > room:
            return 0
        # its programs walk row tiles holding the weights on chip, beside the gradient's two operand tiles
        if not mlp_blocks(widths, core.dtype.itemsize, written_intermediates(mlp) + 2 * (len(mlp.absorbed) + 1))[3]:
            return 0
        computed = {id(o) for o in mlp.outputs}
        loaded = set(refs[id(mlp)])
        reads = self._operand_reads(g)
        score = sum((2 if id(n) in computed else 1 if id(n) in loaded else 0) * n.numel * n.dtype.itemsize
                    for n in reads)
        if not score or not all(self._elementwise_over_layers(mlp, x) for x in (p, q)):
            return 0
        if id(g) in self._dependencies(kernels, refs)[id(mlp)]:
            return 0
        finished = {id(o) for a in mlp.absorbed + mlp.summed for o in a.outputs}
        if {id(n) for n in reads} & finished or self._epilogue_reads(g) & finished:
            return 0
        if any({id(o) for o in g.outputs} & self._epilogue_reads(a) for a in mlp.absorbed):
            return 0
        return score if self._acyclic(mlp, g, kernels, refs) else 0

    def _elementwise_over_layers(self, mlp: FusedKernel, x: Node) -> bool:
        """Whether every layer result of `mlp` that computing `x` inside it needs is reached through
        elementwise ops of x's own shape only (an MLP kernel has a layer's result only at its own element)."""
        cores = {id(c) for c in mlp.cores}
        outputs = {id(o) for o in mlp.outputs}
        stack, seen = [(x, True)], set()
        while stack:
            n, in_order = stack.pop()
            if (id(n), in_order) in seen:
                continue
            seen.add((id(n), in_order))
            if id(n) in cores:
                if not in_order or n.shape != x.shape:
                    return False
                continue
            if n.op is Op.BUFFER or (id(n) in self.stored and id(n) not in outputs):
                continue
            keeps = in_order and n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) and n.shape == x.shape
            stack.extend((i, keeps) for i in n.inputs)
        return True

    def _unstore_intermediates(self, mlp: FusedKernel, kernels: list[FusedKernel]) -> None:
        """An MLP kernel's layer values that only its absorbed gradients and sums read (through their operands,
        the values summed) stay in registers: no longer written."""
        readers = set()
        for k in kernels:
            if k is not mlp:
                readers |= set(self.references(k))
        for g in mlp.absorbed + mlp.summed:
            readers |= self._epilogue_reads(g)
        for o in list(mlp.outputs):
            if id(o) in mlp.layers and id(o) not in readers and id(o) not in self.output_ids:
                mlp.outputs.remove(o)
                del mlp.layers[id(o)], mlp.levels[id(o)]
                self.stored.discard(id(o))
                if id(o) in self.shared:
                    self.shared[id(o)] = (f"{o.op.label} {list(o.shape)} {o.dtype.name}, read by "
                                          f"{len(self.users[id(o)])} ops, kept in registers: only this kernel reads it")
        _note_written(mlp)

    def _epilogue_reads(self, g: FusedKernel) -> set[int]:
        """Stored nodes a GEMM kernel's epilogue reads (not through its operands)."""
        reads, seen = set(), set()
        stack = [o for o in g.outputs if o is not g.core and summed_output(g, o) is None]
        while stack:
            n = stack.pop()
            if id(n) in seen or n is g.core or n in g.reductions:  # the accumulator and the operand sums
                continue
            seen.add(id(n))
            if n not in g.outputs and (id(n) in self.stored or n.op is Op.BUFFER):
                reads.add(id(n))
                continue
            stack.extend(n.inputs)
        return reads

    # -- step 6c: sums over an MLP kernel's rows (a loss) taken per program beside its layers --
    def absorb_sums(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        """A row kernel whose one reduction sums, over an MLP kernel's rows (all of its elements, or each
        column), a value the MLP kernel's tiles compute elementwise from its layers (a mean squared error of
        its output) joins that kernel: each program adds its row tiles' values into a partial in registers, the
        finishing launch adds the partials and runs the row kernel's epilogue. The value is then neither
        computed again nor, where nothing else reads them, are the layer results it came from written. A sum
        staged in two kernels (`passes`' split of a long reduction) joins with both."""
        mlps = [k for k in kernels if k.kind is KernelKind.MLP]
        if not mlps:
            return kernels
        refs = {id(k): self.references(k) for k in kernels}
        for f in [k for k in kernels if k.kind is KernelKind.REDUCE]:
            if f not in kernels:  # a first stage taken with its second
                continue
            found = self._row_sum(f, kernels, refs)
            if found is None:
                continue
            value, first = found
            group = [f] + ([first] if first is not None else [])
            mlp = next((m for m in mlps if self._sums_inside(m, f, value, group, kernels, refs)), None)
            if mlp is None:
                continue
            if first is not None:  # its partials are the MLP kernel's own now
                kernels.remove(first)
                self.stored.discard(id(first.outputs[0]))
            kernels.remove(f)
            self._take_sum(mlp, f, f"{len(group)} reduction kernel{'s' if len(group) > 1 else ''}")
            self._unstore_intermediates(mlp, kernels)
            refs = {id(k): self.references(k) for k in kernels}
        return self._kernel_order(kernels, refs)

    def _take_sum(self, mlp: FusedKernel, f: FusedKernel, instead: str) -> None:
        """MLP kernel `mlp` takes row kernel `f`'s sum over its rows: its outputs and reduction become the kernel's,
        finished by its second launch; explain says what it replaces (`instead`)."""
        self.describe(f)  # what its epilogue reads, as the finishing launch computes it
        mlp.summed.append(f)
        mlp.reductions += f.reductions
        for o in f.outputs:
            mlp.outputs.append(o)
            mlp.levels[id(o)] = f.levels[id(o)]
        (r,) = f.reductions
        value = summed_views(r)[0]
        mlp.decisions.append(
            f"sums {list(value.shape)} into {list(r.shape)} over its {value.shape[0]} rows (each program its row "
            f"tiles, one partial each) from values its tiles hold, instead of {instead}; its second launch adds the "
            "partials")

    def _row_sum(self, f: FusedKernel, kernels: list[FusedKernel], refs: dict
                 ) -> tuple[Node, FusedKernel | None] | None:
        """(V, the first stage's kernel or None) when row kernel `f` computes, with its one reduction, the sum of
        a 2-d value V over every element, or over its rows for each column, and writes only values of one per
        output of that sum (ROW level); None otherwise. The sum may be staged: `f` sums the partial sums that
        another row kernel (only `f` reads them) took of V reshaped or zero-padded (each column kept apart, for
        a sum per column). Summing V's elements in another grouping gives the same sum."""
        if f.segments or len(f.reductions) != 1 or any(f.levels[id(o)] != ROW for o in f.outputs):
            return None
        r = f.reductions[0]
        if r.op is not Op.SUM or not r.dtype.is_floating_point:
            return None
        value, views, s = summed_views(r)
        first = None
        if s is not None:
            first = next((k for k in kernels if k.outputs == [s]), None)
            readers = [k for k in kernels if id(s) in refs[id(k)]]
            if (first is None or first.kind is not KernelKind.REDUCE or first.reductions != [s] or readers != [f]
                    or id(s) in self.output_ids):
                return None
        if any(v.op is Op.PAD and v.attrs["value"] != 0 for v in views):
            return None
        if len(value.shape) != 2 or value.op.kind is Kind.LEAF:
            return None
        if r.numel == 1:
            return value, first
        # a sum per column: each view keeps the column as its last axis, unpadded, and no sum reduces it
        width = value.shape[1]
        kept = all(v.shape[-1] == width for v in views) and all(
            v.attrs["pads"][-1] == (0, 0) for v in views if v.op is Op.PAD)
        sums = [r] + ([s] if s is not None else [])
        summed_last = any(n.inputs[0].shape[-1] != width or len(n.shape) - 1 in n.attrs["axes"] for n in sums)
        if r.numel != width or not kept or summed_last:
            return None
        return value, first

    def _sums_inside(self, mlp: FusedKernel, f: FusedKernel, value: Node, group: list[FusedKernel],
                     kernels: list[FusedKernel], refs: dict) -> bool:
        """Whether `mlp` can take the sum of `value` that row kernel `f` (with the rest of `group`) computes: the
        same rows, a width one of its layers has, `value` computed elementwise from its layers' results (at least
        one; if it is stored, `mlp` writes it), `mlp` not reading what the group writes, the group not reading
        what `mlp`'s finishing launch writes nor that launch's other parts reading what `f` writes (it finishes
        all at once), and no cycle through another kernel."""
        core = mlp.cores[0]
        widths = mlp_widths(mlp)
        if value.shape[0] != core.shape[0] or value.shape[1] not in widths or len(mlp.summed) >= MLP_MAX_SUMS:
            return False
        if id(value) in self.stored and value not in mlp.outputs:  # another kernel computes it
            return False
        if self._chain_layer(value, [mlp], through_outputs=True) < 0 or not self._elementwise_over_layers(mlp, value):
            return False
        written = {id(o) for k in group for o in k.outputs}
        if written & set(refs[id(mlp)]):
            return False
        finished = {id(o) for g in mlp.absorbed + mlp.summed for o in g.outputs}
        reads = set().union(*(refs[id(k)] for k in group))
        if reads & finished or any(written & self._epilogue_reads(g) for g in mlp.absorbed + mlp.summed):
            return False
        return self._group_acyclic([mlp] + group, kernels, refs)

    def _group_acyclic(self, group: list[FusedKernel], kernels: list[FusedKernel], refs: dict) -> bool:
        """Whether the kernels of `group`, made one, leave the kernel graph acyclic: nothing they need waits on
        a kernel that needs one of them."""
        deps = self._dependencies(kernels, refs)
        members = {id(k) for k in group}
        frontier = [d for k in group for d in deps[id(k)] if d not in members]
        seen = set(frontier)
        while frontier:
            d = frontier.pop()
            if d in members:
                return False
            for e in deps[d] - seen:
                seen.add(e)
                frontier.append(e)
        return True

    # -- step 5: merge kernels over one space, then segment pointwise launches -----------
    def merge(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        refs = {id(k): self.references(k) for k in kernels}
        groups: dict[tuple, list[FusedKernel]] = defaultdict(list)
        for k in self._kernel_order(kernels, refs):
            if k.kind in (KernelKind.POINTWISE, KernelKind.REDUCE):
                groups[(k.kind, k.space, k.axes)].append(k)
        for group in groups.values():
            merged: list[FusedKernel] = []
            for k in group:
                for target in merged:
                    if self._mergeable(target, k, kernels, refs):
                        self._absorb(target, k)
                        kernels.remove(k)
                        del refs[id(k)]
                        refs[id(target)] = self.references(target)
                        break
                else:
                    merged.append(k)
        return self._kernel_order(kernels, refs)

    def _dependencies(self, kernels: list[FusedKernel], refs: dict) -> dict[int, set[int]]:
        produced = {id(o): k for k in kernels for o in k.outputs}
        return {id(k): {id(produced[r]) for r in refs[id(k)] if r in produced} - {id(k)} for k in kernels}

    def _mergeable(self, a: FusedKernel, b: FusedKernel, kernels: list[FusedKernel], refs: dict) -> bool:
        """Merging must not need a value at another index, nor close a cycle through a third kernel."""
        for x, y in ((a, b), (b, a)):
            for o in x.outputs:
                if id(o) in refs[id(y)] and not refs[id(y)][id(o)] <= {x.levels[id(o)]}:
                    return False
        return self._acyclic(a, b, kernels, refs)

    def _acyclic(self, a: FusedKernel, b: FusedKernel, kernels: list[FusedKernel], refs: dict) -> bool:
        deps = self._dependencies(kernels, refs)
        for src, dst in ((a, b), (b, a)):
            frontier = [d for d in deps[id(dst)] if d != id(src)]
            seen = set(frontier)
            while frontier:
                k = frontier.pop()
                if k == id(src):
                    return False
                for d in deps[k] - seen:
                    seen.add(d)
                    frontier.append(d)
        return True

    def _absorb(self, a: FusedKernel, b: FusedKernel) -> None:
        for o in b.outputs:
            if o not in a.outputs:
                a.outputs.append(o)
                a.levels[id(o)] = b.levels[id(o)]
        for r in b.reductions:
            if r not in a.reductions:
                a.reductions.append(r)
        a.reductions.sort(key=lambda n: self.position[id(n)])
        a.recomputed += [n for n in b.recomputed if n not in a.recomputed]
        a.decisions = a.decisions + [d for d in b.decisions if d not in a.decisions]

    def _kernel_order(self, kernels: list[FusedKernel], refs: dict) -> list[FusedKernel]:
        deps = self._dependencies(kernels, refs)
        by_id = {id(k): k for k in kernels}
        # by the graph position of a kernel's first output, never by id(): addresses differ from run to run, and the
        # order decides later choices (which weight gradients an MLP kernel sums), so the plan would too
        first = {id(k): min(self.position[id(o)] for o in k.outputs) for k in kernels}
        ordered, done = [], set()
        for start in sorted(kernels, key=lambda k: first[id(k)]):
            stack = [(start, iter(sorted(deps[id(start)], key=first.__getitem__)))]
            if id(start) in done:
                continue
            done.add(id(start))
            while stack:
                k, it = stack[-1]
                for d in it:
                    if d not in done:
                        done.add(d)
                        stack.append((by_id[d], iter(sorted(deps[d], key=first.__getitem__))))
                        break
                else:
                    stack.pop()
                    ordered.append(k)
        return ordered

    def segment(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        """Group independent pointwise kernels (same depth in the kernel graph) into one launch each. A pointwise
        kernel that no other kernel reads (an optimizer's update of a parameter) waits for the deepest level, so
        all such kernels share the last launches."""
        refs = {id(k): self.references(k) for k in kernels}
        deps = self._dependencies(kernels, refs)
        depth: dict[int, int] = {}
        for k in kernels:  # kernels come in launch order
            depth[id(k)] = 1 + max((depth[d] for d in deps[id(k)]), default=-1)
        read = set().union(*deps.values()) if deps else set()
        deepest = max(depth.values(), default=0)
        for k in kernels:
            if k.kind is KernelKind.POINTWISE and id(k) not in read:
                depth[id(k)] = deepest
        out: list[tuple[int, FusedKernel]] = []
        open_groups: dict[int, FusedKernel] = {}
        for k in kernels:
            level = depth[id(k)]
            if k.kind is not KernelKind.POINTWISE:
                out.append((level, k))
                continue
            group = open_groups.get(level)
            if group is None or len(group.segments) >= MAX_SEGMENTS:
                group = FusedKernel(KernelKind.SEGMENTED, (), ())
                open_groups[level] = group
                out.append((level, group))
            group.segments.append(k)
        # a group runs after everything its members need: launch by depth (stable within a depth)
        out.sort(key=lambda pair: pair[0])
        return [g.segments[0] if g.kind is KernelKind.SEGMENTED and len(g.segments) == 1 else g for _, g in out]

    def describe(self, kernel: FusedKernel) -> None:
        """Fill in what a kernel covers and reads, for explain and for the runtime."""
        for part in kernel.segments:
            self.describe(part)
        if kernel.segments:
            kernel.covers = [n for p in kernel.segments for n in p.covers]
            kernel.reads = list({id(n): n for p in kernel.segments for n in p.reads}.values())
            kernel.outputs = [o for p in kernel.segments for o in p.outputs]
            kernel.decisions = [d for p in kernel.segments for d in p.decisions]
            return
        kernel.covers, kernel.reads = self._covers(kernel)
        self._roles(kernel)
        # a shared producer's decision where it draws a kernel boundary (stored) or is recomputed across one
        kernel.decisions = kernel.decisions + [
            self.shared[id(n)] for n in kernel.covers if id(n) in self.shared and (
                id(n) in self.stored or any(u.op.kind in (Kind.REDUCE, Kind.CONTRACTION) for u in self.users[id(n)]))]

    def _covers(self, kernel: FusedKernel) -> tuple[list[Node], list[Node]]:
        """What a kernel computes, and the stored values and inputs it loads, each in graph order."""
        covers, reads, seen = [], [], set()
        stack = list(kernel.outputs)
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            inside = n in kernel.outputs or n in kernel.reductions or n in kernel.recomputed
            if not inside and (id(n) in self.stored or n.op is Op.BUFFER):
                reads.append(n)
                continue
            covers.append(n)
            stack.extend(n.inputs)
        return sorted(covers, key=lambda n: self.position[id(n)]), sorted(reads, key=lambda n: self.position[id(n)])

    def _roles(self, kernel: FusedKernel) -> None:
        """Cores, per-operand prologues and the epilogue of a described kernel. A GEMM's operand sums
        along K belong to the mainloop of the operand they sum."""
        inside = {id(n) for n in kernel.covers}
        if kernel.core is not None:
            kernel.cores = [kernel.core]
            operands = list(kernel.core.inputs)
            sums = {id(r): summed_operand(kernel.core, r) for r in operand_sums(kernel)}
        elif kernel.kind is KernelKind.MLP:  # cores set by chain_mlps; between them, the layers' epilogues
            operands = [kernel.cores[0].inputs[0]] + [c.inputs[1] for c in kernel.cores]
            sums = {}
        else:
            kernel.cores = [n for n in kernel.covers if n.op in OPAQUE or n.op is Op.SCATTER_ADD
                            or n in kernel.reductions]
            operands = [i for c in kernel.cores for i in c.inputs]
            sums = {}
        cores = {id(c) for c in kernel.cores}
        taken: set[int] = set(cores)
        kernel.prologues = []
        for position, operand in enumerate(operands):
            cone: list[Node] = []
            stack = [operand]
            while stack:
                n = stack.pop()
                if id(n) not in inside or id(n) in taken:
                    continue
                taken.add(id(n))
                cone.append(n)
                stack.extend(n.inputs)
            # an operand's sum along K, and the reshape that stores it, belong with the operand
            cone += [n for n in kernel.covers
                     if id(n) not in taken and sums.get(id(summed_output(kernel, n))) == position]
            taken |= {id(n) for n in cone}
            kernel.prologues.append(sorted(cone, key=lambda n: self.position[id(n)]))
        kernel.epilogue = [n for n in kernel.covers if id(n) not in taken]


def _under_reshapes(node: Node) -> Node:
    while node.op is Op.RESHAPE:
        node = node.inputs[0]
    return node


def summed_output(kernel: FusedKernel, output: Node) -> Node | None:
    """The reduction of a GEMM kernel (an operand's sum along K, or a reduction of its epilogue) that
    `output` stores, itself or through a reshape; None for any other output."""
    source = _under_reshapes(output)
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
    x = _under_reshapes(r.inputs[0])
    first = x if x.op is Op.SUM else None
    if first is not None:
        x = first.inputs[0]
    views = []
    while x.op in (Op.RESHAPE, Op.PAD):
        views.append(x)
        x = x.inputs[0]
    return x, views, first


def _narrow_runs(widths: list[int]) -> list[tuple[int, int]]:
    """The runs of two or more consecutive layers (start, stop) of a chain with these widths whose inputs and
    outputs are all at most MLP_MAX_WIDTH wide (layer i reads widths[i], writes widths[i + 1]): the parts of the
    chain that fit on chip."""
    fits = [max(a, b) <= MLP_MAX_WIDTH for a, b in zip(widths, widths[1:])]
    runs, start = [], 0
    for i, narrow in enumerate([*fits, False]):
        if not narrow:
            if i - start > 1:
                runs.append((start, i))
            start = i + 1
    return runs


def mlp_widths(kernel: FusedKernel) -> list[int]:
    """An MLP kernel's widths: its input's, then each layer's output's."""
    return [kernel.cores[0].inputs[0].shape[-1]] + [c.shape[-1] for c in kernel.cores]


def written_intermediates(kernel: FusedKernel) -> int:
    """How many values other than the last layer's result an MLP kernel writes (for other kernels to read)."""
    last = len(kernel.cores) - 1
    return sum(1 for o in kernel.outputs if kernel.layers.get(id(o), last) < last)


def _note_written(mlp: FusedKernel) -> None:
    """The decision saying which intermediates an MLP kernel writes, kept second, after the chain's own."""
    mlp.decisions = [d for d in mlp.decisions if not d.startswith("also writes")]
    written = written_intermediates(mlp)
    if written:
        mlp.decisions.insert(1, f"also writes {written} intermediate{'s' if written > 1 else ''} that other kernels "
                                "read, from registers")


def mlp_blocks(widths: list[int], itemsize: int, written: int = 0, streamed: bool = False
               ) -> tuple[list[int], int, int, bool]:
    """An MLP kernel's widths padded for the matrix units (powers of two, at least 16), its rows per tile, its
    warps, and whether its programs are persistent (each loads the weights once and walks row tiles).
    `written`: the intermediate tiles it also stores, each of which may take a tile of shared memory to lay
    out for its store; `streamed`: hold no weights (the form that fits any GPU; the runtime falls back on it
    when a GPU cannot hold them)."""
    padded = [padded_width(w) for w in widths]
    weight_bytes = sum(a * b for a, b in zip(padded, padded[1:])) * itemsize
    if streamed:
        return padded, 128, 4, False
    for rows, budget in ((128, MLP_RESIDENT_BYTES[0]), (64, MLP_RESIDENT_BYTES[1])):
        if weight_bytes + written * rows * max(padded) * itemsize <= budget:
            return padded, rows, 4, True
    return padded, 128, 4, False


def padded_width(width: int) -> int:
    """A width as an MLP kernel lays it along a tile: a power of two, at least 16."""
    return max(16, 1 << (width - 1).bit_length())


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f} us"


def _dot_kind(dtype, context: CompileContext) -> str:
    if dtype is not dtypes.float32:
        return "half"
    return "float32" if context.dot_precision(dtype) == "ieee" else "tf32"


def plan(nodes: list[Node], outputs: list[Node], context: CompileContext, costs: Costs, fuse_gemms: bool = True,
         given: set[int] = frozenset()) -> tuple[list[FusedKernel], set[int]]:
    """Fused kernels in launch order, and the ids of the nodes that get buffers."""
    planner = Planner(nodes, outputs, context, costs, fuse_gemms, given)
    planner.choose_stored()
    kernels = planner.root_kernels()
    kernels = planner.pull_reductions(kernels)
    kernels = planner.fuse_gemms(kernels)
    kernels = planner.recompute_requested(kernels)
    kernels = planner.merge(kernels)
    kernels = planner.chain_mlps(kernels)
    kernels = planner.absorb_gradients(kernels)
    kernels = planner.absorb_sums(kernels)
    kernels = planner.segment(kernels)
    for i, k in enumerate(kernels):
        k.index = i
        for g in k.absorbed + k.summed:
            g.index = i
        planner.describe(k)
    for k in kernels:
        if k.core is not None:
            _plan_split(k, planner.position, context, costs)
    return kernels, set(planner.stored) - set(given)


def _plan_split(gemm: FusedKernel, position: dict[int, int], context: CompileContext, costs: Costs) -> None:
    """The GEMM kernel's nodes planned with a vendor matmul: its reads are the split plan's inputs."""
    nodes = sorted(gemm.reads + gemm.covers, key=lambda n: position[id(n)])
    given = {id(n) for n in gemm.reads}
    split, stored = plan(nodes, list(gemm.outputs), context, costs, fuse_gemms=False, given=given)
    gemm.split = split
    gemm.split_stored = stored - {id(o) for o in gemm.outputs}
