"""The generic fusion planner (`Planner`): the graph facts every pattern's planner step asks (users, what a value
inlines, what a kernel reads at which level, the kernels' dependencies), which values are stored and which are
computed again by their readers (the cost model), kernels rooted at stored values, merging kernels over one
space without closing a cycle, segmented launches, and the description of each kernel for explain. `fusion.plan`
runs it with the patterns' steps (compiler/patterns/).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

from ember.compiler.context import CompileContext
from ember.compiler.fused import (
    DRAWS_INLINE,
    FULL,
    GEMM_DTYPES,
    OPAQUE,
    OPAQUE_KINDS,
    OTHER,
    POINTWISE_HEAVY,
    ROW,
    Costs,
    FusedKernel,
    KernelKind,
    Level,
    element_nodes,
    input_level,
    is_leaf,
    mib,
    operand_sums,
    summed_operand,
    summed_output,
    us,
)
from ember.compiler.kernel_graph import KernelGraph, closes_cycle
from ember.compiler.layout import CONVOLUTIONS
from ember.ir import Kind, Node, Op
from ember.ir.ops import STRIDED_VIEWS

MAX_SEGMENTS = 64  # pointwise kernels fused into one launch at most
# Nodes one kernel computes at most where independent kernels join it (merging over one space, segmented launches):
# an Adam step over fifty parameters (about 1,000 nodes) stays one launch, while GPT-2's AdamW through the
# torch.compile backend (7,300 nodes: one kernel of 15,000 lines, the likely cause of a cold compile that ran for
# minutes, killed inside ptxas) becomes four of at most about 4,000 lines
MAX_KERNEL_OPS = 2048
# Reductions over one space merge into one kernel up to this many. A kernel that walks its reduced axis in a loop
# keeps a partial result per position of its tile for each reduction (compiler/patterns/rows.py), in registers:
# GPT-2's backward merged every layer's layer-norm and bias gradients, about 80 column sums over (8192, 768), into
# one kernel: 80 tiles of 32 registers a thread. With the cap, that step's reductions took 5.0 ms on an H200, not
# 19.1 (three single-launch kernels of 7.8, 6.1 and 2.9 ms were gone)
MAX_KERNEL_REDUCTIONS = 8
MAX_RECOMPUTE_OPS = 48  # a shared producer with a larger cone is stored, not recomputed
# A shared producer whose recomputation reads at most this many bytes, and whose readers' elements times its ops
# come to at most TINY_RECOMPUTE_WORK, is recomputed: storing it would save a few bytes but could take a launch
# of its own (a few microseconds, megabytes' worth of traffic); per-box or per-channel values
TINY_RECOMPUTE_BYTES = 16 * 1024
TINY_RECOMPUTE_WORK = 1 << 22
RAND_OPS = 8  # a random number (Philox rounds), in pointwise ops
# Simple operations a GPU spends on one evaluation of the ops it computes by a sequence (float32 division and
# square root correctly rounded, as torch computes them; powers, transcendental functions): an estimate used where
# the planner weighs recomputing a value against loading it
HEAVY_OPS = {Op.DIV: 16, Op.RECIPROCAL: 16, Op.SQRT: 16, Op.FLOORDIV: 16, Op.MOD: 16, Op.POW: 32, Op.EXP: 8,
             Op.LOG: 8, Op.LOG1P: 16, Op.SIN: 16, Op.COS: 16, Op.TANH: 16, Op.ERF: 16}


class Planner:
    """The state of one plan being made (the graph, what is stored, the cost model's decisions) and the generic
    steps over its kernels."""

    def __init__(self, nodes: list[Node], outputs: list[Node], context: CompileContext, costs: Costs,
                 replan: Callable, fuse_gemms: bool = True, given: set[int] = frozenset()):
        """`given`: nodes already stored elsewhere (a split plan's inputs); `fuse_gemms`: whether
        matmuls become generated GEMM kernels or vendor calls; `replan`: `fusion.plan`, for a plan's parts
        planned apart (`plan_apart`)."""
        self.nodes = nodes
        self.context = context
        self.costs = costs
        self.generate_gemms = fuse_gemms
        self.replan = replan
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

    # -- step 1: what is stored --------------------------------------------------------
    def choose_stored(self) -> None:
        """Outputs, the results of matmuls and convolutions and the operands of the vendor ones, reductions and
        scatters, and the shared producers the cost model says are cheaper to store than to recompute."""
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
                    if i.op is Op.PERMUTE and n.op in CONVOLUTIONS and n.attrs.get("channels_last"):
                        # cuDNN would transpose it itself, on each call: a weight, the network's input
                        stored.add(id(i))
                        continue
                    base = self.view_base(i)
                    if base.op is not Op.BUFFER and not (base.op is Op.RAND and n.op in DRAWS_INLINE):
                        stored.add(id(base))
            elif n.op is Op.SCATTER_ADD or n.op.kind is Kind.REDUCE:
                stored.add(id(n))
        broadcast = self._broadcast_elements()
        for n in self.nodes:  # upstream first, so a cone is final when it is measured
            if id(n) in stored or is_leaf(n):
                continue
            if id(n) in broadcast and self._store_before_broadcast(n, broadcast[id(n)]):
                stored.add(id(n))
            elif len(self.users[id(n)]) >= 2 and self._store_is_cheaper(n):
                stored.add(id(self._narrowest_exact_source(n)))

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

    def view_base(self, node: Node) -> Node:
        """The node under a chain of movement ops that a strided view can express."""
        while node.op in STRIDED_VIEWS and id(node) not in self.stored:
            node = node.inputs[0]
        return node

    def inside(self, node: Node) -> tuple[list[Node], list[Node]]:
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

    def cone(self, node: Node) -> tuple[int, list[Node]]:
        """Pointwise work and stored inputs of everything `node` inlines."""
        inside, reads = self.inside(node)
        return operations(inside), reads

    def _broadcast_elements(self) -> dict[int, int]:
        """id(value) -> the elements its broadcasts (through reshapes) make of it, for each value broadcast."""
        elements: dict[int, int] = defaultdict(int)
        for n in self.nodes:
            if n.op is Op.EXPAND:
                source = n.inputs[0]
                while source.op is Op.RESHAPE:
                    source = source.inputs[0]
                elements[id(source)] += n.numel
        return elements

    def _store_before_broadcast(self, node: Node, elements: int) -> bool:
        """Cost model for a value computed on few elements and broadcast to many: a batch norm's per-channel
        factors, read by each element of an activation. A reader recomputes it for each element it broadcasts
        to (a flat kernel over (N, H, W, C) evaluates a channel's divisions and square root N·H·W times);
        stored, it is computed once (in the epilogue of the reduction it reads, where it reads one) and each
        reader loads it. Stored where the work saved takes longer than a launch and the bytes stored: a value
        stored in a reduction's epilogue takes no launch of its own, but it can split a kernel that computed it
        beside its readers (a row's softmax), so only work worth a launch is moved."""
        if node.op in STRIDED_VIEWS or node.op.kind not in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) \
                or node.numel * 64 > elements:
            return False
        inside, reads = self.inside(node)
        work = operations(inside, weighed=True)
        costs = self.costs
        recompute = work * elements / costs.alu_rate
        moved = node.numel * node.dtype.itemsize * 2 + sum(r.numel * r.dtype.itemsize for r in reads)
        store = costs.launch_seconds + moved / costs.bandwidth
        if recompute <= store:
            return False
        self.shared[id(node)] = (f"{node.op.label} {list(node.shape)} {node.dtype.name}, broadcast to {elements:,} "
                                 f"elements, stored: recomputing its {work} operations for each takes "
                                 f"{us(recompute)}, storing it {us(store)}")
        return True

    def _store_is_cheaper(self, node: Node) -> bool:
        """Cost model for a producer with several users, in bytes moved.

        Recomputing it in each of its k users re-reads its cone's inputs k times;
        storing it writes it once and reads it k times, and reads the cone's inputs
        once. A producer whose cone holds much work is stored regardless.
        """
        ops, reads = self.cone(node)
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
        self.shared[id(node)] = (f"{what} {verdict}: storing moves {mib(store)}, recomputing reads "
                                 f"{mib(recompute)}" + (" (less than a launch costs)" if tiny else ""))
        return stored

    # -- step 2: one kernel per stored node ----------------------------------------------
    def root_kernels(self) -> list[FusedKernel]:
        kernels = []
        for n in self.nodes:
            if id(n) not in self.stored or n.op is Op.BUFFER or id(n) in self.given:
                continue
            if n.op in OPAQUE:
                core = n if self.is_gemm(n) else None
                kernels.append(FusedKernel(OPAQUE_KINDS[n.op], n.shape, (), [n], {id(n): FULL}, core=core,
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
        _, reads = self.cone(n)
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
            taken = [p.core for p in kernel.parts() if p.core is not None]  # its weight gradients' GEMMs
            inside = {id(n) for n in kernel.outputs + kernel.cores + taken}
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
        if kernel.kind in (KernelKind.MATMUL, KernelKind.CONV2D, KernelKind.SCATTER_ADD, KernelKind.ATTENTION,
                           KernelKind.SORT, KernelKind.COLLECTIVE):
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
            # an output is walked from as a root even where another output's walk stopped at it as a stored read
            key = (id(n), lv, is_root)
            if key in seen:
                continue
            seen.add(key)
            if n is kernel.core and not is_root:
                continue  # the accumulator, in registers
            if not is_root and (id(n) in self.stored or n.op is Op.BUFFER) and n not in kernel.reductions \
                    and n not in kernel.recomputed:
                refs[id(n)].add(lv)
                continue
            for p, i in enumerate(n.inputs):
                stack.append((i, input_level(n, lv, kernel.space, kernel.axes, p), False))

    def cone_reaches(self, node: Node, targets: set[int]) -> bool:
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
                           and not (math.prod(writers[r][1].space) == math.prod(reader.space)
                                    and refs[r] <= {FULL})]  # step 5 merges those
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
        ops, reads = self.cone(node)
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
            why = (f"{ops} ops per element and reads of {mib(read)}{'' if times == 1 else f', {times} times,'} take "
                   f"{us(recompute)}, {'less' if pays else 'more'} than a launch after the kernel writing it and a "
                   f"read of {mib(own)} ({us(load)})")
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
        covers, _ = self.covers_of(kernel)
        paths: dict[int, int] = defaultdict(int)
        for o in kernel.outputs:
            paths[id(o)] += 1
        for n in reversed(covers):  # readers before what they read
            for i in {id(i): i for i in n.inputs}.values():
                paths[id(i)] += paths[id(n)]
        return paths[id(node)]

    # -- step 5: merge kernels over one space, then segment pointwise launches -----------
    def merge(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        graph = KernelGraph(self, kernels)
        groups: dict[tuple, list[FusedKernel]] = defaultdict(list)
        for k in self.kernel_order(kernels, graph.refs):
            if k.kind is KernelKind.POINTWISE:
                # spaces of one size are one space: a pointwise kernel computes each element at its linear position,
                # which a reshape keeps (a bias add over (8192, 3072) and the GELU reading it over (8, 1024, 3072))
                groups[(k.kind, math.prod(k.space), k.axes)].append(k)
            elif k.kind is KernelKind.REDUCE:
                groups[(k.kind, k.space, k.axes)].append(k)
        for group in groups.values():
            if group[0].kind is KernelKind.POINTWISE:
                # kernels that share loads or feed one another join first (the pieces of one parameter's update),
                # then the others, while light (`apart`): else a piece of the next parameter's update joins the
                # first one's kernel, and the rest of its update follows it there
                group = self.join(group, kernels, graph, related_only=True)
            self.join(group, kernels, graph, related_only=False)
        return self.kernel_order(kernels, graph.refs)

    def join(self, group: list[FusedKernel], kernels: list[FusedKernel], graph: KernelGraph,
             related_only: bool) -> list[FusedKernel]:
        """Merge each kernel of `group` (in order) into the first earlier one it may join; the kernels left."""
        merged: list[FusedKernel] = []
        for k in group:
            for target in merged:
                if graph.ops(target) + graph.ops(k) <= MAX_KERNEL_OPS and len(target.reductions) + len(
                        k.reductions) <= MAX_KERNEL_REDUCTIONS and (self.related(target, k, graph) if related_only
                                                                    else not self.apart(target, k, graph)) \
                        and self.mergeable(target, k, graph):
                    graph.absorb(target, k)
                    kernels.remove(k)
                    break
            else:
                merged.append(k)
        return merged

    def related(self, a: FusedKernel, b: FusedKernel, graph: KernelGraph) -> bool:
        """Whether merged, kernels `a` and `b` would load something once for both: a value of more than one
        element both read, or one's output the other reads."""
        refs_a, refs_b = graph.refs[id(a)], graph.refs[id(b)]
        if any(id(o) in refs_b for o in a.outputs) or any(id(o) in refs_a for o in b.outputs):
            return True
        shared = refs_a.keys() & refs_b.keys()
        return any(r in self.position and self.nodes[self.position[r]].numel != 1 for r in shared)

    def apart(self, a: FusedKernel, b: FusedKernel, graph: KernelGraph) -> bool:
        """Whether pointwise kernels `a` and `b` stay apart: merged they would load nothing once for both (no
        value of more than one element read by both, neither reading the other's output), and would compute more
        nodes at each element than POINTWISE_HEAVY. The merged kernel would run a quarter of the elements a
        program (its values at each element take registers), so each of its loads moves a quarter of the bytes:
        an optimizer's update of twelve parameters of one shape, merged, read and wrote at 40% of the copy rate.
        Apart, segmentation still launches them together (such updates wait for the last launch)."""
        if a.kind is not KernelKind.POINTWISE or graph.ops(a) + graph.ops(b) <= POINTWISE_HEAVY:
            return False
        if element_nodes(self.covers_of(a)[0]) + element_nodes(self.covers_of(b)[0]) <= POINTWISE_HEAVY:
            return False
        return not self.related(a, b, graph)

    def dependencies(self, kernels: list[FusedKernel], refs: dict) -> dict[int, set[int]]:
        produced = {id(o): k for k in kernels for o in k.outputs}
        return {id(k): {id(produced[r]) for r in refs[id(k)] if r in produced} - {id(k)} for k in kernels}

    def mergeable(self, a: FusedKernel, b: FusedKernel, graph: KernelGraph) -> bool:
        """Merging must not need a value at another index, nor close a cycle through a third kernel."""
        refs = graph.refs
        for x, y in ((a, b), (b, a)):
            for o in x.outputs:
                if id(o) in refs[id(y)] and not refs[id(y)][id(o)] <= {x.levels[id(o)]}:
                    return False
        return graph.acyclic(a, b)

    def acyclic(self, a: FusedKernel, b: FusedKernel, kernels: list[FusedKernel], refs: dict) -> bool:
        return not closes_cycle(self.dependencies(kernels, refs), [a, b])

    def absorb(self, a: FusedKernel, b: FusedKernel) -> None:
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

    def kernel_order(self, kernels: list[FusedKernel], refs: dict) -> list[FusedKernel]:
        deps = self.dependencies(kernels, refs)
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
        """Group independent pointwise kernels (same depth in the kernel graph) into one launch each, of at most
        MAX_SEGMENTS kernels and MAX_KERNEL_OPS nodes. A pointwise kernel that no other kernel reads (an
        optimizer's update of a parameter) waits for the deepest level, so all such kernels share the last
        launches."""
        refs = {id(k): self.references(k) for k in kernels}
        deps = self.dependencies(kernels, refs)
        depth: dict[int, int] = {}
        for k in kernels:  # kernels come in launch order
            depth[id(k)] = 1 + max((depth[d] for d in deps[id(k)]), default=-1)
        read = set().union(*deps.values()) if deps else set()
        deepest = max(depth.values(), default=0)
        for k in kernels:
            if k.kind is KernelKind.POINTWISE and id(k) not in read:
                depth[id(k)] = deepest
        out: list[tuple[int, FusedKernel]] = []
        open_groups: dict[int, tuple[FusedKernel, list[int]]] = {}  # level -> (group, [its ops])
        for k in kernels:
            level = depth[id(k)]
            if k.kind is not KernelKind.POINTWISE:
                out.append((level, k))
                continue
            group, ops = open_groups.get(level, (None, [0]))
            size = len(self.covers_of(k)[0])
            if group is None or len(group.segments) >= MAX_SEGMENTS or ops[0] + size > MAX_KERNEL_OPS:
                group, ops = FusedKernel(KernelKind.SEGMENTED, (), ()), [0]
                open_groups[level] = group, ops
                out.append((level, group))
            group.segments.append(k)
            ops[0] += size
        # a group runs after everything its members need: launch by depth (stable within a depth)
        out.sort(key=lambda pair: pair[0])
        return [g.segments[0] if g.kind is KernelKind.SEGMENTED and len(g.segments) == 1 else g for _, g in out]

    def plan_apart(self, nodes: list[Node], outputs: list[Node], given: set[int]) -> tuple[list[FusedKernel], set[int]]:
        """`nodes` planned on their own with vendor matmuls, the `given` ones stored already (a GEMM's split
        form), under this plan's context and costs."""
        return self.replan(nodes, outputs, self.context, self.costs, fuse_gemms=False, given=given)

    # -- explain: what each kernel covers, reads and is made of ------------------------------
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
        kernel.covers, kernel.reads = self.covers_of(kernel)
        self._roles(kernel)
        # a shared producer's decision where it draws a kernel boundary (stored) or is recomputed across one
        kernel.decisions = kernel.decisions + [
            self.shared[id(n)] for n in kernel.covers if id(n) in self.shared and (
                id(n) in self.stored or any(u.op.kind in (Kind.REDUCE, Kind.CONTRACTION) for u in self.users[id(n)]))]

    def covers_of(self, kernel: FusedKernel) -> tuple[list[Node], list[Node]]:
        """What a kernel computes, and the stored values and inputs it loads, each in graph order."""
        covers, reads, seen = [], [], set()
        inside_ids = {id(n) for n in (*kernel.outputs, *kernel.reductions, *kernel.recomputed)}
        stack = list(kernel.outputs)
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            inside = id(n) in inside_ids
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


def operations(nodes: list[Node], weighed: bool = False) -> int:
    """The ops one evaluation of `nodes` computes (a random number counts RAND_OPS); `weighed`: in simple
    operations, HEAVY_OPS weighing the floating-point ones a GPU computes by a sequence."""
    counted = (Kind.UNARY, Kind.BINARY, Kind.TERNARY, Kind.INDEX, Kind.REDUCE)
    return sum(HEAVY_OPS.get(n.op, 1) if weighed and n.dtype.is_floating_point else 1
               for n in nodes if n.op.kind in counted) + RAND_OPS * sum(1 for n in nodes if n.op is Op.RAND)
