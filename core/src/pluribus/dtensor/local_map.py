"""torch's ``local_map``: a function written for local arrays, run on DTensors' pieces, its
results made DTensors again, for the operations DTensor has no rule for (a fused kernel, a
softmax over an unsharded axis). The caller states the placements the pieces must have and
the ones the results have; nothing else is inferred."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..mesh import DeviceMesh
from .api import DTensor, _rank, from_local
from .placements import Placement

Placements = Sequence[Placement] | None


def _spec(given: Any, what: str) -> tuple[Placement, ...] | None:
    """One argument's or result's placements as a tuple (None: not a DTensor)."""
    if given is None:
        return None
    if isinstance(given, Placement):
        raise TypeError(
            f"rank {_rank()}: local_map's {what} is {given!r}; give a sequence with one "
            f"placement per mesh dimension, such as ({given!r},)"
        )
    spec = tuple(given)
    if not all(isinstance(p, Placement) for p in spec):
        raise TypeError(f"rank {_rank()}: local_map's {what} {given!r} is not placements")
    return spec


def _out_specs(out_placements: Any) -> tuple[bool, list]:
    """Whether ``func`` gives one result, and the placements of each result."""
    if out_placements is None or isinstance(out_placements, Placement):
        return True, [_spec(out_placements, "out_placements")]
    items = tuple(out_placements)
    if all(isinstance(p, Placement) for p in items):  # one result's placements
        return True, [items]
    return False, [_spec(p, f"out_placements[{k}]") for k, p in enumerate(items)]


def local_map(
    func: Callable,
    out_placements: Any,
    in_placements: Sequence[Placements] | None = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
    run_check: bool = True,
) -> Callable:
    """``func`` for DTensors: each DTensor argument is replaced by its piece, and each result
    made a DTensor on the arguments' mesh (or ``device_mesh``) with its placements.

    ``out_placements``: the placements of the one result, or a tuple with the placements of
    each (None for a result that is not an array, handed back as it is). ``in_placements``:
    one entry per positional argument, the placements its DTensor must have (None for an
    argument that is not an array; an array that is no DTensor is taken as this rank's piece,
    as torch takes a plain tensor); a DTensor with others is refused, or redistributed with
    ``redistribute_inputs=True``. The results are made by :func:`from_local`: with
    ``run_check`` (the default) the ranks exchange their pieces' shapes, so uneven shards get
    their true sizes (one small collective per result); without it, the pieces are taken to be
    even, as torch's ``local_map`` takes them. With no DTensor argument, ``func``'s results are
    handed back as they are (torch's rule).

    ``local_map(lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True), [Shard(0)],
    [[Shard(0)]])`` is a softmax over the last axis of rows split over the mesh."""
    one, outs = _out_specs(out_placements)
    ins = None
    if in_placements is not None:
        ins = [_spec(p, f"in_placements[{k}]") for k, p in enumerate(in_placements)]

    def mapped(*args: Any, **kwargs: Any) -> Any:
        if ins is not None and len(args) != len(ins):
            raise ValueError(
                f"rank {_rank()}: local_map was given in_placements for {len(ins)} positional "
                f"arguments and called with {len(args)}"
            )
        mesh = device_mesh
        pieces = []
        for k, arg in enumerate(args):
            want = None if ins is None else ins[k]
            if not isinstance(arg, DTensor):  # an array is taken as a piece already (torch's rule)
                if want is not None and getattr(arg, "ndim", None) is None:
                    raise TypeError(
                        f"rank {_rank()}: local_map's argument {k} is a {type(arg).__name__}, "
                        f"not the DTensor with placements {list(want)} that in_placements names"
                    )
                pieces.append(arg)
                continue
            if mesh is None:
                mesh = arg.device_mesh
            elif arg.device_mesh is not mesh and arg.device_mesh != mesh:
                raise ValueError(
                    f"rank {_rank()}: local_map's argument {k} is on {arg.device_mesh!r}, the "
                    f"others on {mesh!r}; every DTensor argument is on one mesh"
                )
            if want is not None and tuple(arg.placements) != want:
                if not redistribute_inputs:
                    raise ValueError(
                        f"rank {_rank()}: local_map's argument {k} has placements "
                        f"{list(arg.placements)}, in_placements names {list(want)}; "
                        "redistribute it first, or pass redistribute_inputs=True"
                    )
                arg = arg.redistribute(placements=want)
            pieces.append(arg.to_local())
        out = func(*pieces, **kwargs)
        if not any(isinstance(a, DTensor) for a in args):
            return out
        results = (out,) if one else tuple(out)
        if len(results) != len(outs):
            raise ValueError(
                f"rank {_rank()}: local_map's function gave {len(results)} results, "
                f"out_placements names {len(outs)}"
            )
        made = tuple(
            r if spec is None else from_local(r, mesh, spec, run_check=run_check)
            for r, spec in zip(results, outs, strict=True)
        )
        return made[0] if one else made

    return mapped
