"""What the state dicts of parallel models share, keyed by parameter name: the check of a
model state's keys, and the optimizer state dict (torch's form: ``{"state": {name: {key:
array or number}}, "param_groups": [...], "step_count": n}``). How a parameter's arrays are
saved and loaded is the parallelism's business (FSDP's rows, tensor parallelism's pieces);
the formats and their checks live here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import distributed as dist
from ..dtensor import DTensor
from ..nn.module import array_namespace

#: (parameter, state array) -> what the state dict holds for it
Save = Callable[[Any, Any], Any]
#: (parameter, value from a state dict, what to call it in errors) -> this rank's state array
Load = Callable[[Any, Any, str], Any]


def like(target: Any, value: Any, copy: bool = False) -> Any:
    """``value`` as an array of ``target``'s library, device and dtype (a cupy value comes to
    the host for a numpy target); ``copy`` for one the state dict does not share."""
    if isinstance(target, np.ndarray) and hasattr(value, "get"):
        value = value.get()
    value = array_namespace(target).asarray(value, dtype=target.dtype)
    return value.copy() if copy else value


def check_keys(state: dict[str, Any], model: Any, call: str) -> None:
    """Refuse a model state whose keys are not exactly the model's parameters and buffers."""
    names = {name for name, _ in model.named_parameters()}
    names |= {name for name, _ in model.named_buffers()}
    missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
    if missing or unexpected:
        raise KeyError(
            f"rank {dist.get_rank()}: {call}: missing keys {missing}, unexpected keys {unexpected}"
        )


def group_entries(optimizer: Any, names: dict[int, str]) -> list[dict[str, Any]]:
    """The optimizer's parameter groups with parameter names in place of the parameters."""
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]


def named_optim_state_dict(model: Any, optimizer: Any, save: Save) -> dict[str, Any]:
    """Every parameter's state by name: arrays through ``save``, counters as plain numbers."""
    names = {id(p): name for name, p in model.named_parameters()}
    state: dict[str, dict[str, Any]] = {}
    for param, entry in zip(optimizer.params, optimizer.state, strict=True):
        state[names[id(param)]] = {
            key: save(param, value) if getattr(value, "ndim", 0) > 0 else _number(value)
            for key, value in entry.items()
        }
    return {
        "state": state,
        "param_groups": group_entries(optimizer, names),
        "step_count": optimizer.step_count,
    }


def _number(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def load_named_optim_state_dict(model: Any, optimizer: Any, osd: dict[str, Any], load: Load):
    """Put ``osd``'s state into ``optimizer``: arrays (DTensors or whole arrays) through
    ``load``, counters as int64 (a float counter would stop counting), the groups'
    hyperparameters (a scheduler's lr included) and the step count."""
    names = {id(p): name for name, p in model.named_parameters()}
    positions = {names[id(p)]: k for k, p in enumerate(optimizer.params)}
    for name, entry in osd["state"].items():
        if name not in positions:
            raise KeyError(
                f"rank {dist.get_rank()}: the optimizer state names parameter {name!r}, which "
                "this optimizer does not hold"
            )
        k = positions[name]
        loaded: dict[str, Any] = {}
        for key, value in entry.items():
            param = optimizer.params[k]
            if isinstance(value, DTensor) or getattr(value, "ndim", 0) > 0:
                loaded[key] = load(param, value, f"{name!r} state {key!r}")
            elif isinstance(value, (int, np.integer)):
                loaded[key] = np.array(value, dtype=np.int64)
            else:  # a float number is the state of a 0-d parameter (its arrays of any other
                # shape are arrays): it takes the parameter's dtype and library
                loaded[key] = like(param.data, value)
        optimizer.state[k] = loaded
    for group, saved in zip(optimizer.param_groups, osd.get("param_groups", []), strict=False):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.step_count = int(osd.get("step_count", optimizer.step_count))
