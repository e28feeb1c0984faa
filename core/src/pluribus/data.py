"""Splitting a data set across ranks: each rank reads its own share of every epoch."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import numpy as np

from . import distributed as dist


class DistributedSampler:
    """Indices ``0..len(dataset)-1`` for one rank (torch's ``DistributedSampler``).

    Every rank shuffles with the same seed and epoch, then takes every ``num_replicas``-th index
    starting at its rank, so the ranks' shares are disjoint and together cover the data. Without
    ``drop_last`` the index list is padded by wrapping around so all ranks get the same count
    (ranks must run the same number of steps); with it, the tail is dropped. Call
    ``set_epoch(e)`` at the start of each epoch for a new order.
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        """``dataset``: anything with ``len()`` (as in torch), or the number of samples."""
        if isinstance(dataset, (int, np.integer)) and not isinstance(dataset, bool):
            num_samples = int(dataset)
        elif hasattr(dataset, "__len__"):
            num_samples = len(dataset)
        else:
            raise TypeError(
                "DistributedSampler needs a dataset with len() or a number of samples, got "
                f"{type(dataset).__name__}"
            )
        if num_samples < 0:
            raise ValueError(f"DistributedSampler got a negative number of samples: {num_samples}")
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.dataset_size, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = num_samples // num_replicas
        else:
            self.num_samples = -(-num_samples // num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(self.dataset_size)
        else:
            order = np.arange(self.dataset_size)
        if self.total_size > order.size:
            order = np.resize(order, self.total_size)  # wraps around to pad
        order = order[: self.total_size]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[np.ndarray]:
        """This epoch's indices for this rank in batches of ``batch_size``."""
        mine = self.indices()
        stop = mine.size - mine.size % batch_size if drop_last else mine.size
        for start in range(0, stop, batch_size):
            yield mine[start : start + batch_size]
