"""Indices that generated kernels found out of range, reported at the next host read of a value that depends on
them.

An index that comes from data passes a CHECK_INDEX node (embedding, gather, integer indexing, scatter_add,
cross entropy's targets, one_hot; see ember/ops/index.py). The kernel computing it writes, where a lane's index
is outside its dimension, the check's two int64 words in its plan's flags: 1 and the index. After the plan's
launches the flags are copied into pinned host memory on the same stream (inside a CUDA graph too, where a plan
is captured), so nothing waits for them.

Each buffer a plan writes carries the checks its value depends on (`carry`, from `Lowered.sources`): those of the
plan's own that its value is computed from, and those its inputs carry, so a parameter updated from a bad gather's
gradient carries that check into every later step. A host read (`.item()`, `.numpy()`, a transfer to the cpu) waits
for its stream anyway; after it, `raise_found` looks at the checks the read buffer carries and raises IndexError
naming the op, the index and the size, clearing them, so that the work after it runs as usual. A read of a value
that depends on no check that fired raises nothing and clears nothing. A check stays set until a value depending on
it is read: a later run of its plan whose results are read reports it then. A plan without checks pays one
attribute lookup per input; flags are prepared with a plan's steps, so each thread (and each ember.jit program) has
its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ember.device import Device
from ember.errors import index_out_of_bounds
from ember.ir import Node, Op
from ember.runtime.cuda import torch_device

CARRIED = "_ember_index_checks"  # on a torch buffer: the (IndexFlags, check position) pairs its value depends on


class IndexFlags:
    """The flags of one plan's index checks on its device, and their copy on the host."""

    def __init__(self, checks: list[Node], device: Device):
        self.checks, self.device = checks, device
        target = torch_device(device)
        self.flags = torch.zeros((len(checks), 2), dtype=torch.int64, device=target)  # (set, index) per check
        self.host = torch.zeros((len(checks), 2), dtype=torch.int64, pin_memory=target.type == "cuda")
        self.words = self.host.numpy()
        self.slots = {id(check): self.flags[k] for k, check in enumerate(checks)}
        self.every = frozenset((self, k) for k in range(len(checks)))

    def slot(self, check: Node) -> torch.Tensor:
        """The two words a kernel's `flag` parameter for `check` points at."""
        return self.slots[id(check)]

    def copy_out(self) -> None:
        """Enqueue the copy to the host after the plan's launches, for a later host read to look at."""
        self.host.copy_(self.flags, non_blocking=True)

    def error(self, k: int) -> IndexError:
        a = self.checks[k].attrs
        return index_out_of_bounds(a["op_name"], int(self.words[k, 1]), a["dim"], a["size"])

    def clear(self, k: int) -> None:
        self.flags[k].zero_()
        self.words[k] = 0


def flags_for(nodes: list[Node], device: Device) -> IndexFlags | None:
    """The flags of a plan whose lowered graph is `nodes`, run on `device`; None for a plan that checks no
    index. A check's position is its place among the CHECK_INDEX nodes of `nodes`."""
    checks = [n for n in nodes if n.op is Op.CHECK_INDEX]
    return IndexFlags(checks, device) if checks else None


def carry(sources: list[tuple[int, int]], flags: IndexFlags | None, inputs: list[torch.Tensor],
          outputs: list[torch.Tensor]) -> None:
    """After a plan's run: each output carries the checks of `flags` it is computed from and those its inputs
    carry (`sources`: the plan's lowered graph's, bit masks of inputs and checks). The inputs' carried sets are
    few and shared (every parameter of a step carries its loss's targets' check), so each is tested once per
    output against the mask of the inputs carrying it, and each distinct result is made once."""
    by_set: dict[frozenset, int] = {}  # a carried set -> the mask of the inputs carrying it
    for i, b in enumerate(inputs):
        checks = getattr(b, CARRIED, None)
        if checks:
            by_set[checks] = by_set.get(checks, 0) | 1 << i
    if flags is None and not by_set:
        return
    carried = list(by_set.items())
    made: dict[tuple, frozenset] = {}
    for out, (read, checked) in zip(outputs, sources):
        key = (checked if flags is not None else 0, *(j for j, (_, mask) in enumerate(carried) if read & mask))
        found = made.get(key)
        if found is None:
            own = frozenset((flags, k) for k in range(key[0].bit_length()) if key[0] >> k & 1)
            found = made[key] = own.union(*(carried[j][0] for j in key[1:]))
        if found:
            setattr(out, CARRIED, found | (getattr(out, CARRIED, None) or frozenset()))


def depend_on(checks: frozenset, buffers: Iterable[torch.Tensor]) -> None:
    """The buffers carry `checks` (a whole replayed step's, for what it writes), besides their own."""
    if checks:
        for b in buffers:
            carried = getattr(b, CARRIED, None)
            if not carried:
                setattr(b, CARRIED, checks)
            elif not checks <= carried:  # (a replay's buffers carry the same checks from the first replay on)
                setattr(b, CARRIED, checks | carried)


def raise_found(buffer: torch.Tensor) -> None:
    """After a host read of `buffer`, which waited for the work queued before it: raise IndexError for an index
    out of range that its value depends on (clearing every such check)."""
    carried = getattr(buffer, CARRIED, None)
    if not carried:
        return
    fired = [(flags, k) for flags, k in carried if flags.words[k, 0]]
    if not fired:
        return
    error = fired[0][0].error(fired[0][1])
    for flags, k in fired:
        flags.clear(k)
    raise error
