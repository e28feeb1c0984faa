"""Parallel training on top of the collective hooks: data parallelism, fully sharded data
parallelism, synced batch norm and tensor parallelism, and one state dict for all of them."""

from . import comm_hooks
from .comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .ddp import DistributedDataParallel, GradBucket
from .fsdp import (
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)
from .state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from .tensor_parallel import (
    AttentionParallel,
    ColwiseParallel,
    MLPParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    SequenceSharded,
    VocabParallelCrossEntropyLoss,
    clip_grad_norm_,
    full_parameter,
    parallelize_module,
    transformer_plan,
)

__all__ = [
    "AttentionParallel",
    "ColwiseParallel",
    "MLPParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "SequenceSharded",
    "clip_grad_norm_",
    "full_parameter",
    "parallelize_module",
    "transformer_plan",
    "VocabParallelCrossEntropyLoss",
    "DistributedDataParallel",
    "GradBucket",
    "FSDPModule",
    "FullyShardedDataParallel",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardingStrategy",
    "fully_shard",
    "SyncBatchNorm",
    "allreduce_hook",
    "bf16_compress_hook",
    "comm_hooks",
    "convert_sync_batchnorm",
    "fp16_compress_hook",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]
