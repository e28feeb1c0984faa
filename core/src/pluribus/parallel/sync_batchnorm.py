"""SyncBatchNorm: batch normalisation whose statistics span every rank's batch.

Forward all-reduces per-channel sums (then centred squares) so every rank normalises with the
mean and variance of the concatenated batch; backward all-reduces the two per-channel sums the
input gradient needs. The result equals :class:`~pluribus.nn.BatchNorm1d` on the whole batch.
"""

from __future__ import annotations

from typing import Any

from .. import distributed as dist
from ..nn.layers import BatchNorm1d
from ..nn.module import Module, array_namespace


class SyncBatchNorm(BatchNorm1d):
    """BatchNorm1d with statistics reduced over ``process_group`` (default: the world)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        **kwargs: Any,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **kwargs)
        self.process_group = process_group

    def _synced(self) -> bool:
        return dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def _reduce_stats(self, x: Any, axes: tuple[int, ...]) -> tuple[Any, Any, int]:
        if not self._synced():
            return super()._reduce_stats(x, axes)
        xp = array_namespace(x)
        local_count = x.size // x.shape[1]
        sums = xp.concatenate([x.sum(axis=axes), xp.asarray([local_count], dtype=x.dtype)])
        dist.all_reduce(sums, group=self.process_group)
        count = int(round(float(sums[-1])))
        mean = sums[:-1] / count
        centered = x - self._channel(mean, x.ndim)
        squares = xp.ascontiguousarray((centered * centered).sum(axis=axes))
        dist.all_reduce(squares, group=self.process_group)
        return mean, squares / count, count

    def _reduce_grad_sums(self, sum_dy: Any, sum_dy_xhat: Any) -> tuple[Any, Any]:
        if not self._synced():
            return sum_dy, sum_dy_xhat
        xp = array_namespace(sum_dy)
        both = xp.concatenate([sum_dy, sum_dy_xhat])
        dist.all_reduce(both, group=self.process_group)
        return both[: sum_dy.size], both[sum_dy.size :]

    @classmethod
    def convert_sync_batchnorm(cls, module: Module, process_group: Any = None) -> Module:
        return convert_sync_batchnorm(module, process_group)


def convert_sync_batchnorm(module: Module, process_group: Any = None) -> Module:
    """Replace every BatchNorm1d in ``module`` by a SyncBatchNorm sharing its parameters and
    running statistics (so an optimizer made before still holds the right parameters)."""
    if isinstance(module, BatchNorm1d) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group=process_group,
        )
        for name, param in module._parameters.items():
            setattr(sync, name, param)
        for name, array in module._buffers.items():
            sync.register_buffer(name, array)
        sync.train(module.training)
        return sync
    for name, child in list(module._modules.items()):
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            setattr(module, name, converted)
    return module
