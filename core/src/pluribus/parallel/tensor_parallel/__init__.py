"""Tensor parallelism for ``pluribus.nn``: Linear layers, attention heads and the transformer
MLP split over a 1-d mesh, as torch's ``parallelize_module`` does.

Parameters keep their names and become this rank's pieces (``full_parameter`` puts one back
together). The communication is a DTensor redistribute at each boundary: a column-parallel
layer takes a replicated input and gives a shard of the output features, whose input gradient is
a ``Partial`` sum (one all-reduce in backward); a row-parallel layer takes that shard and gives a
``Partial`` output (one all-reduce in forward) before its bias is added once. An MLP or an
attention block thus costs one all-reduce in forward and one in backward.

The package: ``pieces`` (how parameters are cut and put back), ``boundaries`` (what crosses a
layer's boundary), ``layers`` (the split layers' own forward), ``styles`` (one module's split),
``prepare`` (torch's PrepareModuleInput, PrepareModuleOutput and PrepareModuleInputOutput: a
module's inputs or outputs moved between layouts, nothing split), ``plan`` (a model's),
``clip`` (gradient clipping) and ``loss`` (cross-entropy of logits split by vocabulary).
"""

from .clip import clip_grad_norm_
from .loss import VocabParallelCrossEntropyLoss
from .pieces import full_parameter
from .plan import parallelize_module, transformer_plan
from .prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from .styles import (
    AttentionParallel,
    ColwiseParallel,
    MLPParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    SequenceSharded,
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
    "VocabParallelCrossEntropyLoss",
    "clip_grad_norm_",
    "full_parameter",
    "parallelize_module",
    "transformer_plan",
]
