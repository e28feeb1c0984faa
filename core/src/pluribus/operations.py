"""The one table of the operations a group runs: what each takes, in what order, and what it writes.

Everything that handles a call generically reads it from here: the hook specs are checked against
it, the public API passes arguments in its order, the core's implementation finds the array that
picks the backend and copies back what host staging wrote, the debugging aids describe calls
with it, and backend plugins use it for their own bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Operation:
    """One operation of :data:`OPERATIONS`.

    ``args`` are its hook's arguments in order, without ``group`` first and ``async_op`` last;
    ``key`` is the argument whose array decides the device and dtype (for a list, its first
    array; None for barrier); ``written`` are the arguments the operation writes; ``counted`` is
    the argument whose bytes are the call's size in traces and benchmarks; ``collective`` is
    False for point-to-point operations, which only two ranks call. ``meets`` names the
    operation whose calls this one's meet on other ranks (the same messages, so each rank may
    call either; the mismatch checks compare that name): itself unless given.
    """

    name: str
    args: tuple[str, ...]
    key: str | None
    written: tuple[str, ...] = ()
    counted: str | None = None
    collective: bool = True
    meets: str = ""
    key_index: int | None = field(init=False, repr=False)
    key_in_list: bool = field(init=False, repr=False)
    written_indices: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        key_index = None if self.key is None else self.args.index(self.key)
        object.__setattr__(self, "key_index", key_index)
        object.__setattr__(self, "key_in_list", self.key in LIST_ARGUMENTS)
        object.__setattr__(self, "written_indices", tuple(self.args.index(a) for a in self.written))
        if not self.meets:
            object.__setattr__(self, "meets", self.name)

    @property
    def hook_name(self) -> str:
        return f"pluribus_{self.name}"

    def key_array(self, args: tuple) -> Any:
        """The array of ``args`` (in :attr:`args` order) that decides device and dtype."""
        if self.key_index is None:
            return None
        found = args[self.key_index]
        if self.key_in_list:
            return found[0] if found else None
        return found


#: Arguments that are one array, and lists of arrays (None on ranks that pass none, as in
#: gather).
ARRAY_ARGUMENTS = frozenset({"array", "output"})
LIST_ARGUMENTS = frozenset({"outputs", "inputs"})
#: Arguments that are ranks, group-local in the hooks.
RANK_ARGUMENTS = frozenset({"src", "dst"})

OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        Operation("all_reduce", ("array", "op"), "array", ("array",)),
        # all_reduce(array, out=output): ``array`` is only read; ranks may mix it with the
        # in-place form.
        Operation(
            "all_reduce_into", ("array", "output", "op"), "array", ("output",), meets="all_reduce"
        ),
        Operation("broadcast", ("array", "src"), "array", ("array",)),
        Operation("reduce", ("array", "dst", "op"), "array", ("array",)),
        Operation("all_gather", ("outputs", "array"), "array", ("outputs",)),
        Operation(
            "reduce_scatter", ("output", "inputs", "op"), "output", ("output",), counted="inputs"
        ),
        Operation("all_to_all", ("outputs", "inputs"), "inputs", ("outputs",), counted="inputs"),
        Operation("gather", ("array", "outputs", "dst"), "array", ("outputs",)),
        Operation("scatter", ("array", "inputs", "src"), "array", ("array",)),
        Operation("barrier", (), None),
        Operation("send", ("array", "dst", "tag"), "array", (), collective=False),
        Operation("recv", ("array", "src", "tag"), "array", ("array",), collective=False),
    )
}


def hook_implementations(
    body: Callable[[Operation, Any, tuple, bool], Any], **options: Any
) -> dict[str, Callable[..., Any]]:
    """One hook implementation per operation, each calling ``body(operation, group, args,
    async_op)`` with ``args`` in table order; ``options`` are :data:`~pluribus.hookimpl`'s
    (with ``wrapper=True``, ``body`` is a generator in pluggy's wrapper style).

    pluggy reads an implementation's argument names from its code; each function made here
    reports its hook spec's through ``__wrapped__``, so one generic body serves every hook. Set
    the result on a module or an instance (not a class: methods would lose ``group``).
    """
    from . import hookspecs

    made = {}
    for op in OPERATIONS.values():
        if options.get("wrapper"):  # pluggy wants a generator function for a wrapper

            def implementation(group, *rest, _op=op):
                return (yield from body(_op, group, rest[:-1], rest[-1]))

        else:

            def implementation(group, *rest, _op=op):
                return body(_op, group, rest[:-1], rest[-1])

        implementation.__wrapped__ = getattr(hookspecs, op.hook_name)
        implementation.__name__ = implementation.__qualname__ = op.hook_name
        made[op.hook_name] = hookspecs.hookimpl(**options)(implementation)
    return made
