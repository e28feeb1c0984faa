"""What a 2-D (dp x tp) GPT's checkpoint costs: the bytes its files hold against the state's
own, and the peak memory of building its state dict against what FSDP keeps per rank.

    python benchmarks/checkpoint_2d.py
    PYTHONPATH=<other tree>/core/src python benchmarks/checkpoint_2d.py   # the same, older code

Four thread ranks in one process on a 2 x 2 ("dp", "tp") mesh; the GPT (``--layers``,
``--embd``, fused q, k, v) is split by ``transformer_plan`` over "tp" and then either wrapped
in DDP over "dp" (``ddp-tp``) or fully sharded over it (``fsdp-tp``), with AdamW, and takes
one training step. For each:

* files / state: the bytes of the checkpoint's safetensors files over the bytes of the state
  (every parameter and both AdamW moments, once): 1.00 when each piece is written once;
* peak / held: the peak of memory traced while every rank builds its model and optimizer
  state dict (``tracemalloc``, all ranks together), over the bytes every rank's parameters
  and moments hold: about 1 when the state dict copies what the rank holds, dp when it
  gathers the tensor-parallel pieces over the data-parallel ranks.

These are counts, not times: the machine's load does not move them.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import tracemalloc

import numpy as np


def _rank(how: str, layers: int, embd: int, folder: str) -> dict:
    import pluribus as pb
    from pluribus import checkpoint, nn
    from pluribus.dtensor import init_device_mesh
    from pluribus.parallel import (
        DistributedDataParallel,
        fully_shard,
        get_model_state_dict,
        get_optimizer_state_dict,
        parallelize_module,
        transformer_plan,
    )

    config = nn.GPTConfig(vocab_size=128, n_layer=layers, n_head=8, n_embd=embd, block_size=64)
    model = nn.GPT(config, dtype=np.float32, rng=0)
    whole = 3 * sum(p.data.nbytes for p in model.parameters())  # parameters and two moments
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], transformer_plan(model))
    if how == "fsdp-tp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        runner = fully_shard(model, mesh=mesh["dp"])
        opt = nn.AdamW(runner.parameters(), lr=1e-3)
    else:
        runner = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
        opt = nn.AdamW(model.parameters(), lr=1e-3)
    # one training step first, as in training: FSDP's gather buffers exist, the moments hold
    # values
    tokens = np.random.default_rng(mesh["dp"].get_local_rank()).integers(0, 128, (2, 17))
    logits = runner.forward(tokens[:, :-1])
    loss = nn.CrossEntropyLoss()
    loss.forward(logits.reshape(-1, 128), tokens[:, 1:].reshape(-1))
    runner.backward(loss.backward().reshape(logits.shape))
    opt.step()
    held = 3 * sum(p.data.nbytes for p in runner.parameters())  # this rank's, moments alike
    pb.barrier()
    if pb.get_rank() == 0:
        tracemalloc.start()
    pb.barrier()
    state = {"model": get_model_state_dict(runner), "optim": get_optimizer_state_dict(runner, opt)}
    pb.barrier()
    peak = tracemalloc.get_traced_memory()[1] if pb.get_rank() == 0 else 0
    pb.barrier()
    if pb.get_rank() == 0:
        tracemalloc.stop()
    path = os.path.join(folder, how)
    checkpoint.save(state, path)
    files = sum(
        os.path.getsize(os.path.join(path, name))
        for name in os.listdir(path)
        if name.endswith(".safetensors")
    )
    return {"whole": whole, "held": held, "peak": peak, "files": files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    args = parser.parse_args()
    from pluribus.testing import run_ranks

    for how in ("ddp-tp", "fsdp-tp"):
        with tempfile.TemporaryDirectory() as folder:
            ranks = run_ranks(_rank, 4, args=(how, args.layers, args.embd, folder), timeout=600)
        whole, files = ranks[0]["whole"], ranks[0]["files"]
        held, peak = sum(r["held"] for r in ranks), ranks[0]["peak"]
        print(
            f"{how:8s} state {whole / 2**20:7.1f} MiB, files {files / 2**20:7.1f} MiB "
            f"(files / state {files / whole:.2f}); held by the ranks {held / 2**20:7.1f} MiB, "
            f"state dict peak {peak / 2**20:7.1f} MiB (peak / held {peak / held:.2f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
