"""Parallel training on top of the collective hooks: data parallelism and synced batch norm."""

from . import comm_hooks
from .comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .ddp import DistributedDataParallel, GradBucket
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "DistributedDataParallel",
    "GradBucket",
    "SyncBatchNorm",
    "allreduce_hook",
    "bf16_compress_hook",
    "comm_hooks",
    "convert_sync_batchnorm",
    "fp16_compress_hook",
]
