"""Applying styles to a model: ``parallelize_module`` with a plan of module-name patterns, and
the plan for every block of a GPT or a TransformerBlock."""

from __future__ import annotations

import fnmatch
from typing import Any

from ...dtensor import Replicate, Shard
from ...mesh import DeviceMesh
from ...nn.layers import Embedding
from ...nn.module import Module
from ...nn.transformer import CausalSelfAttention
from .pieces import rank_text
from .styles import (
    AttentionParallel,
    ColwiseParallel,
    MLPParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    SequenceSharded,
)


def parallelize_module(
    module: Module, device_mesh: DeviceMesh, parallelize_plan: ParallelStyle | dict[str, Any]
) -> Module:
    """Apply ``parallelize_plan`` (a style, or ``{module name pattern: style}`` with fnmatch
    patterns such as ``"blocks.*.attn"``, matched one dotted part at a time as torch does, so
    ``"*"`` is every child of the root and never the root itself) on the 1-d ``device_mesh``,
    in place."""
    mesh = device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"{rank_text(mesh)}: tensor parallelism takes a 1-d mesh, got {mesh.shape}; pass "
            'the tensor-parallel slice, e.g. mesh["tp"]'
        )
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan.apply(module, mesh)
    if not isinstance(parallelize_plan, dict) or not all(
        isinstance(style, ParallelStyle) for style in parallelize_plan.values()
    ):
        raise TypeError(
            f"{rank_text(mesh)}: parallelize_plan is a style or a dict of module name patterns "
            f"to styles (ColwiseParallel(), PrepareModuleInput(...), ...), got "
            f"{parallelize_plan!r}"[:400]
        )
    names = dict(module.named_modules())

    def matches(name: str, pattern: str) -> bool:
        parts, atoms = name.split("."), pattern.split(".")
        return (
            bool(name)
            and len(parts) == len(atoms)
            and all(
                fnmatch.fnmatchcase(part, atom) for part, atom in zip(parts, atoms, strict=True)
            )
        )

    for pattern, style in parallelize_plan.items():
        matched = [n for n in names if matches(n, pattern)]
        if not matched:
            raise KeyError(
                f"{rank_text(mesh)}: parallelize plan entry {pattern!r} matches no module "
                f"(modules: {', '.join(n for n in names if n)[:300]})"
            )
        for name in matched:
            style.apply(names[name], mesh)
    return module


def transformer_plan(
    model: Module, sequence_parallel: bool = False, vocab_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan for every block of a GPT or a TransformerBlock: heads and MLP
    split; embeddings, norms and the head replicated. With ``sequence_parallel`` (a GPT) the
    blocks run on this rank's part of the sequence: norms and residuals on 1/tp of the tokens,
    the gathers and reduce-scatters replacing the all-reduces. With ``vocab_parallel`` (a GPT)
    the token embedding and the head (tied or not) hold this rank's rows of the vocabulary, and
    the head gives the logits of those rows only: train it with
    :class:`VocabParallelCrossEntropyLoss`, which never gathers them."""
    plan: dict[str, ParallelStyle] = {}
    modules = dict(model.named_modules())
    if vocab_parallel and (not isinstance(modules.get("wte"), Embedding) or "head" not in modules):
        raise ValueError("vocab_parallel=True takes a GPT (a model with .wte and .head)")
    dim = 1 if sequence_parallel else None
    for name, m in model.named_modules():
        if isinstance(m, CausalSelfAttention) and name.endswith("attn"):
            block = name[: -len("attn")]
            plan[name] = AttentionParallel(sequence_dim=dim)
            plan[block + "mlp"] = MLPParallel(sequence_dim=dim)
            if sequence_parallel:
                plan[block + "ln1"] = SequenceParallel()
                plan[block + "ln2"] = SequenceParallel()
    if sequence_parallel:
        if "blocks" not in modules:
            raise ValueError("sequence_parallel=True takes a GPT (a model with .blocks)")
        plan["blocks"] = SequenceSharded(1)
    if vocab_parallel:  # last: a block the plan refuses stops it before the tied table is split
        plan["wte"] = RowwiseParallel(input_layouts=Replicate())
        plan["head"] = ColwiseParallel(output_layouts=Shard(-1))
    return plan
