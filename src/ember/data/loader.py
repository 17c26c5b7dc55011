"""Datasets and the DataLoader: minibatches of host arrays, wrapped as ember Tensors.

Batches are cut from realized NumPy arrays by fancy indexing (one copy per batch),
not by lazy gathers, so loading data never adds graph to a training step. For a
cuda device the loader keeps batches ahead: it gathers each batch straight into pinned
memory and enqueues its upload on the runtime's upload stream before it hands out the
batch before, so the copy runs while that batch's step computes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from ember.errors import ShapeError
from ember.ir import Node
from ember.ops.creation import tensor
from ember.placement import check_device
from ember.tensor import Tensor


def _host_array(x) -> np.ndarray:
    return x.numpy() if isinstance(x, Tensor) else np.asarray(x)


class Dataset:
    """A map-style dataset: `len(ds)` items, `ds[i]` one item (a tuple of arrays or Tensors)."""

    def __getitem__(self, index: int):
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class TensorDataset(Dataset):
    """Samples are the rows of several arrays (ember Tensors or NumPy arrays) of one length."""

    def __init__(self, *tensors) -> None:
        if not tensors:
            raise ValueError("TensorDataset: at least one tensor is required")
        self.arrays = tuple(_host_array(t) for t in tensors)
        lengths = [a.shape[0] if a.ndim else None for a in self.arrays]
        if None in lengths or len(set(lengths)) != 1:
            shapes = ", ".join(str(a.shape) for a in self.arrays)
            raise ShapeError(f"TensorDataset: every tensor needs the same size in dim 0, got shapes {shapes}")

    def __len__(self) -> int:
        return self.arrays[0].shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        return tuple(tensor(a[index]) for a in self.arrays)


class DataLoader:
    """Iterate over a dataset in minibatches, each a tuple of ember Tensors.

    `dataset` is a TensorDataset, a sequence of arrays of one length (made into a
    TensorDataset), or any map-style dataset whose items are tuples of arrays (stacked
    per field). With `shuffle`, each epoch (each `iter()`) draws a new order from a
    NumPy Generator seeded once by `seed`, so the sequence of epochs is reproducible. A
    `sampler` (any iterable of indices with a length: a DistributedSampler) gives the
    indices and their order instead.

    Batches are realized tensors on `device` (the default device if None). On a cuda
    device the loader stays `prefetch` batches ahead of the batch it yields: the next
    batch is already cut and its upload enqueued on the GPU's upload stream while the
    step for the current one runs, so the copy overlaps compute. (A worker thread doing
    the cutting was measured slower than this on an H200: the steps it would overlap
    with are asynchronous already.) `prefetch=0` cuts and uploads each batch only when
    it is asked for. The batches, their order and
    `len()` are the same for every `prefetch`; on the CPU there is nothing to overlap and
    `prefetch` has no effect.
    """

    def __init__(self, dataset, batch_size: int = 1, shuffle: bool = False, sampler=None, drop_last: bool = False,
                 seed: int | None = None, device=None, prefetch: int = 1) -> None:
        if isinstance(dataset, (tuple, list)):
            dataset = TensorDataset(*dataset)
        elif isinstance(dataset, (np.ndarray, Tensor)):
            dataset = TensorDataset(dataset)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"DataLoader: batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"DataLoader: prefetch must be a non-negative integer, got {prefetch!r}")
        if sampler is not None and shuffle:
            raise ValueError("DataLoader: sampler option is mutually exclusive with shuffle")
        self.dataset, self.batch_size, self.shuffle, self.drop_last = dataset, batch_size, shuffle, drop_last
        self.sampler = sampler
        self.device = check_device(device)
        self.prefetch = prefetch
        self._rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        if self.sampler is not None:  # the indices it gives, in its order (a DistributedSampler's share)
            order = np.fromiter(iter(self.sampler), dtype=np.int64)
        else:
            n = len(self.dataset)
            order = self._rng.permutation(n) if self.shuffle else np.arange(n)
        batches = [order[b * self.batch_size:(b + 1) * self.batch_size] for b in range(len(self))]
        ahead = self.prefetch if self.device.type == "cuda" else 0
        ready: deque = deque()  # batches cut and uploaded, oldest first
        for indices in batches:
            ready.append(self._batch(indices))
            if len(ready) > ahead:
                yield self._ready(ready.popleft())
        while ready:
            yield self._ready(ready.popleft())

    def _ready(self, batch: tuple[tuple[Tensor, object], ...]) -> tuple[Tensor, ...]:
        """The batch's tensors, ordered after their uploads on the stream of the thread using them."""
        events = [event for _, event in batch if event is not None]
        if events:  # only a cuda batch has uploads
            from ember.runtime import transfer  # torch is loaded only for a cuda batch

            for event in events:
                transfer.wait(event, self.device)
        return tuple(t for t, _ in batch)

    def _batch(self, indices: np.ndarray) -> tuple[tuple[Tensor, object], ...]:
        """The batch's tensors, each with the event of its upload (or None)."""
        if isinstance(self.dataset, TensorDataset) and self.device.type == "cuda":
            return tuple(self._rows_on_device(a, indices) for a in self.dataset.arrays)
        if isinstance(self.dataset, TensorDataset):
            fields: Sequence[np.ndarray] = [a[indices] for a in self.dataset.arrays]
        else:
            items = [self.dataset[int(i)] for i in indices]
            items = [item if isinstance(item, tuple) else (item,) for item in items]
            fields = [np.stack([_host_array(item[f]) for item in items]) for f in range(len(items[0]))]
        return tuple((tensor(f, device=self.device), None) for f in fields)

    def _rows_on_device(self, array: np.ndarray, indices: np.ndarray) -> tuple[Tensor, object]:
        """A batch gathered from the dataset straight into pinned memory and uploaded from there."""
        dtype = tensor(array[:0]).dtype  # what `tensor(array[indices])` would make
        if dtype.np != array.dtype:
            return tensor(array[indices], device=self.device), None
        from ember.runtime import transfer  # torch is loaded only for a cuda batch

        buffer, event = transfer.upload_rows(array, indices, self.device)
        return Tensor(Node.from_buffer(buffer, dtype, self.device)), event

