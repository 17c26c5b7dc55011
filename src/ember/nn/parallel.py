"""Data-parallel training: DistributedDataParallel, with torch's semantics, over ember.distributed's process group.

Each process holds a replica of the module and trains on its share of the batch. At wrapping, every parameter and
buffer takes rank 0's value. The parameters' gradients are averaged over the processes in buckets of about
`bucket_cap_mb` (parameters in reverse order of registration, the order a backward pass tends to finish them): when
backward() has accumulated the gradient of every parameter of a bucket, the bucket's gradients are flattened into
one vector, averaged by one all-reduce (the COLLECTIVE op) and given back to the parameters as views of it. These
are ops of the step's graph like any other, so the plan runs each bucket's all-reduce where its gradients are
ready (beside the rest of the backward, on a GPU), and the optimizer's update reads the averages; nothing runs on
the host in between. From the second step on, a bucket's flattening, all-reduce and views are built from a template
of the first (one node per gradient). In training mode, with several processes, the buffers (batch norm's running
statistics) take rank 0's values at each forward: one broadcast per dtype, computed before the module runs.
"""

from __future__ import annotations

import contextlib

from ember import autograd, distributed
from ember.autograd import no_grad
from ember.ir import Node
from ember.ir.template import Template, recording, template
from ember.nn.module import Module
from ember.ops.movement import cat
from ember.tensor import Tensor, realize


class _Bucket:
    def __init__(self, params: list) -> None:
        self.params = params
        self.ready: set[int] = set()


class DistributedDataParallel(Module):
    """`module` trained data-parallel over the default process group (ember.distributed.init_process_group)."""

    def __init__(self, module: Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group=None, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False) -> None:
        super().__init__()
        if not distributed.is_initialized():
            raise RuntimeError("DistributedDataParallel: the default process group is not initialized; call "
                               "ember.distributed.init_process_group() first")
        if process_group is not None:
            raise NotImplementedError("DistributedDataParallel: only the default process group is supported")
        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel: expected an ember.nn.Module, got {type(module).__name__}")
        self.module = module
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._sync = True
        self._buckets = self._make_buckets([p for p in module.parameters() if p.requires_grad], bucket_cap_mb)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._reducing = False  # a step's gradients are being reduced: its buckets fill
        # per (collective, shapes): the template its coalesced form is built from (None: it cannot be recorded)
        self._templates: dict[tuple, Template | None] = {}
        with no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                distributed.broadcast(t, 0)
        for bucket in self._buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._gradient_ready)

    @staticmethod
    def _make_buckets(params: list, cap_mb: float) -> list[_Bucket]:
        """Parameters in reverse order, grouped up to `cap_mb` MiB, one dtype and device per bucket."""
        cap = cap_mb * 2**20
        buckets: list[_Bucket] = []
        current: list = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.dtype.itemsize
            if current and (size + nbytes > cap or p.dtype is not current[0].dtype or p.device != current[0].device):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(_Bucket(current))
        return buckets

    def forward(self, *args, **kwargs):
        if self._reducing and any(b.ready and len(b.ready) < len(b.params) for b in self._buckets):
            raise RuntimeError(
                "DistributedDataParallel: expected to have finished reduction in the prior iteration before starting "
                "a new one: some parameters received no gradient. Pass find_unused_parameters=True, or make every "
                "parameter take part in the loss")
        for b in self._buckets:
            b.ready.clear()
        if self.broadcast_buffers and self.training and distributed.get_world_size() > 1:
            self._broadcast_buffers()
        self._reducing = self._sync and autograd.is_grad_enabled()
        if self._reducing:
            autograd.after_backward(id(self), self._finish)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Within the block, gradients accumulate in each process without being averaged; the first backward
        after it averages what accumulated."""
        before = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = before

    def _gradient_ready(self, p) -> None:
        if not self._reducing:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._reduce(bucket)

    def _finish(self) -> None:
        """The end of backward(): with find_unused_parameters, a bucket some of whose parameters got no gradient is
        averaged with zeros for them (torch's semantics)."""
        if not self.find_unused_parameters:
            return
        from ember.ops.creation import zeros_like

        for bucket in self._buckets:
            if len(bucket.ready) < len(bucket.params):
                for p in bucket.params:
                    if p.grad is None:
                        p.grad = zeros_like(p)
                self._reduce(bucket)

    def _reduce(self, bucket: _Bucket) -> None:
        averaged = self._coalesced([p.grad for p in bucket.params], "all_reduce", distributed.ReduceOp.AVG)
        for p, node in zip(bucket.params, averaged):
            p.grad = Tensor(node)
        bucket.ready = {id(p) for p in bucket.params}

    def _broadcast_buffers(self) -> None:
        """Every buffer takes rank 0's value: one broadcast per dtype and device, computed now (the next batch
        norm reads its running statistics as they are)."""
        groups: dict[tuple, list[Tensor]] = {}
        for buffer in self.module.buffers():
            groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        for buffers in groups.values():
            for buffer, node in zip(buffers, self._coalesced(buffers, "broadcast", distributed.ReduceOp.SUM)):
                buffer._show(node)
        realize(*[b for buffers in groups.values() for b in buffers])

    def _coalesced(self, tensors: list[Tensor], kind: str, reduce: str) -> list[Node]:
        """One collective over `tensors` (one dtype and device) flattened into one vector; its result given back
        as one view per tensor. Built from a template recorded on the first call for these shapes, so a step
        costs one node per tensor rather than the flattening's and the views' every op."""
        inputs = [t._node for t in tensors]
        key = (kind, reduce, *((n.shape, n.dtype, n.device) for n in inputs))
        recorded = self._templates.get(key, False)
        if recorded is not False and recorded is not None and len({id(n) for n in inputs}) == len(inputs):
            return recorded.apply(inputs)
        with no_grad(), recording() as made:
            flat = cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
            shared = distributed.collective(flat, kind, reduce)
            views, offset = [], 0
            for t in tensors:
                views.append(shared[offset:offset + t.numel()].reshape(t.shape)._node)
                offset += t.numel()
        if recorded is False:
            self._templates[key] = template(inputs, views, made)
        return views
