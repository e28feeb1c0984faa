"""Tensor parallelism for ``pluribus.nn``: Linear layers, attention heads and the transformer
MLP split over a 1-d mesh, as torch's ``parallelize_module`` does.

Parameters keep their names and become this rank's pieces (``full_parameter`` puts one back
together). The communication is a DTensor redistribute at each boundary: a column-parallel
layer takes a replicated input and gives a shard of the output features, whose input gradient is
a ``Partial`` sum (one all-reduce in backward); a row-parallel layer takes that shard and gives a
``Partial`` output (one all-reduce in forward) before its bias is added once. An MLP or an
attention block thus costs one all-reduce in forward and one in backward.
"""

from __future__ import annotations

import fnmatch
import types
from typing import Any

import numpy as np

from .. import distributed as dist
from ..dtensor import Partial, Placement, Replicate, Shard, from_local
from ..dtensor.layout import split_sizes
from ..mesh import DeviceMesh
from ..nn.layers import Dropout, Embedding, Linear, _scatter_add
from ..nn.module import Module, Parameter, Sequential, array_namespace
from ..nn.transformer import CausalSelfAttention
from .clip_norm import norm_exponent, norm_part, scale_to_norm


def _rank_text(mesh: DeviceMesh) -> str:
    return f"rank {dist.get_rank()}"


def _move(
    array: Any,
    mesh: DeviceMesh,
    src: Placement,
    dst: Placement,
    features: int,
    rows: int | None = None,
) -> Any:
    """``array`` (this rank's piece in ``src``) redistributed to ``dst`` along the mesh.
    A ``Shard`` source of the last dimension has ``features`` entries there in all; of another
    dimension (batch, sequence), ``rows`` when the caller knows them, else the ranks exchange
    their pieces' shapes to learn the sizes (uneven ones included: never guessed)."""
    if src == dst:
        return array
    shape = list(array.shape)
    if isinstance(src, Shard):
        if src.dim % len(shape) == len(shape) - 1:
            shape[-1] = features
        elif rows is None:
            dt = from_local(array, mesh, [src])  # the same sizes on every rank: refused alike
            sizes = dt.layout.sizes[0]
            if sizes != split_sizes(sum(sizes), len(sizes)):
                raise ValueError(
                    f"{_rank_text(mesh)}: a tensor-parallel layer takes an input sharded along "
                    f"dimension {src.dim} in array_split pieces, which its output and gradient "
                    f"keep: {split_sizes(sum(sizes), len(sizes))} rows for the ranks of the "
                    f"mesh, got {sizes}"
                )
            return dt.redistribute(placements=[dst]).to_local()
        else:
            shape[src.dim] = rows
    dt = from_local(array, mesh, [src], run_check=False, shape=shape)
    return dt.redistribute(placements=[dst]).to_local()


def _rows(shape: tuple[int, ...], placement: Placement) -> int | None:
    """The global size along ``placement``'s sharded dimension of an array of global
    ``shape`` (None for a placement that shards nothing)."""
    return shape[placement.dim] if isinstance(placement, Shard) else None


def _piece(array: Any, dim: int, mesh: DeviceMesh, chunks: int) -> Any:
    """This rank's part of ``array`` along ``dim``: of each of ``chunks`` equal blocks (q, k and v
    of a fused projection), the array_split piece."""
    xp = array_namespace(array)
    me, p = mesh.get_local_rank(), mesh.size()
    block = array.shape[dim] // chunks
    pieces = []
    for c in range(chunks):
        sizes = split_sizes(block, p)
        start = c * block + sum(sizes[:me])
        index = (slice(None),) * dim + (slice(start, start + sizes[me]),)
        pieces.append(array[index])
    return xp.ascontiguousarray(xp.concatenate(pieces, axis=dim))


def _check_splits(mesh: DeviceMesh, splits: list[tuple[Parameter, int, int]]) -> None:
    """Refuse, before a style changes anything, to split a parameter that a layer sharing it
    split, or is about to split in the same style, another way. ``splits``: the (parameter,
    dimension, blocks) the style will cut."""
    planned: dict[int, tuple] = {}
    for param, dim, blocks in splits:
        layout = getattr(param, "tp_layout", None)
        other = layout[:3] if layout is not None else planned.get(id(param))
        if other is not None and other != (mesh, dim, blocks):
            raise ValueError(
                f"{_rank_text(mesh)}: a parameter shared by two layers is split along "
                f"dimension {other[1]} over {other[0]!r} by one and along dimension {dim} over "
                f"{mesh!r} by the other; shared weights are split alike (the token embedding "
                "row-wise, the head column-wise)"
            )
        planned[id(param)] = (mesh, dim, blocks)


def _shard_parameter(param: Parameter, dim: int, mesh: DeviceMesh, chunks: int = 1) -> None:
    """Keep this rank's piece of ``param`` along ``dim`` (checked by :func:`_check_splits`).
    A parameter that a layer sharing it split already (a head tied to the token embedding:
    both keep this rank's rows) stays as it is."""
    if getattr(param, "tp_layout", None) is not None:
        return
    param.tp_layout = (mesh, dim, chunks, tuple(param.data.shape))
    param.data = _piece(param.data, dim, mesh, chunks)
    param.grad = None


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
        raise ValueError(f"{_rank_text(mesh)}: {style} is already applied to {module!r}")
    styles.add(style)


def full_parameter(param: Parameter, grad: bool = False) -> Any:
    """The whole parameter (or its gradient) on every rank, from the pieces of a tensor-parallel
    layer; a parameter that is not split comes back as it is."""
    local = param.grad if grad else param.data
    layout = getattr(param, "tp_layout", None)
    if layout is None:
        return local
    mesh, dim, chunks, shape = layout
    xp = array_namespace(local)
    block = shape[dim] // chunks
    mine = local.shape[dim] // chunks
    parts = []
    for c in range(chunks):
        index = (slice(None),) * dim + (slice(c * mine, (c + 1) * mine),)
        piece_shape = list(shape)
        piece_shape[dim] = block
        piece = xp.ascontiguousarray(local[index])
        dt = from_local(piece, mesh, [Shard(dim)], run_check=False, shape=piece_shape)
        parts.append(dt.full_tensor())
    return xp.concatenate(parts, axis=dim)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> float:
    """torch's ``clip_grad_norm_`` for a tensor-parallel model (any ``pluribus.nn``
    parameters): the norm of the whole gradients, a split parameter's pieces summed (for the
    infinity norm, maxed) over its mesh, so that every rank scales by the same factor and the
    replicated parameters stay equal; returns that norm, of the gradients before clipping.
    Under DDP, call it after backward (the gradients are already averaged). Collective over
    each tensor-parallel mesh: every rank passes its parameters in the same order."""
    p = norm_exponent(norm_type)
    infinite = np.isinf(p)

    def combine(a: Any, b: Any) -> Any:
        return b if a is None else (max(a, b) if infinite else a + b)

    # (mesh of a split parameter or None, array library) -> the part of the norm, kept where
    # the gradients are: one copy to the host per library, not one per gradient
    parts: dict[tuple[DeviceMesh | None, Any], Any] = {}
    grads = []
    for param in parameters:
        if getattr(param, "sharded_by_fsdp", False):
            raise ValueError(
                f"rank {dist.get_rank()}: clip_grad_norm_ got a parameter that FSDP shards; "
                "use the FSDP model's own model.clip_grad_norm_(max_norm)"
            )
        g = param.grad
        if g is None:
            continue
        grads.append(g)
        xp = array_namespace(g)
        # an empty piece still takes part in its mesh's all-reduce
        part = xp.zeros((), np.float64) if g.size == 0 else norm_part(g, p)
        layout = getattr(param, "tp_layout", None)
        key = (None if layout is None else layout[0], xp)
        previous = parts.get(key)
        parts[key] = part if previous is None else (
            xp.maximum(previous, part) if infinite else previous + part
        )  # fmt: skip
    total = None
    for (mesh, _), part in parts.items():  # in the parameters' order: alike on every rank
        if mesh is not None:  # a split parameter's pieces: their parts over its mesh
            part = part.reshape(1).astype(np.float64)
            op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op, group=mesh.get_group())
            part = part[0]
        total = combine(total, float(part))
    return scale_to_norm(grads, 0.0 if total is None else total, p, max_norm)


def _local_output_only(style: str, use_local_output: bool) -> None:
    """torch's ``use_local_output``: pluribus.nn layers take and give local arrays, so only
    True (torch's default for these styles) is what happens here."""
    if use_local_output is not True:
        raise ValueError(
            f"rank {dist.get_rank()}: {style}(use_local_output={use_local_output!r}): "
            "pluribus.nn layers give this rank's piece as a local array (use_local_output=True); "
            "wrap it with DTensor.from_local for a DTensor"
        )


class ParallelStyle:
    """How to split one module over a 1-d mesh; ``parallelize_module`` applies it."""

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        raise NotImplementedError


def _check_layer(module: Module, mesh: DeviceMesh, style: str, kinds=(Linear,)) -> None:
    if not isinstance(module, kinds):
        raise TypeError(
            f"{_rank_text(mesh)}: {style} splits "
            f"{' and '.join('nn.' + k.__name__ for k in kinds)} layers, got "
            f"{type(module).__name__}; an attention block or an MLP takes AttentionParallel or "
            "MLPParallel"
        )
    if getattr(module, "_tp_split", False):
        raise ValueError(f"{_rank_text(mesh)}: {module!r} is already tensor-parallel")


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
            raise ValueError(f"{_rank_text(mesh)}: cannot split {module!r} in {blocks}")
        if module.bias is not None and module.bias.blocks != blocks:
            raise ValueError(
                f"{_rank_text(mesh)}: {module!r} has a weight of {blocks} block(s) and a bias of "
                f"{module.bias.blocks}; a fused projection's bias stacks the same blocks (set "
                "Parameter.blocks on both)"
            )
        inp, out, features = self.input_layout, self.output_layout, module.in_features
        if out != Shard(-1) and blocks != 1:
            raise ValueError(f"{_rank_text(mesh)}: a fused projection keeps Shard(-1)")
        splits = self._splits(module)
        _check_splits(mesh, splits)
        full_out = module.out_features
        for param, dim, chunks in splits:
            _shard_parameter(param, dim, mesh, chunks)
        module._tp_split = True
        module.out_features = int(module.weight.data.shape[0])
        if inp != Replicate():
            module.register_forward_pre_hook(
                lambda m, args: (_move(args[0], mesh, inp, Replicate(), features),)
            )
        if out != Shard(-1):

            def gather_output(m, args, y):
                m._tp_output_shape = (*y.shape[:-1], full_out)  # for the gradient's sizes
                return _move(y, mesh, Shard(-1), out, full_out)

            module.register_forward_hook(gather_output)
            module.register_full_backward_pre_hook(
                lambda m, g: (
                    _move(g[0], mesh, out, Shard(-1), full_out, _rows(m._tp_output_shape, out)),
                )
            )
        if self._reduce_input_grad:
            module.register_full_backward_hook(
                lambda m, gi, go: (_move(gi[0], mesh, Partial(), inp, features),)
            )
        return module

    @staticmethod
    def _splits(module: Linear) -> list[tuple[Parameter, int, int]]:
        """What it cuts: weight and bias along the output features, block by block."""
        params = [p for p in (module.weight, module.bias) if p is not None]
        return [(p, 0, module.weight.blocks) for p in params]


class _RowwiseLinear(Linear):
    """A Linear whose partial products are reduced before the bias is added (once). What the
    reduction needs lives on the module (no closure over it), so a deep copy reduces its own."""

    def forward(self, x: Any) -> Any:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self!r} (row-parallel) expects this rank's {self.in_features} input features, "
                f"got shape {tuple(x.shape)}"
            )
        self.save_for_backward(input=x)
        y = x @ self.weight.data.T
        self._tp_output_shape = y.shape  # for the gradient's sizes
        y = _move(y, self._tp_mesh, Partial(), self._tp_output_layout, self.out_features)
        if self.bias is not None:
            out = self._tp_output_layout
            bias = self.bias.data
            if isinstance(out, Shard) and out.dim % y.ndim == y.ndim - 1:
                bias = bias[self._tp_output_features]  # the output holds this rank's features
            y = y + bias
        return y


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
        _check_splits(mesh, self._splits(module))
        if isinstance(module, Embedding):
            return self._apply_to_embedding(module, mesh)
        full_in = module.in_features
        _shard_parameter(module.weight, 1, mesh)
        module._tp_split = True
        module.in_features = int(module.weight.data.shape[1])
        inp, out, features = self.input_layout or Shard(-1), self.output_layout, module.out_features
        module.__class__ = _RowwiseLinear
        sizes, me = split_sizes(features, mesh.size()), mesh.get_local_rank()
        start = sum(sizes[:me])
        module._tp_mesh = mesh
        module._tp_output_layout = out
        module._tp_output_features = slice(start, start + sizes[me])
        if inp != Shard(-1):
            module.register_forward_pre_hook(
                lambda m, args: (_move(args[0], mesh, inp, Shard(-1), full_in),)
            )
            module.register_full_backward_hook(
                lambda m, gi, go: (_move(gi[0], mesh, Shard(-1), inp, full_in),)
            )
        if out != Replicate():
            module.register_full_backward_pre_hook(
                lambda m, g: (
                    _move(g[0], mesh, out, Replicate(), features, _rows(m._tp_output_shape, out)),
                )
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
                f"{_rank_text(mesh)}: a row-parallel Embedding takes its token ids replicated "
                f"(input_layouts=Replicate()), got {self.input_layout!r}"
            )
        _shard_parameter(module.weight, 0, mesh)
        module._tp_split = True
        sizes, me = split_sizes(module.num_embeddings, mesh.size()), mesh.get_local_rank()
        start = sum(sizes[:me])
        module.__class__ = _RowwiseEmbedding
        module._tp_mesh, module._tp_rows = mesh, (start, start + sizes[me])
        module._tp_output_layout = out = self.output_layout
        if out != Replicate():
            module.register_full_backward_pre_hook(
                lambda m, g: (
                    _move(g[0], mesh, out, Replicate(), m.embedding_dim, m._tp_output_rows),
                )
            )
        return module


class _RowwiseEmbedding(Embedding):
    """An Embedding holding rows ``_tp_rows`` of the table (``num_embeddings`` stays the whole
    vocabulary): a token of another rank's rows looks up zeros here, and the ranks' lookups
    are summed (one all-reduce, or a reduce-scatter into this rank's part of the sequence).
    The gradient of the table is this rank's rows only."""

    def forward(self, indices: Any) -> Any:
        self._check_indices(indices)
        start, stop = self._tp_rows
        xp = array_namespace(self.weight.data)
        local = indices.astype(np.int64) - start  # in a narrow or unsigned type it would wrap
        mine = (local >= 0) & (local < stop - start)
        if stop > start:
            rows = self.weight.data[xp.where(mine, local, 0)]
            rows = xp.where(mine[..., None], rows, 0)  # not a product: inf * 0 is nan
        else:  # no rows here (more ranks than tokens): zeros to sum
            rows = xp.zeros((*indices.shape, self.embedding_dim), self.weight.data.dtype)
        self.save_for_backward(local=local, mine=mine)
        out = self._tp_output_layout
        if isinstance(out, Shard):
            self._tp_output_rows = rows.shape[out.dim]  # for the gradient's sizes
        return _move(rows, self._tp_mesh, Partial(), out, self.embedding_dim)

    def backward_weight(self) -> None:
        local, mine, grad_output = self.saved("local", "mine", "grad_output")
        xp = array_namespace(grad_output)
        grad = xp.zeros_like(self.weight.data)
        mine = mine.reshape(-1)
        rows = grad_output.reshape(-1, self.embedding_dim)[mine]
        _scatter_add(xp, grad, local.reshape(-1)[mine], rows)
        self.weight.accumulate_grad(grad)
        self.release_saved(recurse=False)


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
                f"{_rank_text(mesh)}: AttentionParallel splits CausalSelfAttention, got "
                f"{type(module).__name__}"
            )
        tp = mesh.size()
        if module.num_heads % tp:
            raise ValueError(
                f"{_rank_text(mesh)}: {module.num_heads} heads do not split evenly over {tp} "
                "ranks; pick a tensor-parallel size that divides the number of heads"
            )
        projections = [module.qkv] if module.fused_qkv else [module.query, module.key, module.value]
        for linear in [*projections, module.proj]:  # every layer checked before any is split
            _check_layer(linear, mesh, "AttentionParallel")
        if module.fused_qkv:  # q, k and v, one after the other, whatever a loaded Parameter says
            for param in module.qkv.parameters():
                param.blocks = 3
        splits = [s for linear in projections for s in ColwiseParallel._splits(linear)]
        _check_splits(mesh, splits + RowwiseParallel._splits(module.proj))
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
                lambda m, args: (_move(args[0], mesh, outer, Replicate(), features),)
            )
        module.register_full_backward_hook(
            lambda m, gi, go: (_move(gi[0], mesh, Partial(), outer, features),)
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
                f"{_rank_text(mesh)}: MLPParallel needs a Sequential with two Linear layers, "
                f"got {module!r}"
            )
        for linear in linears:  # both checked before either is split
            _check_layer(linear, mesh, "MLPParallel")
        splits = ColwiseParallel._splits(linears[0]) + RowwiseParallel._splits(linears[1])
        _check_splits(mesh, splits)
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
    (one small all-reduce) before it reaches ``.grad``, so every rank holds the whole one."""

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        _mark_once(module, mesh, "SequenceParallel")

        def accumulate(param: Parameter, grad: Any) -> None:
            Parameter.accumulate_grad(param, _move(grad, mesh, Partial(), Replicate(), 0))

        for _, param in module.named_parameters():
            # a method of the parameter: a deep copy of the model binds it to the copy
            param.accumulate_grad = types.MethodType(accumulate, param)
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
            return _move(x, mesh, Replicate(), part, 0)

        def whole(m: Module, x: Any) -> Any:  # the sizes mine() cut
            return _move(x, mesh, part, Replicate(), 0, m._tp_rows)

        module.register_forward_pre_hook(lambda m, args: (mine(m, args[0]),))
        module.register_forward_hook(lambda m, args, y: whole(m, y))
        module.register_full_backward_pre_hook(lambda m, g: (mine(m, g[0]),))
        module.register_full_backward_hook(lambda m, gi, go: (whole(m, gi[0]),))
        return module


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
            f"{_rank_text(mesh)}: tensor parallelism takes a 1-d mesh, got {mesh.shape}; pass "
            'the tensor-parallel slice, e.g. mesh["tp"]'
        )
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan.apply(module, mesh)
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
                f"{_rank_text(mesh)}: parallelize plan entry {pattern!r} matches no module "
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
