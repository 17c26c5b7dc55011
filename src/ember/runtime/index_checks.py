"""Indices that generated kernels found out of range, reported at the next host read.

An index that comes from data passes a CHECK_INDEX node (embedding, gather, integer indexing, scatter_add,
cross entropy's targets, one_hot; see ember/ops/index.py). The kernel computing it writes, where a lane's index
is outside its dimension, the check's two int64 words in its plan's flags: 1 and the index. The flags stay set
until they are reported. After the plan's launches they are copied into pinned host memory on the same stream
(inside a CUDA graph too, where a plan is captured), so nothing waits for them. A host read (`.item()`,
`.numpy()`, a transfer to the cpu) waits for its stream anyway; after it, `raise_found` looks at the copies of
the plans the thread ran since its last look and raises IndexError naming the op, the index and the size,
clearing the flags, so that the work after it runs as usual. A plan without checks pays nothing, and a read
pays a look only when a plan with checks ran since the last one. Flags are prepared with a plan's steps, so
each thread (and each ember.jit program) has its own.
"""

from __future__ import annotations

import threading

import torch

from ember.device import Device
from ember.errors import index_out_of_bounds
from ember.ir import Node, Op
from ember.runtime.cuda import torch_device


class IndexFlags:
    """The flags of one plan's index checks on its device, and their copy on the host."""

    def __init__(self, checks: list[Node], device: Device):
        self.checks, self.device = checks, device
        target = torch_device(device)
        self.flags = torch.zeros((len(checks), 2), dtype=torch.int64, device=target)  # (set, index) per check
        self.host = torch.zeros((len(checks), 2), dtype=torch.int64, pin_memory=target.type == "cuda")
        self.words = self.host.numpy()
        self.slots = {id(check): self.flags[k] for k, check in enumerate(checks)}

    def slot(self, check: Node) -> torch.Tensor:
        """The two words a kernel's `flag` parameter for `check` points at."""
        return self.slots[id(check)]

    def copy_out(self) -> None:
        """Enqueue the copy to the host after the plan's launches, for the next host read to look at."""
        self.host.copy_(self.flags, non_blocking=True)
        self.copied()

    def copied(self) -> None:
        """The copy was enqueued (by a plan's run, or by a CUDA graph replaying it) in this thread."""
        this_thread.copied[id(self)] = self

    def found(self) -> IndexError | None:
        """The error of the first check set, if any (all are cleared then); the copy has been made."""
        hits = self.words[:, 0].tolist()  # a few words: quicker as Python ints than through NumPy's reductions
        if not any(hits):
            return None
        k = next(k for k, hit in enumerate(hits) if hit)
        a = self.checks[k].attrs
        error = index_out_of_bounds(a["op_name"], int(self.words[k, 1]), a["dim"], a["size"])
        self.flags.zero_()
        self.words[:] = 0
        return error


class _ThisThread(threading.local):
    def __init__(self) -> None:
        self.copied: dict[int, IndexFlags] = {}  # flags copied since the thread's last look, by id


this_thread = _ThisThread()


def flags_for(nodes: list[Node], device: Device) -> IndexFlags | None:
    """The flags of a plan whose lowered graph is `nodes`, run on `device`; None for a plan that checks no
    index."""
    checks = [n for n in nodes if n.op is Op.CHECK_INDEX]
    return IndexFlags(checks, device) if checks else None


def raise_found(device: Device) -> None:
    """After a host read from `device`, which waited for the work queued before it: raise IndexError for an
    index a plan run before the read found out of range."""
    copied = this_thread.copied
    if not copied:
        return
    error = None
    for key, flags in list(copied.items()):
        if flags.device == device:
            del copied[key]
            found = flags.found()  # each is looked at, and cleared
            error = error or found
    if error is not None:
        raise error
