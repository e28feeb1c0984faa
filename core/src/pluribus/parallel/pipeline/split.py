"""Cut a model into pipeline stages of about equal cost: an ``nn.Sequential`` by its layers, a
GPT by its blocks (the embeddings go with the first stage, the final norm and head with the
last).

The cost of a layer is its parameter count (``by="params"``, free) or its measured forward plus
backward time on a sample input (``by="time"``, what the pipeline actually waits on). Stages are
contiguous runs of layers; :func:`balance` picks the cut that makes the costliest stage as
cheap as possible.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ...nn.module import Composite, Module, Sequential, array_namespace
from ...nn.transformer import GPT, Step


def balance(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous ranges of layer indices, one per stage, minimising the costliest stage."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot cut {n} layer(s) into {num_stages} stage(s): each stage needs at least one "
            f"layer; use 1..{n} stages"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the least possible costliest stage when the first i layers make k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def parameter_costs(layers: Sequence[Module]) -> list[float]:
    return [float(sum(int(p.data.size) for p in layer.parameters())) for layer in layers]


def measured_costs(layers: Sequence[Module], sample_input: Any, repeats: int = 3) -> list[float]:
    """Seconds of forward plus backward of each layer, chained on ``sample_input`` (the best
    of ``repeats``)."""
    best = [float("inf")] * len(layers)
    for _ in range(repeats):
        spent = [0.0] * len(layers)
        x = sample_input
        for i, layer in enumerate(layers):
            start = time.perf_counter()
            x = layer.forward(x)
            spent[i] += time.perf_counter() - start
        g = array_namespace(x).ones_like(x)
        for i in reversed(range(len(layers))):
            start = time.perf_counter()
            g = layers[i].backward(g)
            spent[i] += time.perf_counter() - start
        best = [min(b, s) for b, s in zip(best, spent, strict=True)]
    for layer in layers:
        layer.zero_grad()
    return best


def _costs(layers: Sequence[Module], by: str, sample_input: Any) -> list[float]:
    if by == "params":
        return parameter_costs(layers)
    if by == "time":
        if sample_input is None:
            raise ValueError('by="time" measures the layers on a sample input: pass sample_input')
        return measured_costs(layers, sample_input)
    raise ValueError(f'by must be "params" or "time", got {by!r}')


def split_sequential(
    model: Sequential, num_stages: int, by: str = "params", sample_input: Any = None
) -> list[Sequential]:
    """``model``'s layers cut into ``num_stages`` stages (the layers are shared, not copied)."""
    layers = list(model)
    ranges = balance(_costs(layers, by, sample_input), num_stages)
    return [Sequential(*[layers[i] for i in r]) for r in ranges]


class GPTEmbedding(Composite):
    """The GPT's token and position embeddings and dropout: the first stage's first layer."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.block_size = gpt.config.block_size

    def forward(self, idx: Any) -> Any:
        if idx.ndim != 2 or idx.shape[1] > self.block_size:
            raise ValueError(
                f"GPT takes token ids (batch, time <= {self.block_size}), got {tuple(idx.shape)}"
            )
        xp = array_namespace(idx)
        x = self.wte.forward(idx) + self.wpe.forward(xp.arange(idx.shape[1]))
        return self.drop.forward(x)

    def _backward(self, grad_output: Any, step: Step) -> Any:
        g = step(self.drop, grad_output)
        step(self.wpe, g.sum(axis=0))
        step(self.wte, g)
        return None  # no gradient for integer tokens


class GPTHead(Composite):
    """The GPT's final LayerNorm and output head: the last stage's last layer."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: Any) -> Any:
        return self.head.forward(self.ln_f.forward(x))

    def _backward(self, grad_output: Any, step: Step) -> Any:
        return step(self.ln_f, step(self.head, grad_output))


def gpt_layers(gpt: GPT) -> list[Module]:
    """The GPT as a list of pipeline layers: embedding, each block, head."""
    if gpt.config.tie_weights:
        raise ValueError(
            "this GPT ties its head to the token embedding (tie_weights=True), so the first and "
            "last stages would share a weight: build it with GPTConfig(tie_weights=False) to "
            "pipeline it"
        )
    return [GPTEmbedding(gpt), *gpt.blocks, GPTHead(gpt)]


def split_gpt(
    gpt: GPT, num_stages: int, by: str = "params", sample_input: Any = None
) -> list[Sequential]:
    """The GPT cut into ``num_stages`` stages at block boundaries (parameters shared)."""
    return split_sequential(Sequential(*gpt_layers(gpt)), num_stages, by, sample_input)
