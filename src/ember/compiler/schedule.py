"""Schedule: launch order, stream assignment and buffer reuse for a plan's fused kernels.

The planner decides what is computed together; the schedule decides when and where
it lives:

- **order and streams**: kernels are grouped by dependency level. A level holding
  several kernels too small to fill the GPU on their own runs them side by side on
  separate streams (fork and join around the level); every other kernel runs on the
  main stream in the planner's order.
- **buffers**: every stored intermediate (a node some kernel writes and a later one
  reads, but that is not a result of the plan) gets a slice of one arena, assigned
  greedily by size among the slices whose lifetimes overlap. Kernels of one
  parallel level count as simultaneous, so streams never race on reused memory.
  The arena is typically far smaller than the sum of the intermediates.
- **collectives**: a collective (ember.distributed) runs beside the kernels after it, on a communication
  stream; the first launch that reads its result, or the end of the plan, waits for it (`joins`). Its input
  stays allocated until then, so the kernels in between never write over what it is still sending.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.compiler.fused import FusedKernel, KernelKind
from ember.ir import Node

ALIGN = 256  # bytes; slices start where a vectorised load of any dtype is aligned


@dataclass
class Schedule:
    order: list[int]  # kernel indices in launch order
    streams: list[int]  # stream of each launch position (0: the main stream)
    groups: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) positions run in parallel
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(intermediate) -> (offset, bytes)
    arena_bytes: int = 0  # what the intermediates need at once
    intermediate_bytes: int = 0  # what they would need each in its own buffer
    # launch position -> positions of the collectives it waits for before launching; position len(order): the
    # plan's end
    joins: dict[int, list[int]] = field(default_factory=dict)

    @property
    def parallel_kernels(self) -> int:
        return sum(stop - start for start, stop in self.groups)


def nbytes(node: Node) -> int:
    return node.numel * node.dtype.itemsize


def schedule(kernels: list[FusedKernel], outputs: list[Node], small: list[bool], max_streams: int) -> Schedule:
    """Order, streams and arena slots for `kernels` (in planner order); `small[i]`: kernel i leaves
    most of the GPU idle, so it may share it with another kernel of its level."""
    producer = {id(o): i for i, k in enumerate(kernels) for o in k.outputs}
    level = []
    for k in kernels:
        deps = [level[producer[id(r)]] for r in k.reads if id(r) in producer]
        level.append(1 + max(deps, default=-1))

    by_level: dict[int, list[int]] = {}
    for i, lv in enumerate(level):
        by_level.setdefault(lv, []).append(i)
    parallel = {lv: [i for i in members if small[i]] for lv, members in by_level.items()}
    parallel = {lv: members for lv, members in parallel.items() if len(members) >= 2}
    if max_streams < 2 or not parallel:
        result = Schedule(_collectives_early(kernels, producer), [0] * len(kernels))
    else:
        result = _parallel_order(by_level, parallel, max_streams)
    _join_collectives(result, kernels)
    _assign_slots(result, kernels, outputs)
    return result


def _collectives_early(kernels: list[FusedKernel], producer: dict[int, int]) -> list[int]:
    """The planner's order with each collective moved up to where its input can be ready: as soon as the kernels
    it still waits for only prepare its input (a gradient bucket's flattening, say: nothing else reads what they
    write), they and the collective run next, so the collective overlaps the kernels that follow."""
    collectives = [i for i, k in enumerate(kernels) if k.kind is KernelKind.COLLECTIVE]
    if not collectives:
        return list(range(len(kernels)))
    deps = [{producer[id(r)] for r in k.reads if id(r) in producer} for k in kernels]
    readers: list[set[int]] = [set() for _ in kernels]
    for i, d in enumerate(deps):
        for j in d:
            readers[j].add(i)
    feeders: dict[int, set[int]] = {}
    for c in collectives:
        seen, stack = set(), list(deps[c])
        while stack:
            j = stack.pop()
            if j not in seen:
                seen.add(j)
                stack.extend(deps[j])
        feeders[c] = seen
    order: list[int] = []
    done = [False] * len(kernels)
    pending = list(collectives)
    for i in range(len(kernels)):
        if done[i]:
            continue
        order.append(i)
        done[i] = True
        for c in list(pending):
            if done[c]:
                pending.remove(c)
                continue
            rest = sorted(j for j in feeders[c] if not done[j])  # ancestors first: the planner's order is one
            if all(readers[j] <= feeders[c] | {c} for j in rest):
                for j in [*rest, c]:
                    order.append(j)
                    done[j] = True
                pending.remove(c)
    return order


def _join_collectives(result: Schedule, kernels: list[FusedKernel]) -> None:
    """Where each collective's result is first needed: the first later launch reading it, else the plan's end."""
    for position, i in enumerate(result.order):
        if kernels[i].kind is not KernelKind.COLLECTIVE:
            continue
        made = {id(o) for o in kernels[i].outputs}
        join = next((q for q in range(position + 1, len(result.order))
                     if any(id(r) in made for r in kernels[result.order[q]].reads)), len(result.order))
        result.joins.setdefault(join, []).append(position)


def _parallel_order(by_level: dict[int, list[int]], parallel: dict[int, list[int]], max_streams: int) -> Schedule:
    """Level by level: a level's large kernels first on the main stream, then its small ones spread
    over the streams as one parallel group."""
    order, streams, groups = [], [], []
    for lv in sorted(by_level):
        together = parallel.get(lv, [])
        for i in by_level[lv]:
            if i not in together:
                order.append(i)
                streams.append(0)
        if together:
            start = len(order)
            for n, i in enumerate(together):
                order.append(i)
                streams.append(n % max_streams)
            groups.append((start, len(order)))
    return Schedule(order, streams, groups)


def _assign_slots(result: Schedule, kernels: list[FusedKernel], outputs: list[Node]) -> None:
    """Arena slices for the intermediates, reusing memory between buffers whose lifetimes do not meet."""
    time = list(range(len(result.order) + 1))  # a parallel group shares one time step; the last: the plan's end
    for start, stop in result.groups:
        for p in range(start, stop):
            time[p] = start
    joined = {position: time[join] for join, waits in result.joins.items() for position in waits}
    output_ids = {id(o) for o in outputs}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    nodes: dict[int, Node] = {}
    for position, i in enumerate(result.order):
        t = time[position]
        for o in kernels[i].outputs:
            if id(o) not in output_ids:
                first.setdefault(id(o), t)
                last[id(o)] = max(last.get(id(o), t), t)
                nodes[id(o)] = o
        for r in kernels[i].reads:
            if id(r) in first:
                last[id(r)] = max(last[id(r)], joined.get(position, t))
    placed: list[tuple[int, int, int, int]] = []  # offset, size, first, last
    for key in sorted(nodes, key=lambda k: -nbytes(nodes[k])):
        size = -(-nbytes(nodes[key]) // ALIGN) * ALIGN
        start, stop = first[key], last[key]
        offset = 0
        for lo, hi in sorted((o, o + s) for o, s, a, b in placed if a <= stop and start <= b):
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        placed.append((offset, size, start, stop))
        result.slots[key] = (offset, nbytes(nodes[key]))
    result.arena_bytes = max((o + s for o, s, _, _ in placed), default=0)
    result.intermediate_bytes = sum(nbytes(n) for n in nodes.values())
