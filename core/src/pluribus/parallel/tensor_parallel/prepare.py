"""torch's ``PrepareModuleInput``, ``PrepareModuleOutput`` (and the two as one,
``PrepareModuleInputOutput``): a module's inputs (or outputs) moved from the layout
they come in to the one wanted, and their gradients moved back, so that a plan ported from
torch can say where a sequence is gathered or cut (before attention, after a position table).
Nothing is split; each move is one redistribute (``move``).

The moved values stay local arrays, since pluribus modules take and give those. The whole
shape each forward saw is kept on the module, not in a closure, so the gradients of uneven
pieces come back in the sizes forward cut, in a deep copy of the model too."""

from __future__ import annotations

import inspect
from typing import Any

from ... import distributed as dist
from ...dtensor import Placement, Shard
from ...mesh import DeviceMesh
from ...nn.module import Module
from .boundaries import global_rows, locate, move
from .pieces import rank_text
from .styles import ParallelStyle, _local_output_only, _mark_once, _no_partial

Layouts = Placement | tuple[Placement | None, ...] | None
Pairs = tuple[tuple[Placement | None, Placement | None], ...]


def _pairs(style: str, what: str, names: tuple[str, str], given: Layouts, wanted: Layouts) -> Pairs:
    """The (layout, desired layout) of each positional value, checked: a Placement or a tuple
    of them, of one length, None (left alone) in both or neither, no Partial."""
    tuples = []
    for name, layouts in zip(names, (given, wanted), strict=True):
        if isinstance(layouts, Placement):
            layouts = (layouts,)
        if not isinstance(layouts, (tuple, list)) or not all(
            p is None or isinstance(p, Placement) for p in layouts
        ):
            raise TypeError(
                f"rank {dist.get_rank()}: {style}({name}={layouts!r}): give a Placement "
                f"(Replicate(), Shard(d)) or a tuple with one per positional {what}, None for "
                "one left as it is"
            )
        tuples.append(tuple(layouts))
    if len(tuples[0]) != len(tuples[1]) or not tuples[0]:
        raise ValueError(
            f"rank {dist.get_rank()}: {style}({names[0]}={given!r}, {names[1]}={wanted!r}): "
            f"give one layout and one desired layout per positional {what}, at least one "
            f"(got {len(tuples[0])} and {len(tuples[1])})"
        )
    for k, (src, dst) in enumerate(zip(*tuples, strict=True)):
        if (src is None) != (dst is None):
            raise ValueError(
                f"rank {dist.get_rank()}: {style}: {what} {k} has {names[0]}[{k}]={src!r} and "
                f"{names[1]}[{k}]={dst!r}; None leaves that {what} as it is, so it goes in "
                "both or neither"
            )
        _no_partial(style, **{f"{names[0]}[{k}]": src, f"{names[1]}[{k}]": dst})
    return tuple(zip(*tuples, strict=True))


def _check(
    values: tuple, pairs: Pairs, mesh: DeviceMesh, what: str, module: Module, names=None
) -> None:
    """Refuse, before anything is sent, values that the layouts do not fit (``names``: how to
    call each value, by default its position)."""
    names = names or range(len(values))
    if len(values) != len(pairs):
        raise ValueError(
            f"{rank_text(mesh)}: {module!r} has {len(values)} positional {what}(s) but its "
            f"Prepare layouts name {len(pairs)}; give one per {what} (None for one left alone)"
        )
    for k, value, (src, dst) in zip(names, values, pairs, strict=True):
        if src is None or src == dst:
            continue
        ndim = getattr(value, "ndim", None)
        if ndim is None:
            raise TypeError(
                f"{rank_text(mesh)}: {what} {k} of {module!r} is a {type(value).__name__}, not "
                f"an array, and cannot go from {src!r} to {dst!r}; "
                + (
                    "give it the layout None"
                    if isinstance(k, int)
                    else "pass an array, or leave the keyword out (a name not passed is skipped)"
                )
            )
        for layout in (src, dst):
            if isinstance(layout, Shard) and not -ndim <= layout.dim < ndim:
                raise ValueError(
                    f"{rank_text(mesh)}: {what} {k} of {module!r} has shape "
                    f"{tuple(value.shape)}, which has no dimension {layout.dim} for {layout!r}; "
                    "give the layouts of dimensions it has"
                )


def _kwarg_pairs(given: dict | None, wanted: dict | None) -> dict[str, tuple]:
    """The (layout, desired layout) of each keyword input that moves, by name, checked: dicts
    with the same names, of Placements (no Partial), or None in both for a keyword left as it
    is (torch's None)."""
    given, wanted = given or {}, wanted or {}
    if not isinstance(given, dict) or not isinstance(wanted, dict) or given.keys() != wanted.keys():
        raise ValueError(
            f"rank {dist.get_rank()}: PrepareModuleInput(input_kwarg_layouts={given!r}, "
            f"desired_input_kwarg_layouts={wanted!r}): give two dicts with the same keyword "
            "names, a layout and a desired layout for each"
        )
    moved = [name for name in given if given[name] is not None or wanted[name] is not None]
    for name in moved:
        for layouts, layout in (
            ("input_kwarg_layouts", given),
            ("desired_input_kwarg_layouts", wanted),
        ):
            if not isinstance(layout[name], Placement):
                raise TypeError(
                    f"rank {dist.get_rank()}: PrepareModuleInput({layouts}[{name!r}]="
                    f"{layout[name]!r}): give a Placement (Replicate(), Shard(d)), or None in "
                    "both dicts for a keyword left as it is"
                )
        _no_partial(
            "PrepareModuleInput",
            **{f"input_kwarg_layouts[{name!r}]": given[name],
               f"desired_input_kwarg_layouts[{name!r}]": wanted[name]},
        )  # fmt: skip
    return {name: (given[name], wanted[name]) for name in moved}


def _same(src: Placement, dst: Placement, ndim: int) -> bool:
    """Whether two layouts of an ``ndim``-dimensional value are one (``Shard(-1)`` of a matrix
    is ``Shard(1)``)."""
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return src.dim % ndim == dst.dim % ndim
    return src == dst


def _forward(values: tuple, pairs: Pairs, mesh: DeviceMesh) -> tuple[list, list]:
    """The values moved to their desired layouts, and the whole shape of each moved one."""
    return _moved(values, pairs, _located(values, pairs, mesh))


def _located(values: tuple, pairs: Pairs, mesh: DeviceMesh) -> list:
    """Each value that moves as a DTensor (a Shard source's sizes exchanged and checked, so
    that a refusal comes before any value moves), None for one that stays."""
    return [
        None
        if src is None or src == dst or _same(src, dst, value.ndim)
        else locate(value, mesh, src, None)  # a Shard source's sizes: from the ranks
        for value, (src, dst) in zip(values, pairs, strict=True)
    ]


def _moved(values: tuple, pairs: Pairs, located: list) -> tuple[list, list]:
    """The values moved (``located``: their DTensors, None for one that stays), and the whole
    shape of each moved one, which its gradient's move back needs."""
    moved, shapes = [], []
    for value, (_, dst), dt in zip(values, pairs, located, strict=True):
        if dt is None:
            moved.append(value)
            shapes.append(None)
        else:
            moved.append(dt.redistribute(placements=[dst]).to_local())
            shapes.append(dt.shape)
    return moved, shapes


def _first_input(module: Module) -> str | None:
    """The name of the parameter of ``module.forward`` whose gradient its backward gives (the
    first), where a caller may pass it by keyword."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
        return params[0].name
    return None


def _backward(grads: tuple, pairs: Pairs, shapes: list, mesh: DeviceMesh) -> list:
    """The gradients, which come in the desired layouts, moved back to the given ones."""
    back = []
    for grad, (src, dst), shape in zip(grads, pairs, shapes, strict=True):
        if shape is None or grad is None:
            back.append(grad)
        else:
            back.append(move(grad, mesh, dst, src, shape[-1], global_rows(shape, dst)))
    return back


def _recorded(module: Module, name: str, style: str, mesh: DeviceMesh) -> list:
    shapes = module.__dict__.get(name)
    if shapes is None:
        raise RuntimeError(
            f"{rank_text(mesh)}: {style} on {module!r} got a gradient before any forward; run "
            "forward before each backward"
        )
    return shapes


def _claim(module: Module, mesh: DeviceMesh, style: str) -> None:
    """Refuse what is not a pluribus.nn Module, and a module ``style`` hooked before."""
    if not isinstance(module, Module):
        raise TypeError(
            f"{rank_text(mesh)}: {style} hooks a pluribus.nn Module, got {type(module).__name__}"
        )
    _mark_once(module, mesh, style)


class PrepareModuleInput(ParallelStyle):
    """Move a module's positional inputs from ``input_layouts`` to ``desired_input_layouts``
    before its forward (``Shard(1)`` to ``Replicate()`` gathers the sequence), and the gradient
    of each back after its backward (there, a local slice).

    Each layout is a Placement, or a tuple with one entry per positional input (None in both
    for an input left alone). The module's backward gives its first input's gradient, or a
    tuple with one per input. Its moves are the outermost of the module's, in whatever order
    the styles were applied: the inputs move before any other style's forward hook, and their
    gradients after any other style's backward hook (a split's sum of partial gradients).

    Keyword inputs move with ``input_kwarg_layouts`` and ``desired_input_kwarg_layouts``
    (dicts by name, the same names in both, None in both for one left alone; a name not
    passed in a call is skipped), forward
    only: a pluribus.nn backward gives gradients of positional inputs, so a keyword input is
    one without a gradient (a mask, a position table). ``input_layouts`` may then be left out,
    leaving the positional inputs alone. ``use_local_output`` is True only (torch's default is
    False, handing the module DTensors).
    """

    def __init__(
        self,
        *,
        input_layouts: Layouts = None,
        desired_input_layouts: Layouts = None,
        input_kwarg_layouts: dict[str, Placement | None] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement | None] | None = None,
        use_local_output: bool = True,
    ):
        _local_output_only("PrepareModuleInput", use_local_output)
        self.kwarg_pairs = _kwarg_pairs(input_kwarg_layouts, desired_input_kwarg_layouts)
        keywords = bool(input_kwarg_layouts or desired_input_kwarg_layouts)
        if keywords and input_layouts is None and desired_input_layouts is None:
            self.pairs = None  # positional inputs left alone, however many
        else:
            self.pairs = _pairs(
                "PrepareModuleInput",
                "input",
                ("input_layouts", "desired_input_layouts"),
                input_layouts,
                desired_input_layouts,
            )

    def _refuse_first_input(self, module: Module, mesh: DeviceMesh) -> None:
        """A keyword input moves forward only: refuse one that is the input whose gradient
        the module's backward gives (its forward's first, passed by name)."""
        first = _first_input(module) if isinstance(module, Module) else None
        if first in self.kwarg_pairs:
            raise ValueError(
                f"{rank_text(mesh)}: PrepareModuleInput(input_kwarg_layouts[{first!r}]) on "
                f"{module!r}: {first!r} is its forward's first input, whose gradient its "
                "backward gives, and keyword inputs move forward only; pass it positionally "
                "and give its layouts in input_layouts and desired_input_layouts"
            )

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        self._refuse_first_input(module, mesh)
        _claim(module, mesh, "PrepareModuleInput")
        pairs, kwarg_pairs = self.pairs, self.kwarg_pairs

        def prepare(m: Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            names = [name for name in kwarg_pairs if name in kwargs]  # a name not passed: skipped
            values = tuple(kwargs[name] for name in names)
            kwpairs = tuple(kwarg_pairs[name] for name in names)
            # every value checked, and its sizes exchanged, before any moves
            _check(values, kwpairs, mesh, "keyword input", m, names)
            if pairs is not None:
                _check(args, pairs, mesh, "input", m)
                located = _located(args, pairs, mesh)
            kw_located = _located(values, kwpairs, mesh)
            if pairs is not None:
                moved, m._tp_input_shapes = _moved(args, pairs, located)
                args = tuple(moved)
            if names:
                moved = _moved(values, kwpairs, kw_located)[0]
                kwargs = {**kwargs, **dict(zip(names, moved, strict=True))}
            return args, kwargs

        def restore(m: Module, grad_input: tuple, grad_output: tuple) -> tuple:
            shapes = _recorded(m, "_tp_input_shapes", "PrepareModuleInput", mesh)
            grad = grad_input[0]
            if isinstance(grad, tuple):  # one gradient per input
                if len(grad) != len(pairs):
                    raise ValueError(
                        f"{rank_text(mesh)}: {m!r}'s backward gave {len(grad)} gradients for "
                        f"{len(pairs)} inputs; give one per positional input (None for none)"
                    )
                return (tuple(_backward(grad, pairs, shapes, mesh)),)
            firsts = (grad,) + (None,) * (len(pairs) - 1)  # the first input's only
            return (_backward(firsts, pairs, shapes, mesh)[0],)

        module.register_forward_pre_hook(prepare, prepend=True, with_kwargs=True)
        if pairs is not None:
            module.register_full_backward_hook(restore)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Move a module's output (or each of a tuple of outputs) from ``output_layouts`` to
    ``desired_output_layouts`` after its forward (``Replicate()`` to ``Shard(0)`` keeps this
    rank's part), and the gradient of each back before its backward (there, a gather).

    Layouts as for :class:`PrepareModuleInput`. As in torch, the styles on one module see its
    output in the order they were applied: apply this one last.
    """

    def __init__(
        self,
        *,
        output_layouts: Layouts,
        desired_output_layouts: Layouts,
        use_local_output: bool = True,
    ):
        _local_output_only("PrepareModuleOutput", use_local_output)
        self.pairs = _pairs(
            "PrepareModuleOutput",
            "output",
            ("output_layouts", "desired_output_layouts"),
            output_layouts,
            desired_output_layouts,
        )

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        _claim(module, mesh, "PrepareModuleOutput")
        pairs = self.pairs

        def prepare(m: Module, args: tuple, output: Any) -> Any:
            several = isinstance(output, tuple)
            outputs = output if several else (output,)
            _check(outputs, pairs, mesh, "output", m)
            moved, m._tp_output_shapes = _forward(outputs, pairs, mesh)
            return tuple(moved) if several else moved[0]

        def restore(m: Module, grad_output: tuple) -> tuple:
            shapes = _recorded(m, "_tp_output_shapes", "PrepareModuleOutput", mesh)
            if len(grad_output) != len(pairs):
                raise ValueError(
                    f"{rank_text(mesh)}: {m!r}'s backward got {len(grad_output)} gradient(s) "
                    f"for {len(pairs)} outputs; pass one per output"
                )
            return tuple(_backward(grad_output, pairs, shapes, mesh))

        module.register_forward_hook(prepare)
        module.register_full_backward_pre_hook(restore, prepend=True)
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """torch's pair of the two styles above on one module: its inputs moved as
    :class:`PrepareModuleInput` moves them and its outputs as :class:`PrepareModuleOutput`
    does, each with its arguments (``use_local_input``, torch's default False, is True only
    here, as ``use_local_output`` is)."""

    def __init__(
        self,
        *,
        input_layouts: Layouts = None,
        desired_input_layouts: Layouts = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = True,
        output_layouts: Layouts,
        desired_output_layouts: Layouts,
        use_local_output: bool = True,
    ):
        if use_local_input is not True:
            raise ValueError(
                f"rank {dist.get_rank()}: PrepareModuleInputOutput(use_local_input="
                f"{use_local_input!r}): pluribus.nn modules take local arrays, so "
                "use_local_input=True is the only choice (a plan ported from torch drops it)"
            )
        self.inputs = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
        )
        self.outputs = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        for style in ("PrepareModuleInput", "PrepareModuleOutput"):  # refused before any hook
            if style in getattr(module, "__dict__", {}).get("_tp_styles", ()):
                raise ValueError(
                    f"{rank_text(mesh)}: {style} is already applied to {module!r}; "
                    "PrepareModuleInputOutput applies it again"
                )
        self.inputs._refuse_first_input(module, mesh)
        _claim(module, mesh, "PrepareModuleInputOutput")
        self.inputs.apply(module, mesh)
        return self.outputs.apply(module, mesh)
