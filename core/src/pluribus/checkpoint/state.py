"""A nested state dict as a flat list of leaves with dotted keys, and back in place.

Dicts (string keys) and lists nest; the leaves are arrays (numpy, cupy, numpy scalars),
DTensors, :class:`Pieces` (boxes of a global array that no DTensor layout describes), and
plain values (None, bool, int, float, str, and tuples or lists of them). Keys join
the path with dots as torch's state dicts do (``"model.blocks.0.attn.weight"``); two paths
that join to the same key are an error. Loading writes arrays in place and puts plain values
(and numpy scalars, which are immutable) back into their container.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtensor import DTensor
from ..dtensor.boxes import Pieces

ARRAY, DTENSOR, PIECES, VALUE = "array", "dtensor", "pieces", "value"


@dataclass
class Leaf:
    key: str
    kind: str  # ARRAY, DTENSOR, PIECES or VALUE
    value: Any
    container: Any
    index: Any

    def replace(self, value: Any) -> None:
        self.container[self.index] = value


def is_cupy(array: Any) -> bool:
    return type(array).__module__.split(".")[0] == "cupy"


def is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic)) or is_cupy(value)


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False


def flatten(state_dict: dict, rank: int) -> list[Leaf]:
    """Every leaf of ``state_dict`` in a fixed order (the same on every rank for the same
    keys); a leaf of another type raises ``TypeError`` naming its key."""
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"rank {rank}: a state dict must be a dict, not {type(state_dict).__name__}"
        )
    leaves: list[Leaf] = []
    seen: dict[str, tuple] = {}

    def visit(container: Any, index: Any, value: Any, path: tuple) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"rank {rank}: state dict key {k!r} under {'.'.join(path) or 'the top'}"
                        " is not a string; checkpoints name every entry by a string key"
                    )
                visit(value, k, v, (*path, k))
            return
        key = ".".join(path)
        if isinstance(value, list) and not _plain(value):
            for i, v in enumerate(value):
                visit(value, i, v, (*path, str(i)))
            return
        if key in seen:
            raise ValueError(
                f"rank {rank}: the state dict paths {seen[key]} and {path} both make the key "
                f"{key!r}; rename one of them"
            )
        seen[key] = path
        if isinstance(value, DTensor):
            kind = DTENSOR
        elif isinstance(value, Pieces):
            kind = PIECES
        elif is_array(value):
            kind = ARRAY
        elif _plain(value):
            kind = VALUE
        else:
            raise TypeError(
                f"rank {rank}: state dict entry {key!r} is a {type(value).__name__}; a "
                "checkpoint holds arrays, DTensors, Pieces, and None/bool/int/float/str (or "
                "lists of them). Convert it (for example a Generator's bit_generator.state is a "
                "dict)"
            )
        leaves.append(Leaf(key, kind, value, container, index))

    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise TypeError(f"rank {rank}: state dict key {k!r} is not a string")
        visit(state_dict, k, v, (k,))
    return leaves


def restore_value(template: Any, saved: Any) -> Any:
    """A loaded plain value in the template's type (JSON turns tuples into lists)."""
    if isinstance(template, tuple) and isinstance(saved, list):
        return tuple(restore_value(t, s) for t, s in zip(template, saved, strict=False))
    return saved
