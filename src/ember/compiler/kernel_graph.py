"""The kernel graph of a plan being made: which stored values each kernel reads and which kernels it waits for,
kept current as the planner merges kernels (`KernelGraph`), and the cycle test a merge must pass (`closes_cycle`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from ember.compiler.fused import FusedKernel

if TYPE_CHECKING:
    from ember.compiler.planner import Planner


def closes_cycle(deps: dict[int, set[int]], group: list[FusedKernel], height: dict[int, int] | None = None) -> bool:
    """Whether the kernels of `group`, made one kernel, would wait on themselves: one needs another through a
    kernel outside the group. `deps`: id(kernel) -> the ids of the kernels it reads from; `height`, where given, is
    higher for a kernel than for any it waits for, so the search skips what cannot lead back to the group."""
    members = {id(k) for k in group}
    floor = min(height[m] for m in members) if height is not None else -1
    frontier = [d for k in group for d in deps[id(k)] if d not in members and (height is None or height[d] >= floor)]
    seen = set(frontier)
    while frontier:
        d = frontier.pop()
        if d in members:
            return True
        for e in deps[d] - seen:
            seen.add(e)
            if height is None or height[e] >= floor:
                frontier.append(e)
    return False


class KernelGraph:
    """A plan's kernels with the stored values each reads (`refs`, as `Planner.references`) and the kernels each
    waits for, kept current as kernels are absorbed into others: a merge changes only the absorbing kernel's reads
    and the dependencies on the absorbed one, so nothing is recomputed for the rest of the plan."""

    def __init__(self, planner: Planner, kernels: list[FusedKernel]):
        self.planner = planner
        self.refs = {id(k): planner.references(k) for k in kernels}
        self.produced = {id(o): k for k in kernels for o in k.outputs}
        self.deps = {id(k): self._waits_for(k) for k in kernels}
        self.sizes: dict[int, int] = {}  # id(kernel) -> nodes it computes, where asked
        self.readers: dict[int, set[int]] = defaultdict(set)
        for k, waited in self.deps.items():
            for d in waited:
                self.readers[d].add(k)
        self.height: dict[int, int] = {}  # above everything a kernel waits for
        for k in kernels:
            stack = [id(k)]
            while stack:
                top = stack[-1]
                if top in self.height:
                    stack.pop()
                    continue
                below = [d for d in self.deps[top] if d not in self.height]
                if below:
                    stack.extend(below)
                else:
                    self.height[stack.pop()] = 1 + max((self.height[d] for d in self.deps[top]), default=-1)

    def ops(self, k: FusedKernel) -> int:
        """How many nodes `k` computes (after merges, the sum of its parts': an upper bound)."""
        if id(k) not in self.sizes:
            self.sizes[id(k)] = len(self.planner.covers_of(k)[0])
        return self.sizes[id(k)]

    def _waits_for(self, k: FusedKernel) -> set[int]:
        return {id(self.produced[r]) for r in self.refs[id(k)] if r in self.produced} - {id(k)}

    def acyclic(self, a: FusedKernel, b: FusedKernel) -> bool:
        return not closes_cycle(self.deps, [a, b], self.height)

    def absorb(self, target: FusedKernel, k: FusedKernel) -> None:
        """`k` made part of `target` (Planner.absorb); the caller drops `k` from its kernel list."""
        t, gone = id(target), id(k)
        if t in self.sizes or gone in self.sizes:
            self.sizes[t] = self.ops(target) + self.ops(k)
            self.sizes.pop(gone, None)
        self.planner.absorb(target, k)
        for o in k.outputs:
            if self.produced.get(id(o)) is k:
                self.produced[id(o)] = target
        del self.refs[gone]
        self.refs[t] = self.planner.references(target)
        for d in self.deps.pop(gone):
            self.readers[d].discard(gone)
        for r in self.readers.pop(gone, set()) - {t}:  # who read k reads target now
            self.deps[r].discard(gone)
            self.deps[r].add(t)
            self.readers[t].add(r)
        self.readers[t].discard(gone)
        for d in self.deps[t]:
            self.readers[d].discard(t)
        self.deps[t] = self._waits_for(target)
        for d in self.deps[t]:
            self.readers[d].add(t)
        del self.height[gone]
        raised = [t]  # heights only rise, so each stays above what its kernel waits for
        while raised:
            k = raised.pop()
            least = 1 + max((self.height[d] for d in self.deps[k]), default=-1)
            if least > self.height[k] or k == t:
                self.height[k] = max(self.height[k], least)
                raised.extend(self.readers[k])
