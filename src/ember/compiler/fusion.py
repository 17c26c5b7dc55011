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

Planning goes in four steps:
1. choose what must be stored (`materialized`): outputs, operands and results of
   the vendor ops (matmul, conv), reductions for now, and shared producers that
   the cost model below says are cheaper to store than to recompute;
2. every stored node roots a kernel that inlines everything unstored above it;
3. a reduction referenced by exactly one kernel, at ROW level over that kernel's
   space, is pulled into it instead of being stored;
4. kernels over the same space are merged when no path through a third kernel
   joins them (vertical and horizontal fusion); the pointwise kernels left are
   grouped, level by level, into segmented launches (one launch, many tensors).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from ember.ir import Kind, Node, Op

FULL, ROW, OTHER = "full", "row", "other"
OPAQUE = (Op.MATMUL, Op.CONV2D)
MAX_SEGMENTS = 64  # pointwise kernels fused into one launch at most
MAX_RECOMPUTE_OPS = 48  # a shared producer with a larger cone is stored, not recomputed


@dataclass(eq=False)
class FusedKernel:
    kind: str  # "pointwise", "reduce", "matmul", "conv2d", "scatter_add", "alias"
    space: tuple[int, ...]
    axes: tuple[int, ...]
    outputs: list[Node] = field(default_factory=list)
    levels: dict[int, str] = field(default_factory=dict)  # id(output) -> FULL or ROW
    reductions: list[Node] = field(default_factory=list)  # computed in registers, inputs first
    covers: list[Node] = field(default_factory=list)  # every node computed inside, for explain
    reads: list[Node] = field(default_factory=list)  # stored nodes and inputs it loads
    segments: list[FusedKernel] = field(default_factory=list)  # a segmented launch's parts
    index: int = 0

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


def input_level(node: Node, level: str, space: tuple[int, ...], axes: tuple[int, ...], position: int) -> str:
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
    def __init__(self, nodes: list[Node], outputs: list[Node]):
        self.nodes = nodes
        self.position = {id(n): i for i, n in enumerate(nodes)}
        self.outputs = outputs
        self.output_ids = {id(o) for o in outputs}
        self.users: dict[int, list[Node]] = defaultdict(list)
        for n in nodes:
            for i in n.inputs:
                self.users[id(i)].append(n)
        self.stored: set[int] = set()

    # -- step 1: what is stored --------------------------------------------------------
    def choose_stored(self) -> None:
        stored = self.stored
        stored |= self.output_ids
        for n in self.nodes:
            if n.op in OPAQUE:
                stored.add(id(n))
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
                stored.add(id(n))

    def _view_base(self, node: Node) -> Node:
        """The node under a chain of movement ops that a strided view can express."""
        while node.op in (Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE) and id(node) not in self.stored:
            node = node.inputs[0]
        return node

    def _cone(self, node: Node) -> tuple[int, list[Node]]:
        """Pointwise work and stored inputs of everything `node` inlines."""
        ops, reads, seen = 0, [], set()
        stack = [node]
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if n is not node and (id(n) in self.stored or n.op is Op.BUFFER):
                reads.append(n)
                continue
            if n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY, Kind.INDEX, Kind.REDUCE):
                ops += 1
            stack.extend(n.inputs)
        return ops, reads

    def _store_is_cheaper(self, node: Node) -> bool:
        """Cost model for a producer with several users, in bytes moved.

        Recomputing it in each of its k users re-reads its cone's inputs k times;
        storing it writes it once and reads it k times, and reads the cone's inputs
        once. A producer whose cone holds much work is stored regardless.
        """
        ops, reads = self._cone(node)
        if ops > MAX_RECOMPUTE_OPS:
            return True
        k = len(self.users[id(node)])
        # a cone reads at most as many elements of an input as it produces (a slice reads a part)
        input_bytes = sum(min(r.numel, node.numel) * r.dtype.itemsize for r in reads)
        own_bytes = node.numel * node.dtype.itemsize
        return own_bytes * (1 + k) + input_bytes < k * input_bytes

    # -- step 2: one kernel per stored node ----------------------------------------------
    def root_kernels(self) -> list[FusedKernel]:
        kernels = []
        for n in self.nodes:
            if id(n) not in self.stored or n.op is Op.BUFFER:
                continue
            if n.op in OPAQUE:
                kernels.append(FusedKernel(n.op.label, n.shape, (), [n], {id(n): FULL}))
            elif n.op is Op.SCATTER_ADD:
                kernels.append(FusedKernel("scatter_add", n.shape, (), [n], {id(n): FULL}))
            elif n.op.kind is Kind.REDUCE:
                space, axes = n.inputs[0].shape, tuple(n.attrs["axes"])
                kernels.append(FusedKernel("reduce", space, axes, [n], {id(n): ROW}, [n]))
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
                return FusedKernel("reduce", space, axes, [n], {id(n): FULL})
            if n.numel == r.numel and r.numel != math.prod(space):
                return FusedKernel("reduce", space, axes, [n], {id(n): ROW})
        return FusedKernel("pointwise", n.shape, (), [n], {id(n): FULL})

    def references(self, kernel: FusedKernel) -> dict[int, set[str]]:
        """Stored nodes the kernel reads, with the levels it reads them at."""
        refs: dict[int, set[str]] = defaultdict(set)
        if kernel.kind in ("matmul", "conv2d", "scatter_add"):
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
            if not is_root and (id(n) in self.stored or n.op is Op.BUFFER) and n not in kernel.reductions:
                refs[id(n)].add(lv)
                continue
            for p, i in enumerate(n.inputs):
                stack.append((i, input_level(n, lv, kernel.space, kernel.axes, p), False))

    # -- step 3: pull reductions into their only reader ---------------------------------
    def pull_reductions(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        by_root = {id(k.root): k for k in kernels}
        refs = {id(k): self.references(k) for k in kernels}
        for r in reversed(self.nodes):
            if r.op.kind is not Kind.REDUCE or id(r) not in self.stored:
                continue
            readers = [k for k in kernels if id(r) in refs[id(k)]]
            if len(readers) != 1:
                continue
            (k,) = readers
            space, axes = r.inputs[0].shape, tuple(r.attrs["axes"])
            if refs[id(k)][id(r)] != {ROW} or (k.space, k.axes) != (space, axes) or k.kind != "reduce":
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

    # -- step 4: merge kernels over one space, then segment pointwise launches -----------
    def merge(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        refs = {id(k): self.references(k) for k in kernels}
        groups: dict[tuple, list[FusedKernel]] = defaultdict(list)
        for k in self._kernel_order(kernels, refs):
            if k.kind in ("pointwise", "reduce"):
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

    def _kernel_order(self, kernels: list[FusedKernel], refs: dict) -> list[FusedKernel]:
        deps = self._dependencies(kernels, refs)
        by_id = {id(k): k for k in kernels}
        ordered, done = [], set()
        for start in sorted(kernels, key=lambda k: min(self.position[id(o)] for o in k.outputs)):
            stack = [(start, iter(sorted(deps[id(start)])))]
            if id(start) in done:
                continue
            done.add(id(start))
            while stack:
                k, it = stack[-1]
                for d in it:
                    if d not in done:
                        done.add(d)
                        stack.append((by_id[d], iter(sorted(deps[d]))))
                        break
                else:
                    stack.pop()
                    ordered.append(k)
        return ordered

    def segment(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        """Group independent pointwise kernels (same depth in the kernel graph) into one launch each."""
        refs = {id(k): self.references(k) for k in kernels}
        deps = self._dependencies(kernels, refs)
        depth: dict[int, int] = {}
        for k in kernels:  # kernels come in launch order
            depth[id(k)] = 1 + max((depth[d] for d in deps[id(k)]), default=-1)
        out: list[tuple[int, FusedKernel]] = []
        open_groups: dict[int, FusedKernel] = {}
        for k in kernels:
            level = depth[id(k)]
            if k.kind != "pointwise":
                out.append((level, k))
                continue
            group = open_groups.get(level)
            if group is None or len(group.segments) >= MAX_SEGMENTS:
                group = FusedKernel("segmented", (), ())
                open_groups[level] = group
                out.append((level, group))
            group.segments.append(k)
        # a group runs after everything its members need: launch by depth (stable within a depth)
        out.sort(key=lambda pair: pair[0])
        return [g.segments[0] if g.kind == "segmented" and len(g.segments) == 1 else g for _, g in out]

    def describe(self, kernel: FusedKernel) -> None:
        """Fill in what a kernel covers and reads, for explain and for the runtime."""
        for part in kernel.segments:
            self.describe(part)
        if kernel.segments:
            kernel.covers = [n for p in kernel.segments for n in p.covers]
            kernel.reads = list({id(n): n for p in kernel.segments for n in p.reads}.values())
            kernel.outputs = [o for p in kernel.segments for o in p.outputs]
            return
        covers, reads, seen = [], [], set()
        stack = list(kernel.outputs)
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            inside = n in kernel.outputs or n in kernel.reductions
            if not inside and (id(n) in self.stored or n.op is Op.BUFFER):
                reads.append(n)
                continue
            covers.append(n)
            stack.extend(n.inputs)
        kernel.covers = sorted(covers, key=lambda n: self.position[id(n)])
        kernel.reads = sorted(reads, key=lambda n: self.position[id(n)])


def plan(nodes: list[Node], outputs: list[Node]) -> tuple[list[FusedKernel], set[int]]:
    """Fused kernels in launch order, and the ids of the nodes that get buffers."""
    planner = Planner(nodes, outputs)
    planner.choose_stored()
    kernels = planner.root_kernels()
    kernels = planner.pull_reductions(kernels)
    kernels = planner.merge(kernels)
    kernels = planner.segment(kernels)
    for i, k in enumerate(kernels):
        k.index = i
        planner.describe(k)
    return kernels, set(planner.stored)
