"""The parallel styles (torch's names): how one module is split over a 1-d mesh. Column-
and row-parallel Linears (and a row-parallel Embedding), attention by heads, the transformer
MLP, and sequence parallelism. A style checks every layer and parameter it will split before
it splits any, then cuts the parameters and hooks the collectives at the module's boundaries.
Backward hooks go ahead of the module's others (``prepend=True``): when several styles hook
one module, backward undoes their moves in the reverse of forward's order, as torch's autograd
does."""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from ... import distributed as dist
from ...dtensor import Partial, Placement, Replicate, Shard
from ...mesh import DeviceMesh
from ...nn.layers import Dropout, Embedding, Linear
from ...nn.module import Module, Parameter, Sequential
from ...nn.transformer import CausalSelfAttention
from .boundaries import global_rows, move
from .layers import RowParallelLinear, VocabParallelEmbedding
from .pieces import check_splits, rank_span, rank_text, shard_parameter


def _own_stream(module: Module, mesh: DeviceMesh) -> None:
    """Give a seeded :class:`Dropout` a random stream of this tensor-parallel rank's own: it
    drops elements of a part that differs between the ranks (heads, hidden features, a sequence
    chunk), which one seed on every rank would drop in one pattern (Megatron's model-parallel
    RNG). Dropout of replicated activations keeps the shared seed, so the copies stay equal."""
    if isinstance(module, Dropout) and module.seed is not None:
        entropy = np.random.SeedSequence([int(module.seed), mesh.get_local_rank()])
        module.reseed(int(entropy.generate_state(1)[0]))


def _mark_once(module: Module, mesh: DeviceMesh, style: str) -> None:
    """Refuse ``style`` on a module it was applied to before (its hooks would run twice)."""
    styles = module.__dict__.setdefault("_tp_styles", set())
    if style in styles:
        raise ValueError(f"{rank_text(mesh)}: {style} is already applied to {module!r}")
    styles.add(style)


def _local_output_only(style: str, use_local_output: bool) -> None:
    """torch's ``use_local_output``: pluribus.nn layers take and give local arrays, so only
    True is what happens here (torch's default for the Linear styles and PrepareModuleOutput;
    its PrepareModuleInput and SequenceParallel default to False, handing the module DTensors,
    which a pluribus module cannot take)."""
    if use_local_output is not True:
        raise ValueError(
            f"rank {dist.get_rank()}: {style}(use_local_output={use_local_output!r}): "
            "pluribus.nn layers take and give this rank's piece as a local array, so "
            "use_local_output=True is the only choice (a plan ported from torch drops the "
            "argument); wrap a piece with DTensor.from_local where a DTensor is wanted"
        )


class ParallelStyle:
    """How to split one module over a 1-d mesh; ``parallelize_module`` applies it."""

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        raise NotImplementedError


def _check_layer(module: Module, mesh: DeviceMesh, style: str, kinds=(Linear,)) -> None:
    if not isinstance(module, kinds):
        raise TypeError(
            f"{rank_text(mesh)}: {style} splits "
            f"{' and '.join('nn.' + k.__name__ for k in kinds)} layers, got "
            f"{type(module).__name__}; an attention block or an MLP takes AttentionParallel or "
            "MLPParallel"
        )
    if getattr(module, "_tp_split", False):
        raise ValueError(f"{rank_text(mesh)}: {module!r} is already tensor-parallel")


def _no_partial(style: str, **layouts: Placement | None) -> None:
    """A style's inputs and outputs are values (replicated or sharded), never Partial terms."""
    for name, layout in layouts.items():
        if layout is not None and not isinstance(layout, (Replicate, Shard)):
            raise ValueError(
                f"rank {dist.get_rank()}: {style}({name}={layout!r}): a layer takes and gives "
                "values, Replicate() or Shard(d), not Partial terms"
            )


class ColwiseParallel(ParallelStyle):
    """Split the output features: weight ``Shard(0)``, bias ``Shard(0)``.

    ``input_layouts``: ``Replicate()`` (default) or ``Shard(d)`` (sequence parallel: the input
    is gathered first). ``output_layouts``: ``Shard(-1)`` (default: the local features, ready for
    a row-parallel layer) or ``Replicate()`` (gathered).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        _local_output_only("ColwiseParallel", use_local_output)
        _no_partial("ColwiseParallel", input_layouts=input_layouts, output_layouts=output_layouts)
        self.input_layout = input_layouts or Replicate()
        self.output_layout = output_layouts or Shard(-1)
        self._reduce_input_grad = True

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        _check_layer(module, mesh, "ColwiseParallel")
        blocks = module.weight.blocks  # each of a fused projection's blocks split alike
        if module.out_features % blocks:
            raise ValueError(f"{rank_text(mesh)}: cannot split {module!r} in {blocks}")
        if module.bias is not None and module.bias.blocks != blocks:
            raise ValueError(
                f"{rank_text(mesh)}: {module!r} has a weight of {blocks} block(s) and a bias of "
                f"{module.bias.blocks}; a fused projection's bias stacks the same blocks (set "
                "Parameter.blocks on both)"
            )
        inp, out, features = self.input_layout, self.output_layout, module.in_features
        if out != Shard(-1) and blocks != 1:
            raise ValueError(f"{rank_text(mesh)}: a fused projection keeps Shard(-1)")
        splits = self._splits(module)
        check_splits(mesh, splits)
        full_out = module.out_features
        for param, dim, chunks in splits:
            shard_parameter(param, dim, mesh, chunks)
        module._tp_split = True
        module.out_features = int(module.weight.data.shape[0])
        if inp != Replicate():
            module.register_forward_pre_hook(
                lambda m, args: (move(args[0], mesh, inp, Replicate(), features),)
            )
        if out != Shard(-1):

            def gather_output(m, args, y):
                m._tp_output_shape = (*y.shape[:-1], full_out)  # for the gradient's sizes
                return move(y, mesh, Shard(-1), out, full_out)

            module.register_forward_hook(gather_output)
            module.register_full_backward_pre_hook(
                lambda m, g: (
                    move(
                        g[0], mesh, out, Shard(-1), full_out, global_rows(m._tp_output_shape, out)
                    ),
                ),
                prepend=True,
            )
        if self._reduce_input_grad:
            module.register_full_backward_hook(
                lambda m, gi, go: (move(gi[0], mesh, Partial(), inp, features),), prepend=True
            )
        return module

    @staticmethod
    def _splits(module: Linear) -> list[tuple[Parameter, int, int]]:
        """What it cuts: weight and bias along the output features, block by block."""
        params = [p for p in (module.weight, module.bias) if p is not None]
        return [(p, 0, module.weight.blocks) for p in params]


class RowwiseParallel(ParallelStyle):
    """Split the input features: weight ``Shard(1)``, bias replicated and added after the sum.

    ``input_layouts``: ``Shard(-1)`` (default: what a column-parallel layer gives) or
    ``Replicate()`` (sliced locally). ``output_layouts``: ``Replicate()`` (default: an
    all-reduce) or ``Shard(d)`` (sequence parallel: a reduce-scatter).

    On an ``nn.Embedding`` it splits the table by rows (the vocabulary): the token ids come
    replicated (the default there), a token of another rank's rows looks up zeros, and the
    ranks' lookups are summed the same way.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        _local_output_only("RowwiseParallel", use_local_output)
        _no_partial("RowwiseParallel", input_layouts=input_layouts, output_layouts=output_layouts)
        self.input_layout = input_layouts  # None: Shard(-1) for a Linear, Replicate() for ids
        self.output_layout = output_layouts or Replicate()

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        _check_layer(module, mesh, "RowwiseParallel", (Linear, Embedding))
        check_splits(mesh, self._splits(module))
        if isinstance(module, Embedding):
            return self._apply_to_embedding(module, mesh)
        full_in = module.in_features
        shard_parameter(module.weight, 1, mesh)
        module._tp_split = True
        module.in_features = int(module.weight.data.shape[1])
        inp, out, features = self.input_layout or Shard(-1), self.output_layout, module.out_features
        module.__class__ = RowParallelLinear
        module._tp_mesh = mesh
        module._tp_output_layout = out
        module._tp_output_features = rank_span(features, mesh)
        if inp != Shard(-1):
            module.register_forward_pre_hook(
                lambda m, args: (move(args[0], mesh, inp, Shard(-1), full_in),)
            )
            module.register_full_backward_hook(
                lambda m, gi, go: (move(gi[0], mesh, Shard(-1), inp, full_in),), prepend=True
            )
        if out != Replicate():
            module.register_full_backward_pre_hook(
                lambda m, g: (
                    move(
                        g[0], mesh, out, Replicate(), features, global_rows(m._tp_output_shape, out)
                    ),
                ),
                prepend=True,
            )
        return module

    @staticmethod
    def _splits(module: Linear | Embedding) -> list[tuple[Parameter, int, int]]:
        """What it cuts: a Linear's weight along the input features (the bias stays whole),
        an Embedding's table by rows."""
        return [(module.weight, 0 if isinstance(module, Embedding) else 1, 1)]

    def _apply_to_embedding(self, module: Embedding, mesh: DeviceMesh) -> Module:
        """Split the table's rows (the vocabulary); the token ids come replicated."""
        if self.input_layout not in (None, Replicate()):
            raise ValueError(
                f"{rank_text(mesh)}: a row-parallel Embedding takes its token ids replicated "
                f"(input_layouts=Replicate()), got {self.input_layout!r}"
            )
        shard_parameter(module.weight, 0, mesh)
        module._tp_split = True
        rows = rank_span(module.num_embeddings, mesh)
        module.__class__ = VocabParallelEmbedding
        module._tp_mesh, module._tp_rows = mesh, (rows.start, rows.stop)
        module._tp_output_layout = out = self.output_layout
        if out != Replicate():
            module.register_full_backward_pre_hook(
                lambda m, g: (
                    move(g[0], mesh, out, Replicate(), m.embedding_dim, m._tp_output_rows),
                ),
                prepend=True,
            )
        return module


class AttentionParallel(ParallelStyle):
    """Split a :class:`~pluribus.nn.CausalSelfAttention` by heads: the q, k, v projections
    column-parallel (each of the three blocks of a fused ``qkv``), ``proj`` row-parallel, and one
    all-reduce of the input gradient for all three projections.

    ``sequence_dim=d``: input and output are this rank's part of dimension ``d`` (sequence
    parallelism): gathered on the way in, reduce-scattered on the way out.
    """

    def __init__(self, *, sequence_dim: int | None = None):
        self.sequence_dim = sequence_dim

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        if not isinstance(module, CausalSelfAttention):
            raise TypeError(
                f"{rank_text(mesh)}: AttentionParallel splits CausalSelfAttention, got "
                f"{type(module).__name__}"
            )
        tp = mesh.size()
        if module.num_heads % tp:
            raise ValueError(
                f"{rank_text(mesh)}: {module.num_heads} heads do not split evenly over {tp} "
                "ranks; pick a tensor-parallel size that divides the number of heads"
            )
        projections = [module.qkv] if module.fused_qkv else [module.query, module.key, module.value]
        for linear in [*projections, module.proj]:  # every layer checked before any is split
            _check_layer(linear, mesh, "AttentionParallel")
        if module.fused_qkv:  # q, k and v, one after the other, whatever a loaded Parameter says
            for param in module.qkv.parameters():
                param.blocks = 3
        splits = [s for linear in projections for s in ColwiseParallel._splits(linear)]
        check_splits(mesh, splits + RowwiseParallel._splits(module.proj))
        for linear in projections:
            style = ColwiseParallel()
            style._reduce_input_grad = False
            style.apply(linear, mesh)
        outer = Replicate() if self.sequence_dim is None else Shard(self.sequence_dim)
        RowwiseParallel(output_layouts=outer).apply(module.proj, mesh)
        _own_stream(module.attn_dropout, mesh)  # this rank's heads
        if outer != Replicate():  # this rank's part of the sequence
            _own_stream(module.resid_dropout, mesh)
        module.num_heads //= tp
        features = module.embed_dim
        if outer != Replicate():
            module.register_forward_pre_hook(
                lambda m, args: (move(args[0], mesh, outer, Replicate(), features),)
            )
        module.register_full_backward_hook(
            lambda m, gi, go: (move(gi[0], mesh, Partial(), outer, features),), prepend=True
        )
        return module


class MLPParallel(ParallelStyle):
    """Split a transformer MLP (``Sequential(Linear, activation, Linear, ...)``): the first
    Linear column-parallel, the last row-parallel, the activation on the local features.
    ``sequence_dim`` as for :class:`AttentionParallel`."""

    def __init__(self, *, sequence_dim: int | None = None):
        self.sequence_dim = sequence_dim

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        linears = [m for m in module.children() if isinstance(m, Linear)]
        if not isinstance(module, Sequential) or len(linears) != 2:
            raise TypeError(
                f"{rank_text(mesh)}: MLPParallel needs a Sequential with two Linear layers, "
                f"got {module!r}"
            )
        for linear in linears:  # both checked before either is split
            _check_layer(linear, mesh, "MLPParallel")
        splits = ColwiseParallel._splits(linears[0]) + RowwiseParallel._splits(linears[1])
        check_splits(mesh, splits)
        outer = Replicate() if self.sequence_dim is None else Shard(self.sequence_dim)
        ColwiseParallel(input_layouts=outer).apply(linears[0], mesh)
        RowwiseParallel(output_layouts=outer).apply(linears[1], mesh)
        children = list(module.children())
        first, last = children.index(linears[0]), children.index(linears[1])
        for k, child in enumerate(children):  # this rank's hidden features; its sequence part
            if first < k < last or (k > last and outer != Replicate()):
                _own_stream(child, mesh)
        return module


class SequenceParallel(ParallelStyle):
    """A per-token module (LayerNorm, dropout) on this rank's part of the sequence, with its
    parameters replicated: each gradient it adds is summed over the tensor-parallel ranks
    (one small all-reduce) before it reaches ``.grad``, so every rank holds the whole one. A
    seeded dropout in it draws a stream of this rank's own (its tokens differ from the others').

    torch's arguments: ``sequence_dim`` is the dimension of the input the ranks split. The
    module runs on the local piece whatever it is, so it is only checked, at each forward (the
    input is not known when the style is applied): a dimension the input lacks is refused.
    ``use_local_output`` is True only (the module takes and gives local arrays).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = True):
        _local_output_only("SequenceParallel", use_local_output)
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, (int, np.integer)):
            raise TypeError(
                f"rank {dist.get_rank()}: SequenceParallel(sequence_dim={sequence_dim!r}): the "
                "sequence dimension is an int (1 for (batch, sequence, features) inputs)"
            )
        self.sequence_dim = int(sequence_dim)

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        _mark_once(module, mesh, "SequenceParallel")
        dim = self.sequence_dim

        def accumulate(param: Parameter, grad: Any) -> None:
            Parameter.accumulate_grad(param, move(grad, mesh, Partial(), Replicate(), 0))

        def check(m: Module, args: tuple) -> None:
            ndim = getattr(args[0], "ndim", None) if args else None
            if ndim is not None and not -ndim <= dim < ndim:
                raise ValueError(
                    f"{rank_text(mesh)}: SequenceParallel(sequence_dim={dim}) on {m!r} got an "
                    f"input of shape {tuple(args[0].shape)}, which has no dimension {dim}; pass "
                    "the dimension the ranks split the sequence along"
                )

        for _, param in module.named_parameters():
            # a method of the parameter: a deep copy of the model binds it to the copy
            param.accumulate_grad = types.MethodType(accumulate, param)
        for _, child in module.named_modules():
            _own_stream(child, mesh)
        module.register_forward_pre_hook(check)
        return module


class SequenceSharded(ParallelStyle):
    """Run a module (the stack of blocks) on this rank's part of dimension ``dim``: its
    replicated input is sliced on the way in and its output gathered on the way out (and the
    reverse for gradients); a sequence length that does not divide by the tensor-parallel size
    is cut by the array_split rule."""

    def __init__(self, dim: int = 1):
        self.dim = dim

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        _mark_once(module, mesh, "SequenceSharded")
        part, dim = Shard(self.dim), self.dim

        # the length cut goes on the module (``m``), not in the closure, so that a deep copy of
        # the model keeps its own
        def mine(m: Module, x: Any) -> Any:
            m._tp_rows = x.shape[dim]
            return move(x, mesh, Replicate(), part, 0)

        def whole(m: Module, x: Any) -> Any:  # the sizes mine() cut
            return move(x, mesh, part, Replicate(), 0, m._tp_rows)

        module.register_forward_pre_hook(lambda m, args: (mine(m, args[0]),))
        module.register_forward_hook(lambda m, args, y: whole(m, y))
        module.register_full_backward_pre_hook(lambda m, g: (mine(m, g[0]),), prepend=True)
        module.register_full_backward_hook(lambda m, gi, go: (whole(m, gi[0]),), prepend=True)
        return module
