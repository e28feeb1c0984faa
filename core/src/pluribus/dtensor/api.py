"""DTensor: a global array held as one local piece per rank, with a layout that says which.

Only ``redistribute`` (and ``from_local``'s check) communicates; everything else is local.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import distributed as dist
from ..arrays import device_of
from ..mesh import DeviceMesh
from ..nn.module import array_namespace
from .layout import Layout, default_layout, normalize_placements
from .placements import Placement, Replicate, Shard
from .plan import DEFAULT_COST, CostModel, Plan, make_plan
from .redistribute import Run, compile_plan

_new = object.__new__


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class DTensor:
    """A global ``shape``-d array distributed over ``device_mesh`` by ``placements``."""

    __slots__ = ("_local", "_mesh", "_layout", "_pending", "_readers", "__weakref__")

    def __init__(self, local: Any, mesh: DeviceMesh, layout: Layout, _pending=None):
        # Every piece is C-contiguous (a strided one, such as a transpose's, is copied here),
        # so that each rank can hand its piece to any collective as it is: a rank whose piece
        # a collective refused would leave the others waiting in it.
        if isinstance(local, np.generic):  # numpy's 0-d results are scalars; a piece is an array
            local = np.asarray(local)
        elif local is not None and not local.flags.c_contiguous:
            local = array_namespace(local).ascontiguousarray(local)
        self._local = local
        self._mesh = mesh
        self._layout = layout
        self._pending = _pending
        # works of asynchronous redistributes that may still read the piece: a donation of this
        # DTensor, or a load into it (local_to_write), waits for them
        self._readers: list | None = None

    # -- what it is -------------------------------------------------------------------------

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._layout.placements

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def shape(self) -> tuple[int, ...]:
        return self._layout.shape

    @property
    def ndim(self) -> int:
        return len(self._layout.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        """Elements of the whole array."""
        return int(np.prod(self._layout.shape))

    def __len__(self) -> int:
        if not self._layout.shape:
            raise TypeError(f"rank {_rank()}: len() of a 0-d DTensor")
        return self._layout.shape[0]

    @property
    def dtype(self) -> Any:
        return self.to_local().dtype

    def __repr__(self) -> str:
        # not self.dtype, which waits for a pending piece and refuses a donated one
        if self._local is not None:
            dtype = self._local.dtype
        elif self._pending is not None:
            dtype = f"{self._pending[1].dtype} (pending)"
        else:
            dtype = "donated"
        return (
            f"DTensor(shape={self.shape}, placements={list(self.placements)}, "
            f"dtype={dtype}, mesh={self._mesh!r})"
        )

    # -- local and global values ------------------------------------------------------------

    def wait(self) -> DTensor:
        """Finish an ``async_op=True`` redistribute (any use of the local array also does)."""
        if self._pending is not None:
            work, out, post = self._pending
            work.wait()
            self._local = out if post is None else post(out)
            self._pending = None
        return self

    def to_local(self) -> Any:
        """This rank's piece (for ``Partial``, this rank's term)."""
        if self._pending is not None:
            self.wait()
        if self._local is None:
            raise ValueError(
                f"rank {_rank()}: this DTensor was given to redistribute(donate=True), which "
                "may have written over its piece; use the DTensor redistribute returned"
            )
        return self._local

    def __deepcopy__(self, memo: dict) -> DTensor:
        """A DTensor of its own: a copy of the piece (a pending one waited for) on the same mesh
        and layout, with no redistribute in flight (whose works hold locks that cannot be
        copied) and none reading it."""
        return DTensor(self.to_local().copy(), self._mesh, self._layout)

    def __copy__(self) -> DTensor:
        """As numpy's ``copy.copy`` of an array: the piece copied (two DTensors never share
        one, which a donation of either would write over)."""
        return self.__deepcopy__({})

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> Any:
        """The whole array on every rank (an all-gather or all-reduce per non-replicated mesh
        dimension). ``grad_placements`` is torch's autograd hint; DTensors here have no
        autograd, so only None is taken."""
        if grad_placements is not None:
            raise ValueError(
                f"rank {_rank()}: full_tensor(grad_placements=...) is an autograd hint; "
                "DTensors here carry no gradients (pluribus.nn layers take local arrays)"
            )
        return self.redistribute(placements=(Replicate(),) * self._mesh.ndim).to_local()

    # -- redistribute -----------------------------------------------------------------------

    def redistribute_plan(
        self,
        placements: Sequence[Placement],
        cost: CostModel | None = None,
        *,
        donate: bool = False,
    ) -> Plan:
        """What :meth:`redistribute` to ``placements`` (with the same ``donate``) will do: steps,
        the collectives each calls with their bytes, predicted time."""
        plan = self._planned(placements, donate)[1][0]
        if cost is not None and cost != DEFAULT_COST:
            plan = make_plan(
                plan.src, plan.dst, self._mesh.shape, self._mesh.coordinate,
                np.dtype(self.dtype).itemsize, cost, donate,
            )  # fmt: skip
        return plan

    def _planned(self, given: Sequence[Placement], donate: bool) -> tuple[tuple, list]:
        """The cache key of a redistribute to the placements ``given`` and its entry in the
        mesh's plan cache, ``[plan, run]``: ``run``, the compiled plan, is None until the first
        redistribute (compiling looks up the mesh's groups, which may create them, collectively;
        a plan alone must not communicate)."""
        mesh = self._mesh
        local = self.to_local()
        try:
            placements = tuple(given)
        except TypeError:  # the same on every rank: it depends on the arguments only
            raise TypeError(
                f"rank {_rank()}: placements {given!r} must be a sequence, one per mesh dimension"
            ) from None
        key = (self._layout, placements, type(local), local.dtype, donate)
        try:
            entry = mesh.plan_cache.get(key)
        except TypeError:  # an unhashable placement, which normalize_placements names
            entry = None
        if entry is None:
            targets = normalize_placements(placements, self.ndim, mesh.shape, _rank(), local.dtype)
            dst = default_layout(self.shape, targets, mesh.shape)
            itemsize = np.dtype(local.dtype).itemsize
            plan = make_plan(
                self._layout, dst, mesh.shape, mesh.coordinate, itemsize, DEFAULT_COST, donate
            )
            entry = mesh.plan_cache[key] = [plan, None]
        return key, entry

    def _runnable(self, given: Sequence[Placement], donate: bool) -> tuple[Plan, Run | None]:
        """The plan to the placements ``given`` and the function that runs it (compiled here the
        first time), remembered on this layout as its last redistribute, which a repeated
        :meth:`redistribute` checks first; None for a plan with no step."""
        key, entry = self._planned(given, donate)
        plan, run = entry
        if not plan.steps:  # nothing moves: redistribute hands back this DTensor
            return plan, None
        local = self._local
        if run is None:
            xp = np if type(local) is np.ndarray else array_namespace(local)
            run = entry[1] = compile_plan(self._mesh, plan, xp, local.dtype)
        # the placements as the caller spells them (a list is compared as a list, with no
        # tuple made per call)
        spelled = list(given) if type(given) is list else key[1]
        self._layout.last_redistribute = (
            self._mesh,
            spelled,
            type(local),
            local.dtype,
            donate,
            plan.dst,
            run,
        )
        return plan, run

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        donate: bool = False,
    ) -> DTensor:
        """The same global array with ``placements`` (array_split sizes), by the plan
        :meth:`redistribute_plan` shows. With ``async_op`` the last collective runs in the
        background; the result waits for it on first use. With ``donate`` (JAX's word) the
        collectives may work in this DTensor's piece instead of a copy (an all-reduce then
        costs exactly the hand-written one), and this DTensor can no longer be used, whatever
        the plan (as with JAX's donated buffers)."""
        # The repeated call, which users time against the collective by hand: the last
        # redistribute from this layout, when it was on this mesh, to the same placements, with
        # the same array type, dtype and donate; then the compiled plan and the result. One
        # slot read and identity checks (placements are interned): at 64 KiB every object
        # touched here is a cache miss after the collective's copies.
        local = self._local
        last = self._layout.last_redistribute
        if (
            last is not None
            and not async_op
            and device_mesh is None
            and last[0] is self._mesh
            and type(local) is last[2]
            and type(placements) is type(last[1])  # a list or tuple: == is element by element
            and last[1] == placements
            and local.dtype is last[3]
            and donate is last[4]
        ):
            if donate:
                if self._readers is not None:
                    self._wait_for_readers()
                piece = last[6](local, False)
                self._local = None
            else:
                piece = last[6](local, False)
            made = _new(DTensor)  # what __init__ does, without its Python frame
            made._local = piece
            made._mesh = self._mesh
            made._layout = last[5]
            made._pending = made._readers = None
            return made
        if device_mesh is not None and device_mesh is not self._mesh and device_mesh != self._mesh:
            if isinstance(device_mesh, (list, tuple)):
                raise TypeError(
                    f"rank {_rank()}: redistribute's first argument is the device mesh; pass "
                    f"the placements by name: redistribute(placements={list(device_mesh)!r})"
                )
            raise ValueError(
                f"rank {_rank()}: redistribute cannot move a DTensor to another mesh "
                f"({self._mesh!r} -> {device_mesh!r})"
            )
        if placements is None:
            raise ValueError(f"rank {_rank()}: redistribute needs placements=")
        if local is None:  # donated, or a pending redistribute's result (wait for it)
            local = self.to_local()
        plan, run = self._runnable(placements, donate)
        if run is None:
            return self._unmoved(local, donate)
        if donate and self._readers is not None:
            self._wait_for_readers()
        if not async_op:
            piece = run(local, False)
            if donate:
                self._local = None
            return DTensor(piece, self._mesh, plan.dst)
        work, out, post = run(local, True)
        if donate:
            self._local = None
        if work is None:
            return DTensor(out if post is None else post(out), self._mesh, plan.dst)
        if not donate:  # the collective may read this piece until it is done
            readers = [w for w in self._readers or () if not w.is_completed()]
            self._readers = [*readers, work]
        return DTensor(None, self._mesh, plan.dst, (work, out, post))

    def _wait_for_readers(self) -> None:
        """Before a donation writes the piece: finish the asynchronous redistributes that read
        it (they run on other groups, which nothing else orders after them)."""
        for work in self._readers:
            work.wait()
        self._readers = None

    def local_to_write(self) -> Any:
        """This rank's piece, for a caller about to write it in place (``checkpoint.load``):
        after the asynchronous redistributes that still read it have finished."""
        local = self.to_local()
        if self._readers is not None:
            self._wait_for_readers()
        return local

    def _unmoved(self, local: Any, donate: bool) -> DTensor:
        """A redistribute with nothing to do: this DTensor itself (torch's rule), not a second
        one on the same piece, which a later donation of either would write over. Donated, the
        piece moves to a new DTensor and this one can no longer be used, as for any plan."""
        if not donate:
            return self
        self._local = None
        moved = DTensor(local, self._mesh, self._layout)
        moved._readers, self._readers = self._readers, None
        return moved

    # -- operators (pluribus.dtensor.ops) ---------------------------------------------------

    def __add__(self, other):
        return _ops().add(self, other)

    def __radd__(self, other):
        return _ops().add(other, self)

    def __sub__(self, other):
        return _ops().sub(self, other)

    def __rsub__(self, other):
        return _ops().sub(other, self)

    def __mul__(self, other):
        return _ops().mul(self, other)

    def __rmul__(self, other):
        return _ops().mul(other, self)

    def __truediv__(self, other):
        return _ops().div(self, other)

    def __rtruediv__(self, other):
        return _ops().div(other, self)

    def __neg__(self):
        return _ops().neg(self)

    def __abs__(self):
        return _ops().elementwise(abs, self)

    def __pow__(self, exponent):
        return _ops().power(self, exponent)

    def __bool__(self):
        # numpy raises for an array of more than one element; without this, ``len`` would
        # make ``if x < 0:``, ``max(x, 0)`` and ``sorted`` silently take any nonempty DTensor
        # as true (its value is on other ranks: no local answer is the same everywhere)
        raise ValueError(
            f"rank {_rank()}: the truth value of a DTensor is ambiguous; use "
            "x.full_tensor().any() / .all(), or x.to_local() for this rank's piece"
        )

    # comparisons go through numpy's ufuncs and their rule (no __eq__: a DTensor stays
    # hashable, compared by identity)
    def __lt__(self, other):
        return np.less(self, other)

    def __le__(self, other):
        return np.less_equal(self, other)

    def __gt__(self, other):
        return np.greater(self, other)

    def __ge__(self, other):
        return np.greater_equal(self, other)

    def astype(self, dtype):
        """numpy's ``x.astype(dtype)``: every piece cast (a copy), where the cast keeps the
        value a Partial reduces to (:func:`ops.astype`)."""
        return _ops().astype(self, dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _ops().array_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return _ops().array_function(func, args, kwargs)

    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            f"rank {_rank()}: a DTensor is not one array on this rank; use x.full_tensor() for "
            "the whole array, or x.to_local() for this rank's piece"
        )

    def __matmul__(self, other):
        return _ops().matmul(self, other)

    def __rmatmul__(self, other):
        return _ops().matmul(other, self)

    def sum(self, axis=None, keepdims=False, **numpy_options):
        return _ops().sum(self, axis, keepdims, **numpy_options)

    def mean(self, axis=None, keepdims=False, **numpy_options):
        return _ops().mean(self, axis, keepdims, **numpy_options)

    def max(self, axis=None, keepdims=False, **numpy_options):
        return _ops().max(self, axis, keepdims, **numpy_options)

    def min(self, axis=None, keepdims=False, **numpy_options):
        return _ops().min(self, axis, keepdims, **numpy_options)

    @property
    def T(self):
        return _ops().transpose(self)

    def transpose(self, *axes):
        """numpy's ``x.transpose()``, ``x.transpose(1, 0, 2)`` or ``x.transpose((1, 0, 2))``;
        ``np.transpose`` and ``np.moveaxis`` call it (:func:`ops.transpose`)."""
        return _ops().transpose(self, axes)

    def swapaxes(self, axis1, axis2):
        """numpy's ``x.swapaxes(0, 1)`` (``np.swapaxes`` calls it), torch's two-dimension
        ``transpose``."""
        return _ops().swapaxes(self, axis1, axis2)

    def permute(self, *dims):
        """torch's ``x.permute(1, 0, 2)`` (or a tuple): the dimensions in that order."""
        return _ops().permute(self, _one_or_many(dims))

    def reshape(self, *shape, order="C"):
        """numpy's ``x.reshape(2, -1)`` (or a tuple; ``np.reshape(x, ...)`` calls it); torch's
        ``view``. A copy. Row-major order only: a DTensor's layout is row-major."""
        if order != "C":
            raise ValueError(f"rank {_rank()}: a DTensor reshapes in order 'C' only, got {order!r}")
        return _ops().reshape(self, _one_or_many(shape))

    view = reshape

    def flatten(self, start_dim=0, end_dim=-1, *, order="C"):
        """numpy's ``x.flatten()`` (order "C" only) or torch's ``x.flatten(start_dim,
        end_dim)``: the dimensions from ``start_dim`` to ``end_dim`` merged. A copy."""
        if isinstance(start_dim, str):  # numpy's flatten(order), given by position
            start_dim, order = 0, start_dim
        if order != "C":
            raise ValueError(f"rank {_rank()}: a DTensor flattens in order 'C' only, got {order!r}")
        return _ops().flatten(self, start_dim, end_dim)

    def ravel(self, order="C"):
        """numpy's ``x.ravel()``: the whole array as one dimension, a copy (a DTensor never
        shares its piece). Orders "K" and "A" read a C-ordered piece as "C" does."""
        return self.flatten(order="C" if order in ("K", "A") else order)

    def squeeze(self, axis=None):
        """numpy's ``x.squeeze(axis)`` (``np.squeeze`` calls it; torch's ``squeeze(dim)``
        takes a dimension of size one too, and leaves any other alone where this refuses)."""
        return _ops().squeeze(self, axis)

    def unsqueeze(self, dim):
        """torch's ``x.unsqueeze(dim)``: a dimension of size one inserted at ``dim``."""
        return _ops().unsqueeze(self, dim)

    def copy(self):
        """numpy's ``x.copy()``, torch's ``clone()``: the same layout, a piece of its own."""
        return self.__deepcopy__({})

    clone = copy

    def contiguous(self):
        """torch's ``x.contiguous()``: every piece is C-contiguous already, so ``x`` itself."""
        return self

    def __getitem__(self, index):
        """numpy's basic indexing, without communicating (:func:`ops.getitem`)."""
        return _ops().getitem(self, index)

    def __setitem__(self, index, value):
        """``x[index] = value`` in place, without communicating (:func:`ops.setitem`)."""
        _ops().setitem(self, index, value)

    def __iter__(self):
        """The rows ``x[0], x[1], ...`` (numpy's iteration); a 0-d DTensor is refused, as
        numpy refuses a 0-d array, instead of iterating zero times."""
        if not self._layout.shape:
            raise TypeError(f"rank {_rank()}: iteration over a 0-d DTensor")
        return (self[i] for i in range(self._layout.shape[0]))

    def __contains__(self, value):
        # without it, ``in`` would iterate the rows and compare each DTensor row by identity
        raise TypeError(
            f"rank {_rank()}: `in` of a DTensor; use x.full_tensor() or x.to_local() for that"
        )


def _one_or_many(args: tuple) -> Any:
    """torch's ``*dims``: integers, or one sequence of them."""
    return args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args


def _ops():
    from . import ops

    return ops


def distribute_tensor(
    tensor: Any,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = None,
) -> DTensor:
    """Cut ``tensor`` (the same whole array on every rank) into this rank's piece, a copy,
    without communicating. ``Partial("sum")`` keeps the value on the first rank of its mesh
    dimension and zeros elsewhere (exact); other Partial ops keep it everywhere.

    ``src_data_rank=k`` (torch's, whose default is 0) takes the array of the rank at mesh
    coordinate ``(k, ..., k)`` instead: one broadcast of the whole array per mesh dimension
    first (every rank passes an array of the same shape and dtype)."""
    mesh = device_mesh
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    targets = normalize_placements(placements, tensor.ndim, mesh.shape, _rank(), tensor.dtype)
    if src_data_rank is not None:
        tensor = _from_source(tensor, mesh, src_data_rank)
    layout = default_layout(tuple(tensor.shape), targets, mesh.shape)
    xp = array_namespace(tensor)
    piece = tensor[layout.local_slices(mesh.coordinate)]  # numpy: a 0-d array's is a scalar
    zero = layout.zero_term(mesh.coordinate)
    # a copy: the DTensor never sees later writes to ``tensor``, nor writes to it when donated
    local = xp.zeros(piece.shape, tensor.dtype) if zero else xp.array(piece)
    return DTensor(local, mesh, layout)


def _from_source(tensor: Any, mesh: DeviceMesh, given: int) -> Any:
    """A copy of the array at mesh coordinate ``(k, ..., k)``: broadcast along each mesh
    dimension in turn from the member at ``k`` (after dimension ``m``, every rank that agrees
    with the source on the later dimensions holds it; after the last, every rank)."""
    try:
        k = operator.index(given) if not isinstance(given, (bool, np.bool_)) else None
    except TypeError:
        k = None
    if k is None or not all(0 <= k < n for n in mesh.shape):
        raise ValueError(
            f"rank {_rank()}: src_data_rank={given!r} must be an index of every mesh dimension "
            f"(mesh shape {mesh.shape})"
        )
    copy = array_namespace(tensor).array(tensor)  # the caller's array stays as it was
    for m in range(mesh.ndim):
        source = list(mesh.coordinate)
        source[m] = k
        dist.broadcast(copy, src=int(mesh.mesh[tuple(source)]), group=mesh.get_group(m))
    return copy


def from_local(
    local: Any,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
    *,
    run_check: bool = True,
    shape: Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
) -> DTensor:
    """A DTensor from every rank's piece. With ``run_check`` (the default) the ranks of the mesh
    exchange their local shapes, dtypes and placements: shard sizes are taken from what the
    ranks hold (uneven allowed) and any disagreement raises on every rank, naming the ranks.
    Without it, pieces are assumed to follow the array_split rule over ``shape`` (or to be
    equal when ``shape`` is None), and only this rank's piece is checked. ``stride`` (torch's,
    in elements) can only be the C-contiguous one of ``shape``: every piece is C-contiguous."""
    mesh = device_mesh
    rank = _rank()
    if stride is not None:
        want = (
            None
            if shape is None
            else tuple(int(np.prod(shape[k + 1 :])) for k in range(len(shape)))
        )
        if want is None or tuple(stride) != want:
            raise ValueError(
                f"rank {rank}: from_local(stride={tuple(stride)}): a DTensor is C-contiguous, "
                f"so stride can only be {want} for shape={shape} (or leave it out)"
            )
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    if run_check:
        layout = _checked_layout(local, mesh, placements, shape)
    else:
        targets = normalize_placements(placements, local.ndim, mesh.shape, rank, local.dtype)
        if shape is None:
            shape = list(local.shape)
            for m, p in enumerate(targets):
                if isinstance(p, Shard):
                    shape[p.dim] *= mesh.shape[m]
        layout = default_layout(tuple(int(s) for s in shape), targets, mesh.shape)
        expected = layout.local_shape(mesh.coordinate)
        if tuple(local.shape) != expected:
            raise ValueError(
                f"rank {rank}: from_local got a local piece of shape {tuple(local.shape)}, but "
                f"{list(targets)} of a {layout.shape} tensor gives this rank {expected} by the "
                "array_split rule; pass run_check=True to take the sizes from the ranks"
            )
    return DTensor(local, mesh, layout)


def _checked_layout(local, mesh: DeviceMesh, given, shape) -> Layout:
    """The layout the ranks' pieces make, checked on every rank alike: the ranks exchange
    what they were given before any of them checks it, so that a rank whose own placements
    fail (they disagree with the other ranks', or with its piece) fails with all the others
    instead of leaving them waiting in the exchange."""
    me = dist.get_rank()
    placements, refused = None, None
    try:
        given = tuple(given)
    except TypeError:  # not a sequence: refused below, on every rank alike
        given = (given,)
        refused = ("TypeError", f"rank {me}: placements {given[0]!r} must be a sequence, one "
                   "per mesh dimension")  # fmt: skip
    if refused is None:
        try:
            placements = normalize_placements(given, local.ndim, mesh.shape, me, local.dtype)
        except (TypeError, ValueError) as exc:
            refused = (type(exc).__name__, str(exc))
    asked = None  # the shape= this rank was given, checked on every rank
    if shape is not None:
        try:
            asked = tuple(int(n) for n in shape)
        except (TypeError, ValueError):
            refused = refused or ("TypeError", f"rank {me}: shape={shape!r} is not a shape")
    # placements travel as their repr: the object collectives carry plain data only
    names = tuple(repr(p) for p in given)
    piece = (tuple(local.shape), str(local.dtype), names, device_of(local), asked)
    info = [(me, mesh.coordinate, *piece, refused)]
    for m in range(mesh.ndim):
        gathered = dist.all_gather_object(info, group=mesh.get_group(m))
        info = [item for part in gathered for item in part]
    by_coord = {coord: (r, s, dt, pl) for r, coord, s, dt, pl, *_ in info}

    def fail(message: str):
        raise ValueError(f"rank {me}: from_local: {message}")

    first = info[0]
    for r, _, s, dt, pl, device, _, _ in info:
        if device != first[5]:  # the plans would wait in different backends
            fail(f"rank {first[0]} holds a {first[5]} array, rank {r} a {device} one")
        if pl != first[4]:
            fail(
                f"rank {first[0]} passes placements [{', '.join(first[4])}], rank {r} "
                f"[{', '.join(pl)}]"
            )
        if dt != first[3]:
            fail(f"rank {first[0]} has dtype {first[3]}, rank {r} {dt}")
        if len(s) != len(first[2]):
            fail(f"rank {first[0]} has a {len(first[2])}-d piece, rank {r} a {len(s)}-d one")
    # the ranks agree; placements one of them refused fail on every rank
    for r, *_, problem in sorted(info, key=lambda item: item[0] != me):  # this rank's first
        if problem is not None:
            kind, message = problem
            error = TypeError if kind == "TypeError" else ValueError
            raise error(message if r == me else f"rank {me}: from_local: rank {r} says {message}")
    sharded = {p.dim: m for m, p in enumerate(placements) if isinstance(p, Shard)}
    global_shape = list(first[2])
    sizes: list[tuple[int, ...] | None] = [None] * mesh.ndim
    for d in range(len(global_shape)):
        if d not in sharded:
            for r, _, s, *_ in info:
                if s[d] != first[2][d]:
                    fail(
                        f"dimension {d} is not sharded but rank {first[0]} has shape "
                        f"{first[2]} and rank {r} {s}; give every rank the same size there"
                    )
            continue
        m = sharded[d]
        per: dict[int, tuple[int, int]] = {}
        for coord, (r, s, _, _) in sorted(by_coord.items()):
            k = coord[m]
            if k in per and per[k][1] != s[d]:
                fail(
                    f"ranks {per[k][0]} and {r} share index {k} of mesh dimension {m} but hold "
                    f"{per[k][1]} and {s[d]} entries of the sharded dimension {d}"
                )
            per.setdefault(k, (r, s[d]))
        sizes[m] = tuple(per[k][1] for k in range(mesh.shape[m]))
        global_shape[d] = sum(sizes[m])
    for r, *_, asked, _ in info:
        if asked is not None and asked != tuple(global_shape):
            fail(
                f"rank {r} passes shape={asked} but the ranks' pieces make "
                f"{tuple(global_shape)} (pieces: {sorted((r, s) for r, _, s, *_ in info)})"
            )
    return Layout(tuple(global_shape), placements, tuple(sizes))


DTensor.from_local = staticmethod(from_local)  # torch's spelling: DTensor.from_local(...)


def redistribute_plan(
    src: DTensor,
    placements: Sequence[Placement],
    cost: CostModel | None = None,
    *,
    donate: bool = False,
) -> Plan:
    """The plan ``src.redistribute(placements=..., donate=...)`` will run (see :class:`Plan`)."""
    return src.redistribute_plan(placements, cost, donate=donate)
