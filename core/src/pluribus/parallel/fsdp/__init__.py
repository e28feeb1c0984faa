"""Fully sharded data parallelism: ZeRO-1/2/3 and hybrid sharding over a DeviceMesh.

``fully_shard`` per unit (a transformer block) and on the root, or the wrapper
``FullyShardedDataParallel``; every parameter keeps its name and shape and its shard is a
``Shard(0)`` DTensor; see docs/fsdp.md.
"""

from .api import FSDPModule, FullyShardedDataParallel, fully_shard
from .clip import clip_grad_norm_
from .ledger import LedgerReport, MemoryLedger
from .policy import STRATEGIES, MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy
from .state_dict import (
    full_optim_state_dict,
    full_state_dict,
    load_optim_state_dict,
    load_sharded_state_dict,
    optim_state_dict,
    sharded_state_dict,
)

__all__ = [
    "STRATEGIES",
    "FSDPModule",
    "FullyShardedDataParallel",
    "LedgerReport",
    "MemoryLedger",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardingStrategy",
    "clip_grad_norm_",
    "full_optim_state_dict",
    "full_state_dict",
    "fully_shard",
    "load_optim_state_dict",
    "load_sharded_state_dict",
    "optim_state_dict",
    "sharded_state_dict",
]
