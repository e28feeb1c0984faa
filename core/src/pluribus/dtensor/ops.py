"""Local operations on DTensors and the placements of their results.

Every rule maps the operands' placements on each mesh dimension to the result's without
communicating; where no rule exists the error names the mesh dimension and the redistribute
that would make one apply (placements never change behind the user's back).
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from ..arrays import bfloat16_dtype, supported_dtypes
from ..nn.module import array_namespace
from .api import DTensor, _rank
from .layout import Layout, split_sizes
from .placements import Partial, Placement, Replicate, Shard

_LINEAR = ("sum", "avg")
#: the placement of a Partial max or min after a decreasing map of its terms
_FLIP = {"max": Partial("min"), "min": Partial("max")}


def _fail(message: str):
    raise ValueError(f"rank {_rank()}: {message}")


def _on_pieces(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a numpy ufunc or operator on local pieces (or empty stand-ins), its type
    errors (no loop of the ufunc for those dtypes: the same on every rank) said with the rank
    and the operation, as a TypeError (numpy's own class of it is private)."""
    try:
        return fn(*args)
    except TypeError as error:
        dtypes = " and ".join(str(getattr(a, "dtype", type(a).__name__)) for a in args)
        raise TypeError(f"rank {_rank()}: {what} of {dtypes}: {error}") from error


def _same_mesh(a: DTensor, b: DTensor, what: str) -> None:
    if a.device_mesh is not b.device_mesh and a.device_mesh != b.device_mesh:
        _fail(
            f"{what} mixes DTensors of two meshes ({a.device_mesh!r} and {b.device_mesh!r}); "
            "build both on one mesh"
        )


_NOT_A_SCALAR = object()


def _host_scalar(x: Any) -> Any:
    """``x`` as a host scalar that meets any piece: Python and numpy scalars as they are, a 0-d
    array of numpy or of a device library as a numpy scalar of its dtype (cupy takes no numpy
    arrays, and its reductions give 0-d arrays; the copy to the host is the same on every
    rank); ``_NOT_A_SCALAR`` for anything else."""
    if isinstance(x, (int, float, complex, np.generic)):
        return x
    if getattr(x, "ndim", None) == 0 and not isinstance(x, DTensor):
        host = x if isinstance(x, np.ndarray) else getattr(x, "get", lambda: x)()
        return np.asarray(host)[()]
    return _NOT_A_SCALAR


def _is_float(dtype: Any) -> bool:
    """Floating point, bfloat16 included (ml_dtypes gives it numpy's kind "V")."""
    dtype = np.dtype(dtype)
    bf16 = bfloat16_dtype()
    return dtype.kind == "f" or (bf16 is not None and dtype == bf16)


def _refuse_widened(p: Partial, m: int, source: Any, result: Any, what: str) -> None:
    """A sum's terms of bool or narrow integers turned into a wider dtype are reduced in
    another arithmetic than the value was (bool terms are or-ed, narrow integers wrap): the
    result would not be the operation applied to the value."""
    source, result = np.dtype(source), np.dtype(result)
    if result != source and (source.kind == "b" or (source.kind in "iu" and source.itemsize < 8)):
        _fail(
            f"{what} of {p!r} (mesh dimension {m}) would turn its {source} terms into {result}, "
            "reduced in another arithmetic than the value was (bool terms are or-ed, narrow "
            "integers wrap); redistribute to Replicate first"
        )


# -- elementwise -----------------------------------------------------------------------------


def _binary(name: str, a: Any, b: Any, fn: Callable[[Any, Any], Any]) -> DTensor:
    if isinstance(a, DTensor) and isinstance(b, DTensor):
        _same_mesh(a, b, name)
        if a.shape != b.shape:
            _fail(f"{name} of DTensors of shapes {a.shape} and {b.shape}: shapes must be equal")
        placements = []
        terms = []  # (mesh dimension, Partial, its operand) of the Partials the result keeps
        for m, (pa, pb) in enumerate(zip(a.placements, b.placements, strict=True)):
            if pa == pb and not isinstance(pa, Partial):
                if a.layout.sizes[m] != b.layout.sizes[m]:
                    _fail(
                        f"{name}: mesh dimension {m} shards with sizes {a.layout.sizes[m]} and "
                        f"{b.layout.sizes[m]}; redistribute one to the other's layout"
                    )
                placements.append(pa)
            elif pa == pb and name in ("add", "sub") and pa.op in _LINEAR:
                placements.append(pa)
                terms += [(m, pa, a), (m, pb, b)]
            elif (
                name in ("mul", "div")
                and isinstance(pa, Partial)
                and pa.op in _LINEAR
                and isinstance(pb, Replicate)
            ):
                placements.append(pa)
                terms.append((m, pa, a))
            elif (
                name == "mul" and isinstance(pb, Partial) and pb.op in _LINEAR and pa == Replicate()
            ):
                placements.append(pb)
                terms.append((m, pb, b))
            else:
                _fail(
                    f"{name} of {pa!r} and {pb!r} on mesh dimension {m} has no local rule; "
                    "redistribute the operands to equal placements (Partial to Replicate) first"
                )
        la, lb = a.to_local(), b.to_local()
        if terms:  # the result's dtype from host arrays of no elements: no arithmetic, no device
            result = _on_pieces(name, fn, np.empty(0, la.dtype), np.empty(0, lb.dtype)).dtype
            for m, p, operand in terms:
                _refuse_widened(p, m, operand.dtype, result, name)
        layout = Layout(a.shape, tuple(placements), a.layout.sizes)
        return DTensor(_on_pieces(name, fn, la, lb), a.device_mesh, layout)
    x, given = (a, b) if isinstance(a, DTensor) else (b, a)
    scalar = _host_scalar(given)
    if scalar is _NOT_A_SCALAR:
        _fail(f"{name} of a DTensor and a {type(given).__name__}: use a scalar or a DTensor")
    if np.iscomplexobj(scalar):
        _fail(f"{name} of a DTensor and a complex scalar: the collectives carry no complex arrays")
    a, b = (x, scalar) if x is a else (scalar, x)
    placements = list(x.placements)
    scaled = name == "mul" or (name == "div" and x is a)  # every term times one number
    local = x.to_local()
    empty = array_namespace(local).empty(0, local.dtype)  # the result's dtype, no arithmetic
    source = np.dtype(local.dtype)
    result = np.dtype(_on_pieces(name, fn, *(empty if v is x else v for v in (a, b))).dtype)
    for m, p in enumerate(x.placements):
        if not isinstance(p, Partial):
            continue
        why = None
        if p.op in _LINEAR:  # a shift would be added once per term of a sum
            if not (scaled or (p.op == "avg" and name in ("add", "sub"))):
                why = "would change the reduced value"
            elif (name == "mul" and np.isinf(scalar)) or (name == "div" and scalar == 0):
                why = "would make a zero term nan where the value gives an infinity"
            else:
                _refuse_widened(p, m, source, result, f"{name} with a scalar")
        else:  # max, min: a monotone map of every term; a decreasing one swaps max and min
            if not (name in ("add", "sub") or scaled):  # complex scalars are refused above
                why = "would change the reduced value"
            elif not _is_float(result):
                why = f"on {result} terms may wrap around, which is not monotone"
            elif not np.isfinite(scalar) or (scaled and scalar == 0):
                why = "that is not finite and nonzero meets an empty piece's -inf or inf"
            elif (name == "sub" and x is b) or (scaled and scalar < 0):
                placements[m] = _FLIP[p.op]
        if why is not None:
            _fail(
                f"{name} of {p!r} (mesh dimension {m}) and a scalar {why}; redistribute to "
                "Replicate first"
            )
    layout = x.layout
    if placements != list(x.placements):
        layout = Layout(x.shape, tuple(placements), x.layout.sizes)
    return DTensor(fn(*(local if v is x else v for v in (a, b))), x.device_mesh, layout)


def add(a, b):
    return _binary("add", a, b, lambda x, y: x + y)


def sub(a, b):
    return _binary("sub", a, b, lambda x, y: x - y)


def mul(a, b):
    return _binary("mul", a, b, lambda x, y: x * y)


def div(a, b):
    return _binary("div", a, b, lambda x, y: x / y)


def neg(x: DTensor) -> DTensor:
    """``-x``: negating the terms of a max gives the min of the negated terms (of floats:
    integers wrap, and an empty piece's term is the dtype's smallest)."""
    for m, p in enumerate(x.placements):
        if isinstance(p, Partial) and p.op in _FLIP and not _is_float(x.dtype):
            _fail(
                f"negating {p!r} (mesh dimension {m}) of {x.dtype} terms: integers wrap around; "
                "redistribute to Replicate first"
            )
    placements = tuple(_FLIP.get(p.op, p) if isinstance(p, Partial) else p for p in x.placements)
    return DTensor(-x.to_local(), x.device_mesh, Layout(x.shape, placements, x.layout.sizes))


def elementwise(fn: Callable[[Any], Any], x: DTensor) -> DTensor:
    """``fn`` applied to every element (any unary function of the local array: exp, tanh,
    GELU...). Partial operands are refused: ``fn`` of a sum is not the sum of ``fn``."""
    for m, p in enumerate(x.placements):
        if isinstance(p, Partial):
            _fail(
                f"elementwise {getattr(fn, '__name__', fn)} of {p!r} on mesh dimension {m}; "
                "redistribute to Replicate first"
            )
    if isinstance(fn, np.ufunc):  # numpy's no-loop errors said with the rank; a user's own
        out = _on_pieces(f"elementwise {fn.__name__}", fn, x.to_local())
    else:  # function's errors reach the caller as it raised them
        out = fn(x.to_local())
    if tuple(out.shape) != tuple(x.to_local().shape):
        _fail("elementwise functions must keep the shape of their input")
    return DTensor(out, x.device_mesh, x.layout)


def power(x: DTensor, exponent: Any) -> DTensor:
    """``x ** exponent`` for a scalar exponent, elementwise (Partial refused, as for any
    nonlinear function)."""
    exponent = _host_scalar(exponent)
    if not isinstance(x, DTensor) or exponent is _NOT_A_SCALAR:
        _fail("a power of DTensors takes a DTensor base and a scalar exponent")
    if np.dtype(x.dtype).kind in "iu" and np.asarray(exponent).dtype.kind in "iu" and exponent < 0:
        # numpy raises only where the piece is not empty: refuse on every rank
        _fail(f"{x.dtype} to the negative integer power {exponent}: use a float exponent")

    def power(local):
        return local**exponent

    return elementwise(power, x)


def astype(x: DTensor, dtype: Any) -> DTensor:
    """Every piece cast to ``dtype``. Replicate and Shard take any cast. A Partial keeps its
    value only under some: a sum's or an average's terms a safe cast (not of bool or narrow
    integers, which were or-ed or wrapped), a max's or min's terms a monotone one (a safe cast,
    or between floats)."""
    source, target = np.dtype(x.dtype), np.dtype(dtype)
    if target not in supported_dtypes():
        # as distribute_tensor and from_local(Partial) refuse it: no collective carries it
        _fail(
            f"astype to {target}: the collectives do not carry it; use one of "
            f"{', '.join(sorted(str(d) for d in supported_dtypes()))}"
        )
    for m, p in enumerate(x.placements):
        if not isinstance(p, Partial) or target == source:
            continue
        if p.op in _LINEAR:
            _refuse_widened(p, m, source, target, "astype")
            kept = np.can_cast(source, target, "safe")
        else:
            kept = np.can_cast(source, target, "safe") or (_is_float(source) and _is_float(target))
        if not kept:
            _fail(
                f"astype of {p!r} (mesh dimension {m}) from {source} to {target}: the terms "
                "cast one by one would not reduce to the value cast; redistribute to Replicate "
                "first"
            )
    return DTensor(x.to_local().astype(target), x.device_mesh, x.layout)


def transpose(x: DTensor, axes: tuple = ()) -> DTensor:
    """numpy's ``transpose``: the dimensions reversed (no axes, or None), or in the order
    ``axes`` (one sequence, an array too, or the integers themselves). Two integers that torch
    reads as a swap are refused where numpy would read them otherwise: ``(0, 1)`` of a matrix
    (no change to numpy), any two of another DTensor (an error to numpy); the message names
    the spelling that says it."""
    if len(axes) == 1 and not _is_integer(axes[0]):  # None, or a sequence of axes
        try:
            axes = () if axes[0] is None else tuple(axes[0])
        except TypeError:
            pass  # permute refuses it, naming what was given
    elif len(axes) == 2 and all(_is_integer(a) for a in axes):
        n, (a, b) = x.ndim, axes
        if all(-n <= v < n for v in axes):  # out of range: permute names the dimensions
            if n == 2 and [operator.index(v) % 2 for v in axes] == [0, 1]:
                _fail(
                    f"transpose({a}, {b}) of a 2-d DTensor is no change to numpy and a swap to "
                    f"torch; say which: x.transpose(({a}, {b})) or x.swapaxes({a}, {b})"
                )
            if n != 2:
                _fail(
                    f"transpose({a}, {b}) of a {n}-d DTensor: numpy's transpose takes all {n} "
                    f"dimensions in their new order; torch's transpose({a}, {b}) is "
                    f"x.swapaxes({a}, {b})"
                )
    return permute(x, axes if axes else tuple(reversed(range(x.ndim))), "transpose")


def swapaxes(x: DTensor, axis1: Any, axis2: Any) -> DTensor:
    """Two dimensions swapped (numpy's ``swapaxes``, torch's ``transpose(dim0, dim1)``)."""
    n = x.ndim
    if not all(_is_integer(a) and -n <= a < n for a in (axis1, axis2)):
        _fail(f"swapaxes of a {n}-d DTensor takes two of its dimensions, got ({axis1}, {axis2})")
    order = list(range(n))
    i, j = operator.index(axis1) % n, operator.index(axis2) % n
    order[i], order[j] = order[j], order[i]
    return permute(x, tuple(order))


# -- shapes ----------------------------------------------------------------------------------


def permute(x: DTensor, dims: Any, what: str = "permute") -> DTensor:
    """The dimensions in the order ``dims`` (torch's ``permute``, numpy's ``transpose(axes)``):
    a ``Shard(d)`` becomes ``Shard`` of where ``d`` went; the pieces are transposed locally."""
    n = x.ndim
    try:
        order = tuple(operator.index(d) % n if n else operator.index(d) for d in dims)
    except TypeError:
        order = None
    if order is None or sorted(order) != list(range(n)) or any(not -n <= d < n for d in dims):
        _fail(f"{what} of a {n}-d DTensor takes each of its dimensions once, got {tuple(dims)}")
    placements = tuple(
        Shard(order.index(p.dim)) if isinstance(p, Shard) else p for p in x.placements
    )
    layout = Layout(tuple(x.shape[d] for d in order), placements, x.layout.sizes)
    # a copy: the new piece must be C-contiguous and its own (a view would share the piece,
    # and a donation of either DTensor would write over the other)
    return DTensor(x.to_local().transpose(order).copy(), x.device_mesh, layout)


def _target_shape(shape: tuple[int, ...], given: Any) -> tuple[int, ...]:
    """``given`` (integers, at most one -1, numpy's rule) as the new shape of ``shape``."""
    try:
        dims = tuple(operator.index(n) for n in given)
    except TypeError:
        dims = None
    total = math.prod(shape)
    if dims is None or any(n < -1 for n in dims) or dims.count(-1) > 1:
        _fail(f"reshape takes integers, at most one of them -1; got {given!r}")
    known = math.prod(n for n in dims if n != -1)
    if -1 in dims:
        if known == 0 or total % known:
            _fail(f"cannot reshape a DTensor of shape {shape} into {dims}")
        dims = tuple(total // known if n == -1 else n for n in dims)
    if math.prod(dims) != total:
        _fail(f"cannot reshape a DTensor of shape {shape} into {dims}")
    return dims


def _dim_groups(old: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[list, list]]:
    """The dimensions of ``old`` and ``new`` (of one nonzero number of elements) in groups of
    neighbours with equal products: ``(old dims, new dims)``. A dimension of size 1 on one side
    only is a group of its own, with no partner."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        if i < len(old) and old[i] == 1 and (j == len(new) or new[j] != 1):
            groups.append(([i], []))
            i += 1
        elif j < len(new) and new[j] == 1 and (i == len(old) or old[i] != 1):
            groups.append(([], [j]))
            j += 1
        else:
            a, b, pa, pb = [i], [j], old[i], new[j]
            i, j = i + 1, j + 1
            while pa != pb:
                if pa < pb:
                    a.append(i)
                    pa, i = pa * old[i], i + 1
                else:
                    b.append(j)
                    pb, j = pb * new[j], j + 1
            groups.append((a, b))
    return groups


def reshape(x: DTensor, shape: Any, what: str = "reshape") -> DTensor:
    """The global array in ``shape`` (numpy's ``reshape``, torch's ``view``; -1 is inferred).
    Neighbouring dimensions that merge or split form groups; a ``Shard`` of the first
    dimension of its group moves to the group's first new dimension, when every rank's piece
    is whole rows of it (its elements in the group divide by the rest of the new group). Any
    other sharded reshape would need data from other ranks: refused, naming the redistribute.
    Replicate and Partial pass through. The new piece is a copy (each DTensor owns its piece)."""
    new = _target_shape(x.shape, shape)
    placements, sizes = list(x.placements), list(x.layout.sizes)
    shards = [(m, p) for m, p in enumerate(x.placements) if isinstance(p, Shard)]
    groups = _dim_groups(x.shape, new) if shards and math.prod(new) else []
    for m, p in shards:
        held = x.layout.sizes[m]
        group = next((g for g in groups if p.dim in g[0]), None)
        if group is None or not group[1] or group[0][0] != p.dim:
            moved = None
        else:
            (first, *rest_old), (target, *rest_new) = group
            inner_old = math.prod(x.shape[d] for d in rest_old)
            inner_new = math.prod(new[d] for d in rest_new)
            moved = [n * inner_old // inner_new for n in held if n * inner_old % inner_new == 0]
        if moved is None or len(moved) != len(held):
            _fail(
                f"{what} {x.shape} -> {new} of {p!r} on mesh dimension {m}: the pieces "
                f"({list(held)} along dimension {p.dim}) are not whole rows of any dimension "
                f"of the result; redistribute mesh dimension {m} to Replicate first, or shard "
                "the first dimension of those that merge"
            )
        placements[m], sizes[m] = Shard(target), tuple(moved)
    layout = Layout(new, tuple(placements), tuple(sizes))
    local = x.to_local().reshape(layout.local_shape(x.device_mesh.coordinate)).copy()
    return DTensor(local, x.device_mesh, layout)


def flatten(x: DTensor, start_dim: Any = 0, end_dim: Any = -1) -> DTensor:
    """Dimensions ``start_dim`` to ``end_dim`` merged into one (torch's ``flatten``; by
    default all, numpy's ``flatten``); a 0-d DTensor becomes one element, as in both. A
    ``Shard`` outside the range moves with its dimension; one of the range's first dimension
    (or of a later one, after dimensions of size one) becomes the merged dimension's, its sizes
    times the elements after it in the range; of an array with no element, any shard in the
    range does, with array_split's sizes; any other is refused, naming the redistribute.
    Nothing is sent."""
    n, shape = x.ndim, x.shape
    span = builtins.max(n, 1)  # torch: a 0-d tensor's dimension is 0 or -1
    for given in (start_dim, end_dim):
        if not _is_integer(given) or not -span <= given < span:
            _fail(
                f"flatten of a {n}-d DTensor takes dimensions in [{-span}, {span - 1}], "
                f"got {given!r}"
            )
    if n == 0:
        new, placements, sizes = (1,), x.placements, x.layout.sizes
    else:
        start, end = operator.index(start_dim) % n, operator.index(end_dim) % n
        if start > end:
            _fail(
                f"flatten of a {n}-d DTensor from dimension {start_dim} to {end_dim}: start "
                "after end"
            )
        new = (*shape[:start], math.prod(shape[start : end + 1]), *shape[end + 1 :])
        placements, sizes = list(x.placements), list(x.layout.sizes)
        merged_by = None  # the mesh dimension that shards the merged dimension
        for m, p in enumerate(x.placements):
            if not isinstance(p, Shard) or p.dim < start:
                continue
            if p.dim > end:
                placements[m] = Shard(p.dim - (end - start))
                continue
            if merged_by is not None:  # a dimension is sharded by one mesh dimension only
                _fail(
                    f"flatten {shape} -> {new} of {p!r} on mesh dimension {m}: mesh dimension "
                    f"{merged_by} shards the merged dimension already; redistribute mesh "
                    f"dimension {m} to Replicate first"
                )
            merged_by = m
            if math.prod(shape[start : p.dim]) == 1:
                inner = math.prod(shape[p.dim + 1 : end + 1])
                placements[m], sizes[m] = Shard(start), tuple(k * inner for k in sizes[m])
            elif 0 in shape:  # every piece is empty: array_split's sizes hold them too
                placements[m], sizes[m] = Shard(start), split_sizes(new[start], len(sizes[m]))
            else:
                _fail(
                    f"flatten {shape} -> {new} of {p!r} on mesh dimension {m}: the pieces of "
                    f"dimension {p.dim} are not whole rows of the merged dimension; redistribute "
                    f"mesh dimension {m} to Replicate first, or shard dimension {start}"
                )
    layout = Layout(new, tuple(placements), tuple(sizes))
    local = x.to_local().reshape(layout.local_shape(x.device_mesh.coordinate)).copy()
    return DTensor(local, x.device_mesh, layout)


def squeeze(x: DTensor, axis: Any = None) -> DTensor:
    """numpy's ``squeeze``: the dimensions of size one (or those of ``axis``, each of which
    must be of size one) dropped, each ``Shard`` moving with its dimension; a shard of a
    dropped dimension (one rank holds its one row) is refused. Nothing is sent."""
    if axis is None:
        dropped = [d for d, size in enumerate(x.shape) if size == 1]
    elif x.ndim == 0 and _is_integer(axis) and axis in (0, -1):
        dropped = []  # numpy takes axis 0 (or -1) of a 0-d array
    else:
        dropped = list(_axes(axis, x.ndim))
        wide = [d for d in dropped if x.shape[d] != 1]
        if wide:
            _fail(
                f"squeeze of dimension {wide[0]} of a DTensor of shape {x.shape}: only a "
                "dimension of size one can be squeezed out"
            )
    placements = []
    for m, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim in dropped:
            _fail(
                f"squeeze of dimension {p.dim}, which mesh dimension {m} shards ({p!r}: one "
                f"rank holds its row); redistribute mesh dimension {m} to Replicate first"
            )
        if isinstance(p, Shard):
            p = Shard(p.dim - builtins.sum(d < p.dim for d in dropped))
        placements.append(p)
    shape = tuple(size for d, size in enumerate(x.shape) if d not in dropped)
    local = x.to_local()
    kept = tuple(size for d, size in enumerate(local.shape) if d not in dropped)
    layout = Layout(shape, tuple(placements), x.layout.sizes)
    return DTensor(local.reshape(kept).copy(), x.device_mesh, layout)


def _inserted(placements: tuple[Placement, ...], places: list[int], ndim: int) -> tuple:
    """``placements`` of an ``ndim``-d array once dimensions are inserted at ``places`` (sorted
    positions in the result): each Shard moves with its own dimension."""
    kept = [d for d in range(ndim + len(places)) if d not in places]
    return tuple(Shard(kept[p.dim]) if isinstance(p, Shard) else p for p in placements)


def _expanded(x: DTensor, places: list[int]) -> DTensor:
    """``x`` with dimensions of size one at ``places`` (sorted positions in the result), in
    one copy of the piece. Nothing is sent."""
    shape, local_shape = list(x.shape), list(x.to_local().shape)
    for at in places:
        shape.insert(at, 1)
        local_shape.insert(at, 1)
    layout = Layout(tuple(shape), _inserted(x.placements, places, x.ndim), x.layout.sizes)
    return DTensor(x.to_local().reshape(local_shape).copy(), x.device_mesh, layout)


def unsqueeze(x: DTensor, dim: Any) -> DTensor:
    """torch's ``unsqueeze`` (numpy's ``expand_dims`` with one axis): a dimension of size one
    inserted at ``dim`` (-1 appends), each ``Shard`` moving with its dimension. Nothing is
    sent."""
    n = x.ndim
    if not _is_integer(dim) or not -n - 1 <= dim <= n:
        _fail(f"unsqueeze of a {n}-d DTensor takes a dimension in [{-n - 1}, {n}], got {dim!r}")
    return _expanded(x, [operator.index(dim) % (n + 1)])


def _dtensors(what: str, arrays: Any) -> list[DTensor]:
    """``arrays``, a non-empty sequence of DTensors, as a list."""
    try:
        items = list(arrays)
    except TypeError:
        items = None
    if not items or not all(isinstance(a, DTensor) for a in items):
        _fail(f"{what} takes a non-empty sequence of DTensors (of one layout but along the axis)")
    return items


def _joinable(what: str, items: list[DTensor], axis: int | None) -> list[DTensor]:
    """``items``, when they join locally: one mesh, the same placements and number of
    dimensions (and one dtype where terms are Partial), equal shapes and shard sizes but along
    ``axis`` (None: everywhere), and no shard of ``axis`` itself."""
    first = items[0]
    for k, other in enumerate(items[1:], 1):
        _same_mesh(first, other, what)
        if other.ndim != first.ndim or other.placements != first.placements:
            _fail(
                f"{what} of DTensors with placements {list(first.placements)} ({first.ndim}-d) "
                f"and {list(other.placements)} ({other.ndim}-d, array {k}): give every array "
                "the same placements and number of dimensions"
            )
        if any(isinstance(p, Partial) for p in first.placements) and other.dtype != first.dtype:
            _fail(
                f"{what} of Partial terms of {first.dtype} and {other.dtype} (array {k}): the "
                "terms cast one by one may not reduce to the value cast; cast them first"
            )
        for d, (n, m) in enumerate(zip(first.shape, other.shape, strict=True)):
            if n != m and d != axis:
                _fail(
                    f"{what} of DTensors of shapes {first.shape} and {other.shape} (array {k}): "
                    f"they differ in dimension {d}"
                    + ("" if axis is None else f", not only along axis {axis}")
                )
    for m, p in enumerate(first.placements):
        if not isinstance(p, Shard):
            continue
        if p.dim == axis:
            _fail(
                f"{what} along dimension {axis}, which mesh dimension {m} shards ({p!r}): each "
                "rank's rows of the result would come from several places; redistribute mesh "
                f"dimension {m} to Replicate first"
            )
        for k, other in enumerate(items[1:], 1):
            if other.layout.sizes[m] != first.layout.sizes[m]:
                _fail(
                    f"{what}: mesh dimension {m} shards with sizes {first.layout.sizes[m]} and "
                    f"{other.layout.sizes[m]} (array {k}); redistribute one to the other's layout"
                )
    return items


def _numpy_defaults(what: str, out: Any, dtype: Any, casting: Any) -> None:
    """Refuse ``out=``, ``dtype=`` and ``casting=`` other than numpy's defaults."""
    if out is not None or dtype is not None or casting != "same_kind":
        _fail(f"{what} of DTensors takes no out=, dtype= or casting=; cast the result")


def concatenate(
    arrays: Any, axis: Any = 0, out: Any = None, *, dtype: Any = None, casting: Any = "same_kind"
) -> DTensor:
    """numpy's ``concatenate`` (torch's ``cat``) of DTensors, each piece joined with the same
    ranks' pieces of the others: along a dimension no mesh dimension shards. ``axis=None``
    joins the flattened arrays, by :func:`flatten`'s rules."""
    _numpy_defaults("concatenate", out, dtype, casting)
    items = _dtensors("concatenate", arrays)
    if axis is None:
        items, axis = [flatten(a) for a in items], 0
    n = items[0].ndim
    if not n:
        _fail("concatenate of 0-d DTensors: numpy refuses 0-d arrays too; stack them")
    if not _is_integer(axis) or not -n <= axis < n:
        _fail(f"concatenate of {n}-d DTensors takes an axis in [{-n}, {n - 1}], got {axis!r}")
    axis = operator.index(axis) % n
    items = _joinable("concatenate", items, axis)
    first, locals_ = items[0], [a.to_local() for a in items]
    shape = list(first.shape)
    shape[axis] = builtins.sum(a.shape[axis] for a in items)
    layout = Layout(tuple(shape), first.placements, first.layout.sizes)
    joined = array_namespace(locals_[0]).concatenate(locals_, axis=axis)
    return DTensor(joined, first.device_mesh, layout)


def stack(
    arrays: Any, axis: Any = 0, out: Any = None, *, dtype: Any = None, casting: Any = "same_kind"
) -> DTensor:
    """numpy's ``stack`` of DTensors of one shape and layout: a new dimension ``axis``, each
    ``Shard`` moving with its dimension."""
    _numpy_defaults("stack", out, dtype, casting)
    items = _joinable("stack", _dtensors("stack", arrays), None)
    first, n = items[0], items[0].ndim
    if not _is_integer(axis) or not -n - 1 <= axis <= n:
        _fail(f"stack of {n}-d DTensors takes an axis in [{-n - 1}, {n}], got {axis!r}")
    at = operator.index(axis) % (n + 1)
    shape = (*first.shape[:at], len(items), *first.shape[at:])
    layout = Layout(shape, _inserted(first.placements, [at], n), first.layout.sizes)
    locals_ = [a.to_local() for a in items]
    stacked = array_namespace(locals_[0]).stack(locals_, axis=at)
    return DTensor(stacked, first.device_mesh, layout)


def expand_dims(x: DTensor, axis: Any) -> DTensor:
    """numpy's ``expand_dims``: dimensions of size one at the places ``axis`` names in the
    result, each ``Shard`` moving with its dimension."""
    if not isinstance(x, DTensor):
        _fail("expand_dims takes a DTensor")
    given = tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)
    n = x.ndim + len(given)
    if not all(_is_integer(a) and -n <= a < n for a in given):
        _fail(f"expand_dims of a {x.ndim}-d DTensor: axis {axis!r} is not in [{-n}, {n - 1}]")
    places = sorted(operator.index(a) % n for a in given)
    if len(set(places)) != len(places):
        _fail(f"expand_dims of a DTensor: axis {axis!r} repeats an axis (numpy refuses it too)")
    return _expanded(x, places)  # a copy when no place is given, as every shape operation


def _basic_index(index: Any, shape: tuple[int, ...]) -> list[tuple[str, Any]]:
    """numpy's basic index as one entry per dimension of the result or of ``shape``: ``("new",
    None)`` for a ``None``, ``("int", i)`` (non-negative) and ``("slice", range)`` for the
    dimension they index; dimensions past the index are whole slices."""
    items = index if isinstance(index, tuple) else (index,)
    if builtins.sum(item is Ellipsis for item in items) > 1:
        raise IndexError(f"rank {_rank()}: an index can only have a single ellipsis")
    for item in items:
        if item is None or item is Ellipsis or isinstance(item, slice):
            continue
        if not _is_integer(item):
            raise TypeError(
                f"rank {_rank()}: a DTensor takes basic indices (integers, slices, None, ...); "
                f"got {type(item).__name__}: index x.full_tensor() or x.to_local() for advanced "
                "indexing"
            )
    used = builtins.sum(item is not None and item is not Ellipsis for item in items)
    if used > len(shape):
        raise IndexError(
            f"rank {_rank()}: too many indices for a {len(shape)}-d DTensor: {used} were indexed"
        )
    k = next((k for k, item in enumerate(items) if item is Ellipsis), None)
    if k is not None:  # by identity: == on an index item may be elementwise
        items = (*items[:k], *(slice(None),) * (len(shape) - used), *items[k + 1 :])
    else:
        items = (*items, *(slice(None),) * (len(shape) - used))
    out, d = [], 0
    for item in items:
        if item is None:
            out.append(("new", None))
            continue
        n = shape[d]
        if isinstance(item, slice):
            try:
                out.append(("slice", range(*item.indices(n))))
            except (TypeError, ValueError) as e:  # bounds that are not integers, a step of 0
                raise type(e)(f"rank {_rank()}: {e}") from None
        else:
            i = operator.index(item)
            if not -n <= i < n:
                raise IndexError(
                    f"rank {_rank()}: index {i} is out of bounds for dimension {d} of size {n}"
                )
            out.append(("int", i % n))
        d += 1
    return out


def _is_integer(item: Any) -> bool:
    """An integer index: Python's or numpy's integers, or a 0-d integer array; not a bool
    (numpy's ``x[True]`` adds a dimension) and not an array of one or more dimensions (an
    advanced index, though numpy arrays have ``__index__``)."""
    if isinstance(item, (bool, np.bool_)) or getattr(item, "ndim", 0) != 0:
        return False
    try:
        operator.index(item)  # a 0-d bool array raises here too
    except TypeError:
        return False
    return True


def getitem(x: DTensor, index: Any) -> DTensor:
    """numpy's basic indexing (``x[2:7]``, ``x[:, 0]``, ``x[..., None]``), without
    communicating. Unsharded dimensions are indexed in every piece. A sharded dimension takes
    slices of positive step: each rank keeps the part of its range the slice selects, and the
    new layout records those sizes (uneven, zero included). An integer or a negative step on a
    sharded dimension is refused, naming the redistribute: the result would lie on one rank,
    or in the reverse order of the mesh. Replicate and Partial pass through."""
    layout, local_index = _indexed(x, index)
    # a copy: a view would share the piece (each DTensor owns its own) and may be strided
    piece = x.to_local()[local_index].copy()
    return DTensor(piece, x.device_mesh, layout)


def setitem(x: DTensor, index: Any, value: Any) -> None:
    """``x[index] = value`` in every rank's piece, without communicating. ``value`` is a
    DTensor laid out as ``x[index]`` is (its pieces are written), or the value of the whole
    selection, alike on every rank (a scalar, or an array that broadcasts to it; each rank
    writes its part, and the terms of a ``Partial("sum")`` off the first rank get zeros)."""
    layout, local_index = _indexed(x, index)
    mesh = x.device_mesh
    if isinstance(value, DTensor):
        _same_mesh(x, value, "setitem")
        if value.layout is not layout:
            _fail(
                f"setitem of a DTensor laid out as {value.layout!r} into x[{index!r}], laid out "
                f"as {layout!r}: give a DTensor of that layout, or the whole value (the same "
                "array on every rank)"
            )
        terms, dtype = value.to_local(), x.to_local().dtype
        if terms.dtype != dtype:  # each term cast apart is not the value cast
            for m, p in enumerate(layout.placements):
                if isinstance(p, Partial) and p.op in _LINEAR:
                    _fail(
                        f"setitem of {terms.dtype} terms of {p!r} (mesh dimension {m}) into a "
                        f"{dtype} DTensor: each term would be cast apart, which is not the value "
                        f"cast; give {dtype} terms, or redistribute to Replicate first"
                    )
        x.local_to_write()[local_index] = terms
        return
    # checked on every rank before any writes (a Partial("sum") term off the first rank
    # writes zeros, but checks the value as the others do)
    xp = array_namespace(x.to_local())
    dtype = x.to_local().dtype
    part = _host_scalar(value)
    if part is not _NOT_A_SCALAR:
        # numpy's conversion of the scalar (300 into uint8, nan into int64 raise) on every
        # rank, the zero-writing ones included, before any writes
        try:
            np.empty((), np.dtype(dtype))[()] = part
        except (TypeError, ValueError, OverflowError) as e:
            _fail(f"setitem: {type(e).__name__}: {e}")
    else:
        if not hasattr(value, "shape"):  # a list, a tuple: numpy's reading of it
            value = np.asarray(value)
        if np.dtype(value.dtype).kind in "OSUMm":  # a cast that can fail: tried on the whole
            try:  # value on every rank (a rank's part may be empty, or not written)
                value.astype(dtype)
            except (TypeError, ValueError, OverflowError) as e:
                _fail(f"setitem: {type(e).__name__}: {e}")
        try:
            whole = array_namespace(value).broadcast_to(value, layout.shape)
        except ValueError:
            _fail(
                f"setitem: a value of shape {tuple(value.shape)} does not broadcast to the "
                f"shape {layout.shape} of x[{index!r}]"
            )
        try:  # a numpy value for cupy pieces is copied to the device
            part = xp.asarray(whole[layout.local_slices(mesh.coordinate)])
        except TypeError:
            _fail(
                f"setitem: a {type(value).__name__} value for {xp.__name__} pieces; give the "
                "value in the pieces' array library"
            )
    x.local_to_write()[local_index] = 0 if layout.zero_term(mesh.coordinate) else part


def _indexed(x: DTensor, index: Any) -> tuple[Layout, tuple]:
    """The layout of ``x[index]`` and the index of its part in this rank's piece."""
    entries = _basic_index(index, x.shape)
    chosen = [value for kind, value in entries if kind != "new"]  # per dimension of x
    kept_at, d, j = {}, 0, 0  # a sliced dimension of x -> its dimension in the result
    for kind, _ in entries:
        if kind == "slice":
            kept_at[d] = j
        d += kind != "new"
        j += kind != "int"
    coordinate = x.device_mesh.coordinate
    placements, sizes, local = list(x.placements), list(x.layout.sizes), list(chosen)
    for m, p in enumerate(x.placements):
        if not isinstance(p, Shard):
            continue
        picked = chosen[p.dim]
        if isinstance(picked, int) or picked.step < 0:
            what = f"the integer {picked}" if isinstance(picked, int) else "a negative step"
            _fail(
                f"indexing dimension {p.dim}, sharded by mesh dimension {m}, with {what}: the "
                f"result would not be a layout of the mesh; redistribute mesh dimension {m} to "
                "Replicate first (or take a slice of positive step)"
            )
        start, kept = 0, []
        for k, n in enumerate(x.layout.sizes[m]):
            part = _within(picked, start, start + n)
            kept.append(len(part))
            if k == coordinate[m]:  # in this rank's piece's own indices
                local[p.dim] = range(part.start - start, part.stop - start, part.step)
            start += n
        placements[m], sizes[m] = Shard(kept_at[p.dim]), tuple(kept)
    local_index, d = [], 0
    for kind, _ in entries:
        if kind == "new":
            local_index.append(None)
            continue
        value = local[d]
        local_index.append(value if isinstance(value, int) else _as_slice(value))
        d += 1
    shape = tuple(1 if kind == "new" else len(v) for kind, v in entries if kind != "int")
    return Layout(shape, tuple(placements), tuple(sizes)), tuple(local_index)


def _within(r: range, lo: int, hi: int) -> range:
    """The part of ``r`` (a positive step) with values in [lo, hi)."""

    def before(v: int) -> int:  # how many values of r are below v
        return len(range(r.start, builtins.max(r.start, builtins.min(v, r.stop)), r.step))

    return r[before(lo) : before(hi)]


def _as_slice(r: range) -> slice:
    """The slice that selects ``r``: an empty one selects nothing whatever its bounds, and a
    negative step's stop below 0 means "to the start"."""
    if not r:
        return slice(0, 0)
    return slice(r.start, r.stop if r.stop >= 0 else None, r.step)


# -- reductions ------------------------------------------------------------------------------


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    try:
        axes = (operator.index(axis),)
    except TypeError:
        axes = tuple(operator.index(a) for a in axis)
    for a in axes:
        if not -ndim <= a < ndim:
            _fail(f"axis {a} does not exist in a {ndim}-d DTensor")
    if len({a % ndim for a in axes}) != len(axes):
        _fail(f"axis {axis} repeats an axis (numpy refuses it too)")
    return tuple(sorted(a % ndim for a in axes))


def _sum_dtype(dtype: Any) -> Any:
    """The dtype a sum accumulates in: numpy's (None), except unsigned integers, which numpy
    sums as uint64 (no collective carries it) and which sum here as int64 (the same bits)."""
    return np.int64 if np.dtype(dtype).kind == "u" else None


def _reduce(name: str, x: DTensor, axis: Any, keepdims: bool, options: dict) -> DTensor:
    given = [f"{key}=" for key, value in options.items() if value is not None]
    if given:  # numpy's np.sum(x) passes dtype=None, out=None
        _fail(f"{name} of a DTensor takes no {', '.join(given)}; apply it to the result")
    axes = _axes(axis, x.ndim)
    if name in ("max", "min") and any(x.shape[a] == 0 for a in axes):
        _fail(f"{name} over an axis of size 0 (shape {x.shape}) has no identity, as in numpy")
    partial_op = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}[name]
    placements: list[Placement] = []
    sizes = list(x.layout.sizes)
    reduced_sharded = False
    for m, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim in axes:
            placements.append(Partial(partial_op))
            sizes[m] = None
            reduced_sharded = True
        elif isinstance(p, Shard):
            dim = p.dim if keepdims else p.dim - builtins.sum(1 for a in axes if a < p.dim)
            placements.append(Shard(dim))
        elif isinstance(p, Partial):
            if (name in ("sum", "mean") and p.op in _LINEAR) or p.op == name:
                if name in ("sum", "mean"):
                    one = np.zeros(1, x.dtype)  # the reduction's dtype, from numpy's rule
                    made = np.sum(one, dtype=_sum_dtype(x.dtype)) if name == "sum" else np.mean(one)
                    _refuse_widened(p, m, x.dtype, made.dtype, name)
                placements.append(p)
            else:
                _fail(
                    f"{name} of {p!r} on mesh dimension {m} is not the {p.op} of the terms' "
                    f"{name}s; redistribute to Replicate first"
                )
        else:
            placements.append(p)
    local = x.to_local()
    xp = array_namespace(local)
    if name == "sum":
        out = xp.sum(local, axis=axes, keepdims=keepdims, dtype=_sum_dtype(local.dtype))
    elif name == "mean" and reduced_sharded:  # each term: the piece's sum over the whole count
        count = int(np.prod([x.shape[a] for a in axes]))
        narrow = _is_float(local.dtype) and np.dtype(local.dtype).itemsize < 4
        # numpy sums half-precision in float32 for a mean; so does each term
        out = xp.sum(local, axis=axes, keepdims=keepdims, dtype=np.float32 if narrow else None)
        out = out / count
        if narrow:
            out = out.astype(local.dtype)
    elif name == "mean":
        out = xp.mean(local, axis=axes, keepdims=keepdims)
    else:
        dtype = np.dtype(local.dtype)
        if dtype.kind == "b":
            identity = name == "min"  # False for max, True for min
        elif _is_float(dtype):
            identity = -np.inf if name == "max" else np.inf
        else:
            identity = np.iinfo(dtype).min if name == "max" else np.iinfo(dtype).max
        if any(local.shape[a] == 0 for a in axes):  # an empty piece of an uneven shard
            kept = [1 if d in axes else n for d, n in enumerate(local.shape)]
            out = xp.full(kept, identity, dtype=local.dtype)
            if not keepdims:
                out = out.reshape([n for d, n in enumerate(kept) if d not in axes])
        else:
            out = getattr(xp, name)(local, axis=axes, keepdims=keepdims)
    shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape) if keepdims or d not in axes)
    # max and min keep the dtype; sum and mean take numpy's (bool and small ints sum as int)
    out = xp.asarray(out, dtype=local.dtype if name in ("max", "min") else None)
    return DTensor(out, x.device_mesh, Layout(shape, tuple(placements), tuple(sizes)))


def sum(x: DTensor, axis=None, keepdims: bool = False, **numpy_options) -> DTensor:  # noqa: A001
    return _reduce("sum", x, axis, keepdims, numpy_options)


def mean(x: DTensor, axis=None, keepdims: bool = False, **numpy_options) -> DTensor:
    return _reduce("mean", x, axis, keepdims, numpy_options)


def max(x: DTensor, axis=None, keepdims: bool = False, **numpy_options) -> DTensor:  # noqa: A001
    return _reduce("max", x, axis, keepdims, numpy_options)


def min(x: DTensor, axis=None, keepdims: bool = False, **numpy_options) -> DTensor:  # noqa: A001
    return _reduce("min", x, axis, keepdims, numpy_options)


# -- matmul ----------------------------------------------------------------------------------


def matmul(a: DTensor, b: DTensor) -> DTensor:
    """``a @ b`` for ``a`` of shape (..., m, k) and a 2-d ``b`` (k, n), with the sharding rules
    of tensor parallelism: ``Shard(-1) @ Shard(0)`` gives ``Partial()`` (row-parallel),
    ``Replicate() @ Shard(1)`` gives ``Shard(-1)`` (column-parallel), a sharded batch or row
    dimension of ``a`` passes through a replicated ``b``, and a linear Partial passes through
    a replicated other operand."""
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        _fail("matmul takes two DTensors")
    _same_mesh(a, b, "matmul")
    if a.ndim < 2 or b.ndim != 2 or a.shape[-1] != b.shape[0]:
        _fail(f"matmul of shapes {a.shape} and {b.shape}: expected (..., m, k) @ (k, n)")
    k = a.ndim - 1
    shape = a.shape[:-1] + (b.shape[1],)
    placements: list[Placement] = []
    sizes: list[Any] = []
    for m, (pa, pb) in enumerate(zip(a.placements, b.placements, strict=True)):
        sa, sb = a.layout.sizes[m], b.layout.sizes[m]
        if isinstance(pa, Replicate) and isinstance(pb, Replicate):
            placements.append(pa), sizes.append(None)
        elif pa == Shard(k) and pb == Shard(0):
            if sa != sb:
                _fail(
                    f"matmul: mesh dimension {m} shards the contracted dimension with sizes {sa} "
                    f"and {sb}; they must match"
                )
            placements.append(Partial()), sizes.append(None)
        elif isinstance(pa, Replicate) and pb == Shard(1):
            placements.append(Shard(len(shape) - 1)), sizes.append(sb)
        elif isinstance(pa, Shard) and pa.dim < k and isinstance(pb, Replicate):
            placements.append(pa), sizes.append(sa)
        elif isinstance(pa, Partial) and pa.op in _LINEAR and isinstance(pb, Replicate):
            placements.append(pa), sizes.append(None)
        elif isinstance(pa, Replicate) and isinstance(pb, Partial) and pb.op in _LINEAR:
            placements.append(pb), sizes.append(None)
        else:
            _fail(
                f"matmul of {pa!r} @ {pb!r} on mesh dimension {m} has no local rule; "
                "redistribute one operand (to Replicate, or the contracted dimensions to Shard "
                "on both) first"
            )
    la, lb = a.to_local(), b.to_local()
    if any(isinstance(p, Partial) for p in (*a.placements, *b.placements)):
        # the product's dtype from host arrays of no elements, before any arithmetic
        result = (np.empty((0, 0), la.dtype) @ np.empty((0, 0), lb.dtype)).dtype
        for m, (pa, pb) in enumerate(zip(a.placements, b.placements, strict=True)):
            for p, operand in ((pa, la), (pb, lb)):
                if isinstance(p, Partial):
                    _refuse_widened(p, m, operand.dtype, result, "matmul")
    out = la @ lb
    return DTensor(out, a.device_mesh, Layout(shape, tuple(placements), tuple(sizes)))


# -- numpy's ufuncs --------------------------------------------------------------------------


#: numpy's ufuncs with a placement rule of their own; any other unary one is ``elementwise``
_UFUNC_RULES = {np.add: add, np.subtract: sub, np.multiply: mul, np.true_divide: div,
                np.negative: neg, np.power: power, np.matmul: matmul}  # fmt: skip


def _resize(*args: Any, **kwargs: Any) -> DTensor:
    # numpy's own resize would ravel, concatenate and slice the DTensor, then read x.size
    raise TypeError(
        f"rank {_rank()}: np.resize of a DTensor has no rule; use x.full_tensor() for the whole "
        "array, or x.to_local() for this rank's piece"
    )


#: numpy's functions with a rule for DTensors (``DTensor.__array_function__``)
_FUNCTIONS = {
    np.concatenate: concatenate,
    np.stack: stack,
    np.expand_dims: expand_dims,
    np.ravel: lambda a, order="C": a.ravel(order),
    np.resize: _resize,
}


def array_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """A numpy function called with DTensors: its rule here, or else what numpy does without
    the protocol (which calls the DTensor's method where numpy has one, as ``np.reshape``,
    ``np.sum`` and ``np.transpose`` do, and otherwise refuses through ``__array__``). A
    function with no such code (``like=`` passes the public one) is numpy's to refuse."""
    rule = _FUNCTIONS.get(func)
    if rule is not None:
        return rule(*args, **kwargs)
    plain = getattr(func, "_implementation", None)
    if plain is None:
        return NotImplemented
    return plain(*args, **kwargs)


def array_ufunc(ufunc: np.ufunc, method: str, inputs: tuple, kwargs: dict) -> DTensor:
    """A numpy ufunc called on DTensors (``np.exp(x)``, ``np.float32(2) * x``, ``x + a
    numpy scalar``, ``np.maximum(x, 0)``), by the rules above; anything else is refused, not
    run on the pieces."""
    rule = _UFUNC_RULES.get(ufunc)
    # a generalized ufunc (np.vecdot: its core dimensions change the shape) only by its rule
    if method == "__call__" and not kwargs and (rule is not None or ufunc.signature is None):
        if rule is not None and len(inputs) == ufunc.nin:
            return rule(*inputs)
        if ufunc.nin == 1 and ufunc.nout == 1:
            return elementwise(ufunc, inputs[0])
        if ufunc.nin == 2 and ufunc.nout == 1 and len(inputs) == 2:
            # np.maximum(x, 0), np.greater(x, y): elementwise on equal layouts or with a
            # scalar; no Partial (the rule of a sum or a max is the operator's own)
            return _binary(ufunc.__name__, *inputs, ufunc)
    raise TypeError(
        f"rank {_rank()}: numpy's {ufunc.__name__}"
        f"{'' if method == '__call__' else '.' + method} on a DTensor has no placement rule"
        f"{' with ' + ', '.join(kwargs) if kwargs else ''}; DTensors take unary and binary "
        "elementwise ufuncs and + - * / ** with their rules. Use x.to_local() for this rank's "
        "piece or x.full_tensor() for the whole array"
    )
