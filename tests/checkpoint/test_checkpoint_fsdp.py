"""FSDP state through pluribus.checkpoint: a GPT trained two steps fully sharded on 2 ranks,
saved (sharded model and optimizer state: Shard(0) DTensors, uneven rows, counters as plain
numbers), loaded on 3 ranks and trained a third step equals three steps in one process."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus import checkpoint, nn
from pluribus.dtensor import DTensor
from pluribus.parallel import fully_shard
from pluribus.parallel.fsdp import load_optim_state_dict, optim_state_dict
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH = 12  # 6 rows a rank on 2 ranks, 4 on 3


def _model():
    return nn.GPT(nn.GPTConfig(**nn.PRESETS["tiny"]), rng=100)


def _optimizer(params):
    return nn.AdamW(params, lr=1e-2, eps=1e-5, weight_decay=0.01)


def _batch(step):
    tokens = np.random.default_rng(step).integers(0, 128, (GLOBAL_BATCH, 17))
    return tokens[:, :-1], tokens[:, 1:]


def _step(model, opt, step, rows):
    loss_fn = nn.CrossEntropyLoss()
    x, y = _batch(step)
    logits = model.forward(x[rows])
    loss = float(loss_fn.forward(logits.reshape(-1, logits.shape[-1]), y[rows].reshape(-1)))
    model.backward(loss_fn.backward().reshape(logits.shape))
    opt.step()
    opt.zero_grad()
    return loss


def _sharded():
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    model = fully_shard(model)
    return model, _optimizer(model.parameters())


def _my_rows():
    per = GLOBAL_BATCH // pb.get_world_size()
    return slice(pb.get_rank() * per, (pb.get_rank() + 1) * per)


def _train_and_save(path):
    model, opt = _sharded()
    for step in range(2):
        _step(model, opt, step, _my_rows())
    checkpoint.save({"model": model.state_dict(), "optim": optim_state_dict(model, opt)}, path)


def _resume_and_step(path):
    model, opt = _sharded()
    state = model.state_dict()  # DTensors of this world's layout (copies)
    names = [n for n, v in state.items() if isinstance(v, DTensor)]
    osd = optim_state_dict(model, opt)  # no state before a step: build its template
    osd["state"] = {
        name: {
            "exp_avg": DTensor(np.zeros_like(state[name].to_local()), state[name].device_mesh,
                               state[name].layout),
            "exp_avg_sq": DTensor(np.zeros_like(state[name].to_local()),
                                  state[name].device_mesh, state[name].layout),
            "step": 0,
        }
        for name in names
    }  # fmt: skip
    template = {"model": state, "optim": osd}
    checkpoint.load(template, path)
    model.load_state_dict(template["model"])
    load_optim_state_dict(model, opt, template["optim"])
    _step(model, opt, 2, _my_rows())
    return model.full_state_dict()


def test_fsdp_state_saved_on_two_ranks_resumes_on_three(tmp_path):
    path = str(tmp_path / "step-2")
    run_ranks(_train_and_save, 2, args=(path,))
    meta = checkpoint.read_metadata(path)
    assert len(meta.tensors["model.blocks.0.attn.qkv.weight"].chunks) == 2  # one piece a rank
    assert len(meta.tensors["optim.state.blocks.0.attn.qkv.weight.exp_avg"].chunks) == 2
    assert meta.values["optim.state.blocks.0.attn.qkv.weight.step"] == 2
    finals = run_ranks(_resume_and_step, 3, args=(path,))
    reference = _model()
    opt = _optimizer(reference.parameters())
    for step in range(3):
        _step(reference, opt, step, slice(None))
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(finals[0][name], value, rtol=1e-4, atol=1e-5, err_msg=name)
