"""Rank bodies and the reference state for the checkpoint tests (importable by spawned ranks).

A *layout* is plain data, so that it travels to process ranks: ``{"mesh": [2, 2], "tensors":
{key: [[placement, sizes], ...] per mesh dimension]}`` where placement is ``"R"`` or the
sharded tensor dimension, and sizes the pieces along it (uneven and empty ones allowed).
"""

from __future__ import annotations

import math

import numpy as np
import pluribus as pb
from pluribus import checkpoint
from pluribus.dtensor import DTensor, Layout, Replicate, Shard, init_device_mesh

#: key -> (global shape, dtype) of the sharded tensors (stand-ins for FSDP model and optimizer)
SHARDED = {
    "model.layers.0.weight": ((7, 5), "float32"),
    "model.layers.0.bias": ((6,), "float64"),
    "optim.state.0.exp_avg": ((7, 5), "float32"),
    "optim.state.0.exp_avg_sq": ((7, 5), "float32"),
    "model.head": ((3, 9), "int64"),
}
#: key -> (shape, dtype) of arrays every rank holds whole (DDP)
REPLICATED = {"model.embedding": ((4, 3), "float64"), "optim.step_count": ((), "int64")}


def reference() -> dict[str, np.ndarray]:
    """The single-process truth every layout must load."""
    rng = np.random.default_rng(1234)
    out = {}
    for key, (shape, dtype) in {**SHARDED, **REPLICATED}.items():
        out[key] = (rng.normal(size=shape) * 100).astype(dtype)
    return out


def plain_values() -> dict:
    return {
        "step": 1234,
        "sampler": {"epoch": 3, "position": 17, "seed": 9},
        "rng": np.random.default_rng(7).bit_generator.state,
        "schedule": {"lrs": [0.1, 0.05], "name": "cosine"},
    }


def _place(layout_spec, shape) -> tuple[tuple, tuple]:
    placements, sizes = [], []
    for what, split in layout_spec:
        if what == "R":
            placements.append(Replicate())
            sizes.append(None)
        else:
            placements.append(Shard(int(what)))
            sizes.append(tuple(split))
    return tuple(placements), tuple(sizes)


def build_state(layout: dict, fill: bool) -> dict:
    """This rank's state dict in ``layout``: its pieces of the reference (``fill``) or zeros,
    nested as a training loop would hold it."""
    mesh = init_device_mesh("cpu", tuple(layout["mesh"]))
    ref = reference()
    state: dict = {"model": {"layers": [{}]}, "optim": {"state": [{}]}}
    flat = {}
    for key, (shape, _) in SHARDED.items():
        placements, sizes = _place(layout["tensors"][key], shape)
        spec = Layout(shape, placements, sizes)
        piece = ref[key][spec.local_slices(mesh.coordinate)]
        piece = piece.copy() if fill else np.zeros_like(piece)
        flat[key] = DTensor(np.ascontiguousarray(piece), mesh, spec)
    for key in REPLICATED:
        flat[key] = ref[key].copy() if fill else np.zeros_like(ref[key])
    if not fill:
        flat["optim.step_count"] = np.int64(0)  # a numpy scalar is put back, not written into
    state["model"]["layers"][0] = {
        "weight": flat["model.layers.0.weight"],
        "bias": flat["model.layers.0.bias"],
    }
    state["model"]["head"] = flat["model.head"]
    state["model"]["embedding"] = flat["model.embedding"]
    state["optim"]["state"][0] = {
        "exp_avg": flat["optim.state.0.exp_avg"],
        "exp_avg_sq": flat["optim.state.0.exp_avg_sq"],
    }
    state["optim"]["step_count"] = flat["optim.step_count"]
    values = plain_values()
    if not fill:
        values = {
            "step": 0,
            "sampler": {"epoch": 0, "position": 0, "seed": 0},
            "rng": np.random.default_rng(99).bit_generator.state,
            "schedule": {"lrs": [0.0, 0.0], "name": ""},
        }
    state.update(values)
    return state


def save_body(layout: dict, path: str) -> bool:
    checkpoint.save(build_state(layout, fill=True), path)
    return True


def load_body(layout: dict, path: str) -> bool:
    """Load into ``layout`` and check every piece and value against the reference."""
    state = build_state(layout, fill=False)
    checkpoint.load(state, path)
    ref = reference()
    got = {
        "model.layers.0.weight": state["model"]["layers"][0]["weight"],
        "model.layers.0.bias": state["model"]["layers"][0]["bias"],
        "model.head": state["model"]["head"],
        "model.embedding": state["model"]["embedding"],
        "optim.state.0.exp_avg": state["optim"]["state"][0]["exp_avg"],
        "optim.state.0.exp_avg_sq": state["optim"]["state"][0]["exp_avg_sq"],
        "optim.step_count": state["optim"]["step_count"],
    }
    for key, value in got.items():
        if isinstance(value, DTensor):
            expected = ref[key][value.layout.local_slices(value.device_mesh.coordinate)]
            value = value.to_local()
        else:
            expected = ref[key]
        assert value.dtype == expected.dtype, key
        np.testing.assert_array_equal(value, expected, err_msg=f"rank {pb.get_rank()} {key}")
    assert isinstance(state["optim"]["step_count"], np.int64)
    for key, value in plain_values().items():
        assert state[key] == value, (key, state[key], value)
    return True


def random_layout(rng: np.random.Generator, world: int, mesh: tuple[int, ...]) -> dict:
    """Random placements and uneven sizes (empty pieces included) for every sharded tensor."""
    tensors = {}
    for key, (shape, _) in SHARDED.items():
        free = list(range(len(shape)))
        spec = []
        for parts in mesh:
            if free and rng.random() < 0.75:
                dim = free.pop(int(rng.integers(len(free))))
                cuts = np.sort(rng.integers(0, shape[dim] + 1, size=parts - 1))
                sizes = np.diff(np.concatenate([[0], cuts, [shape[dim]]])).tolist()
                spec.append([dim, sizes])
            else:
                spec.append(["R", None])
        tensors[key] = spec
    assert math.prod(mesh) == world
    return {"mesh": list(mesh), "tensors": tensors}


def manager_save_body(directory: str, step: int, layout: dict, keep_last: int | None) -> bool:
    state = build_state(layout, fill=True)
    state["step"] = step
    checkpoint.CheckpointManager(directory, keep_last=keep_last).save(step, state)
    return True


def manager_load_body(directory: str, layout: dict) -> int | None:
    """Load the newest complete step into ``layout``, checking it as :func:`load_body` does."""
    manager = checkpoint.CheckpointManager(directory)
    step = manager.latest_step()
    if step is not None:
        load_body_with_step(layout, manager.path(step), step)
    return step


def load_body_with_step(layout: dict, path: str, step: int) -> None:
    state = build_state(layout, fill=False)
    checkpoint.load(state, path)
    assert state["step"] == step
    ref = reference()
    weight = state["model"]["layers"][0]["weight"]
    expected = ref["model.layers.0.weight"][
        weight.layout.local_slices(weight.device_mesh.coordinate)
    ]
    np.testing.assert_array_equal(weight.to_local(), expected)
    np.testing.assert_array_equal(state["model"]["embedding"], ref["model.embedding"])
