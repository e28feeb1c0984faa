"""What a sharding strategy does, and the mixed-precision and offload policies.

``STRATEGIES`` is the one table of strategies: every decision the units make about when to
gather, when to free and when to reduce reads it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class ShardingStrategy(enum.Enum):
    """torch's names, plus ZeRO-1 (DeepSpeed stage 1: only the optimizer state is sharded)."""

    FULL_SHARD = "full_shard"  # ZeRO-3: parameters, gradients and optimizer state sharded
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2: full parameters kept from forward to backward
    SHARD_OPTIMIZER_STATE = "shard_optimizer_state"  # ZeRO-1: full gradients, sharded update
    NO_SHARD = "no_shard"  # DDP: everything replicated, gradients all-reduced
    HYBRID_SHARD = "hybrid_shard"  # FULL_SHARD inside a mesh row, replicated across rows


@dataclass(frozen=True)
class StrategyRules:
    #: parameters are split over the shard dimension of the mesh (else every rank has all)
    shards_parameters: bool
    #: the full parameters are freed after forward and gathered again for backward
    reshard_after_forward: bool
    #: the full parameters stay allocated between steps (the shards are views into them)
    keeps_full_parameters: bool
    #: the full gradients stay until the next zero_grad (the gradient shards view them), and
    #: are reduced once at the end of backward instead of unit by unit during it
    keeps_full_gradients: bool
    #: the mesh must be 2-d: replicate over dimension 0, shard over dimension 1
    needs_2d_mesh: bool


STRATEGIES: dict[ShardingStrategy, StrategyRules] = {
    ShardingStrategy.FULL_SHARD: StrategyRules(True, True, False, False, False),
    ShardingStrategy.SHARD_GRAD_OP: StrategyRules(True, False, True, False, False),
    ShardingStrategy.SHARD_OPTIMIZER_STATE: StrategyRules(True, False, True, True, False),
    ShardingStrategy.NO_SHARD: StrategyRules(False, False, True, False, False),
    ShardingStrategy.HYBRID_SHARD: StrategyRules(True, True, False, False, True),
}


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Gather and compute in ``param_dtype``, reduce gradients in ``reduce_dtype`` (default:
    ``param_dtype``); the shards, their gradients and the optimizer state keep the
    parameters' own dtype (float32 master weights). ``cast_forward_inputs`` casts the root's
    floating inputs (and the gradient given to its backward) to ``param_dtype``."""

    param_dtype: Any = None
    reduce_dtype: Any = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep the shards, their gradients and hence the optimizer state in host memory (numpy)
    while the model computes on the GPU: each unit's shard is copied to the device for its
    all-gather, and its gradient shard back after the reduce-scatter. On a CPU mesh it changes
    nothing (the arrays are on the host already)."""

    offload_params: bool = True
