"""DistributedSampler: each process of a data-parallel run takes its own share of a dataset, torch's way."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np


class DistributedSampler:
    """The indices of `dataset` for process `rank` of `num_replicas` (by default the process group's, from
    ember.distributed), with torch.utils.data.distributed.DistributedSampler's semantics.

    Each epoch orders the dataset the same way in every process: a permutation drawn from `seed + epoch` when
    `shuffle` (call `set_epoch` before each epoch for a new one), else the dataset's order. The order is then cut to
    a multiple of `num_replicas` (`drop_last`: the tail dropped) or padded to one by repeating it from its start,
    and process `rank` takes every `num_replicas`-th index from its own position: the shares are equally long and,
    without padding, disjoint."""

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            from ember import distributed

            if not distributed.is_initialized():
                raise RuntimeError("DistributedSampler: the default process group is not initialized; call "
                                   "ember.distributed.init_process_group() first, or pass num_replicas and rank")
            num_replicas = distributed.get_world_size() if num_replicas is None else num_replicas
            rank = distributed.get_rank() if rank is None else rank
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be a positive integer, got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"DistributedSampler: invalid rank {rank!r}, rank should be in the interval "
                             f"[0, {num_replicas - 1}]")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        n = len(dataset)
        if drop_last and n % num_replicas:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration draws (every process must set the same)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        seed = (self.seed + self.epoch) % 2**64  # any integer, as torch takes (NumPy's seeds are non-negative)
        order = np.random.default_rng(seed).permutation(n) if self.shuffle else np.arange(n)
        if self.total_size <= n:
            order = order[:self.total_size]
        elif n:  # padded from the start, as often as it takes
            order = np.resize(order, self.total_size)
        return iter(int(i) for i in order[self.rank:self.total_size:self.num_replicas])
