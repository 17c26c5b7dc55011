"""Datasets and the DataLoader: minibatches of host arrays, wrapped as ember Tensors.

Batches are cut from realized NumPy arrays by fancy indexing (one copy per batch),
not by lazy gathers, so loading data never adds graph to a training step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from ember.device import as_device
from ember.errors import ShapeError
from ember.ops.creation import tensor
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
    NumPy Generator seeded once by `seed`, so the sequence of epochs is reproducible.
    """

    def __init__(self, dataset, batch_size: int = 1, shuffle: bool = False, drop_last: bool = False,
                 seed: int | None = None, device=None) -> None:
        if isinstance(dataset, (tuple, list)):
            dataset = TensorDataset(*dataset)
        elif isinstance(dataset, (np.ndarray, Tensor)):
            dataset = TensorDataset(dataset)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"DataLoader: batch_size must be a positive integer, got {batch_size!r}")
        self.dataset, self.batch_size, self.shuffle, self.drop_last = dataset, batch_size, shuffle, drop_last
        self.device = as_device(device)
        self._rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        n = len(self.dataset)
        order = self._rng.permutation(n) if self.shuffle else np.arange(n)
        for b in range(len(self)):
            yield self._batch(order[b * self.batch_size:(b + 1) * self.batch_size])

    def _batch(self, indices: np.ndarray) -> tuple[Tensor, ...]:
        if isinstance(self.dataset, TensorDataset):
            fields: Sequence[np.ndarray] = [a[indices] for a in self.dataset.arrays]
        else:
            items = [self.dataset[int(i)] for i in indices]
            items = [item if isinstance(item, tuple) else (item,) for item in items]
            fields = [np.stack([_host_array(item[f]) for item in items]) for f in range(len(items[0]))]
        return tuple(tensor(f, device=self.device) for f in fields)
