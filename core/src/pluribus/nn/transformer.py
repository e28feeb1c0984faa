"""A small GPT: causal self-attention, pre-norm transformer blocks, and the model around them.

The model the parallel layers are shown and measured on. Shapes are ``(batch, time, channels)``
as in nanoGPT; parameter names follow this file (``blocks.0.attn.qkv.weight``). Every backward
also comes split (``backward_input`` then ``backward_weight``) through :class:`Composite`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .layers import GELU, Dropout, Embedding, LayerNorm, Linear, _rng
from .module import Composite, Module, Parameter, Sequential, array_namespace

Step = Callable[[Module, Any], Any]


def _normal_(param: Parameter, std: float, rng: np.random.Generator) -> None:
    """GPT-2's initialisation: N(0, std) weights (biases stay at zero)."""
    param.data[...] = rng.normal(0.0, std, param.data.shape).astype(param.data.dtype)


class CausalSelfAttention(Composite):
    """Multi-head attention in which position ``t`` sees positions ``0..t`` only.

    ``fused_qkv=True`` projects queries, keys and values with one ``Linear(C, 3C)`` (``qkv``);
    ``False`` with three ``Linear(C, C)`` (``query``, ``key``, ``value``), the layout tensor
    parallelism splits by head. ``proj`` maps the heads back to ``C``. ``dropout`` applies to the
    attention weights and to the output, as in GPT-2.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        fused_qkv: bool = True,
        dtype: Any = np.float32,
        rng: Any = None,
    ):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(
                f"CausalSelfAttention: embed_dim {embed_dim} is not a multiple of num_heads "
                f"{num_heads}; each head gets embed_dim // num_heads channels"
            )
        rng = _rng(rng)
        self.embed_dim, self.num_heads, self.fused_qkv = embed_dim, num_heads, fused_qkv
        self.head_dim = embed_dim // num_heads
        if fused_qkv:
            self.qkv = Linear(embed_dim, 3 * embed_dim, bias=bias, dtype=dtype, rng=rng)
            for param in self.qkv.parameters():  # q, k and v, one after the other
                param.blocks = 3
        else:
            self.query = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, rng=rng)
            self.key = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, rng=rng)
            self.value = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, rng=rng)
        self.attn_dropout = Dropout(dropout, seed=int(rng.integers(2**31)))
        self.proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, rng=rng)
        self.resid_dropout = Dropout(dropout, seed=int(rng.integers(2**31)))

    def _heads(self, x: Any) -> Any:
        """(B, T, C) -> (B, H, T, D)."""
        b, t, _ = x.shape
        return x.reshape(b, t, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def _merge(self, x: Any) -> Any:
        """(B, H, T, D) -> (B, T, C)."""
        b, _, t, _ = x.shape
        return x.transpose(0, 2, 1, 3).reshape(b, t, self.num_heads * self.head_dim)

    def forward(self, x: Any) -> Any:
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"CausalSelfAttention({self.embed_dim}) takes (batch, time, {self.embed_dim}) "
                f"inputs, got shape {tuple(x.shape)}"
            )
        xp = array_namespace(x)
        c = self.num_heads * self.head_dim  # fewer than embed_dim under tensor parallelism
        if self.fused_qkv:
            qkv = self.qkv.forward(x)
            q, k, v = qkv[..., :c], qkv[..., c : 2 * c], qkv[..., 2 * c :]
        else:
            q, k, v = self.query.forward(x), self.key.forward(x), self.value.forward(x)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        t = x.shape[1]
        scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(self.head_dim))
        future = xp.triu(xp.ones((t, t), dtype=bool), k=1)
        scores = xp.where(future, -xp.inf, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        weights = xp.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        dropped = self.attn_dropout.forward(weights)
        self.save_for_backward(q=q, k=k, v=v, weights=weights, dropped=dropped)
        return self.resid_dropout.forward(self.proj.forward(self._merge(dropped @ v)))

    def _backward(self, grad_output: Any, step: Step) -> Any:
        q, k, v, weights, dropped = self.saved("q", "k", "v", "weights", "dropped")
        xp = array_namespace(grad_output)
        g = step(self.resid_dropout, grad_output)
        g_heads = self._heads(step(self.proj, g))
        grad_v = dropped.transpose(0, 1, 3, 2) @ g_heads
        grad_weights = step(self.attn_dropout, g_heads @ v.transpose(0, 1, 3, 2))
        # softmax: dS = P * (dP - sum(dP * P)); masked entries have P = 0 and get no gradient
        grad_scores = weights * (
            grad_weights - (grad_weights * weights).sum(axis=-1, keepdims=True)
        )
        grad_scores *= 1.0 / math.sqrt(self.head_dim)
        grad_q = grad_scores @ k
        grad_k = grad_scores.transpose(0, 1, 3, 2) @ q
        self.release_saved(recurse=False)
        grad_q, grad_k, grad_v = self._merge(grad_q), self._merge(grad_k), self._merge(grad_v)
        if self.fused_qkv:
            return step(self.qkv, xp.concatenate([grad_q, grad_k, grad_v], axis=-1))
        grad_input = step(self.value, grad_v)  # reverse definition order, as DDP buckets go
        grad_input = grad_input + step(self.key, grad_k)
        return grad_input + step(self.query, grad_q)

    def __repr__(self) -> str:
        return (
            f"CausalSelfAttention({self.embed_dim}, heads={self.num_heads}, "
            f"fused_qkv={self.fused_qkv})"
        )


class TransformerBlock(Composite):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` with a 4x GELU MLP."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        fused_qkv: bool = True,
        gelu: str = "tanh",
        mlp_ratio: int = 4,
        dtype: Any = np.float32,
        rng: Any = None,
    ):
        super().__init__()
        rng = _rng(rng)
        hidden = mlp_ratio * embed_dim
        self.ln1 = LayerNorm(embed_dim, dtype=dtype)
        self.attn = CausalSelfAttention(
            embed_dim, num_heads, dropout, bias, fused_qkv, dtype=dtype, rng=rng
        )
        self.ln2 = LayerNorm(embed_dim, dtype=dtype)
        self.mlp = Sequential(
            Linear(embed_dim, hidden, bias=bias, dtype=dtype, rng=rng),
            GELU(approximate=gelu),
            Linear(hidden, embed_dim, bias=bias, dtype=dtype, rng=rng),
            Dropout(dropout, seed=int(rng.integers(2**31))),
        )

    def forward(self, x: Any) -> Any:
        x = x + self.attn.forward(self.ln1.forward(x))
        return x + self.mlp.forward(self.ln2.forward(x))

    def _backward(self, grad_output: Any, step: Step) -> Any:
        g = grad_output + step(self.ln2, step(self.mlp, grad_output))
        return g + step(self.ln1, step(self.attn, g))


@dataclass
class GPTConfig:
    """Sizes of a :class:`GPT`; ``PRESETS`` names a few."""

    vocab_size: int = 128
    block_size: int = 64  # the longest context
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True  # the head reuses the token embedding's matrix
    fused_qkv: bool = True
    gelu: str = "tanh"  # GPT-2's; "none" is exact (slower on numpy)


#: Named sizes for the examples and benchmarks (parameter counts at vocab_size=128, tied).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},  # tests
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},  # ~0.8 M
    "10M": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256},  # ~10.8 M
    "100M": {"n_layer": 14, "n_head": 12, "n_embd": 768, "block_size": 512},  # ~99.7 M
}


class GPT(Composite):
    """Token and position embeddings, ``n_layer`` blocks, a final LayerNorm and a linear head.

    ``forward(idx)`` takes integer tokens ``(B, T)`` with ``T <= block_size`` and returns logits
    ``(B, T, vocab_size)``. With ``tie_weights`` the head's weight is the token embedding's
    ``Parameter`` (named once, ``wte.weight``; its gradient arrives twice per backward).
    """

    def __init__(self, config: GPTConfig, dtype: Any = np.float32, rng: Any = None):
        super().__init__()
        rng = _rng(rng)
        self.config = config
        c = config
        self.wte = Embedding(c.vocab_size, c.n_embd, dtype=dtype, rng=rng)
        self.wpe = Embedding(c.block_size, c.n_embd, dtype=dtype, rng=rng)
        self.drop = Dropout(c.dropout, seed=int(rng.integers(2**31)))
        self.blocks = Sequential(
            *[
                TransformerBlock(
                    c.n_embd,
                    c.n_head,
                    c.dropout,
                    c.bias,
                    c.fused_qkv,
                    c.gelu,
                    dtype=dtype,
                    rng=rng,
                )
                for _ in range(c.n_layer)
            ]
        )
        self.ln_f = LayerNorm(c.n_embd, dtype=dtype)
        self.head = Linear(c.n_embd, c.vocab_size, bias=False, dtype=dtype, rng=rng)
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.data.ndim == 2:
                # residual projections scaled down with depth, as GPT-2 does
                residual = name.endswith(("attn.proj.weight", "mlp.2.weight"))
                _normal_(param, 0.02 / math.sqrt(2 * c.n_layer) if residual else 0.02, rng)
            elif name.endswith("bias"):
                param.data[...] = 0  # LayerNorm biases are zero already
        if c.tie_weights:
            self.head.weight = self.wte.weight

    def forward(self, idx: Any) -> Any:
        if idx.ndim != 2:
            raise ValueError(f"GPT takes token ids (batch, time), got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(
                f"GPT got a sequence of {t} tokens but block_size is {self.config.block_size}: "
                "crop the context to the last block_size tokens"
            )
        xp = array_namespace(idx)
        x = self.wte.forward(idx) + self.wpe.forward(xp.arange(t))
        x = self.blocks.forward(self.drop.forward(x))
        return self.head.forward(self.ln_f.forward(x))

    def _backward(self, grad_output: Any, step: Step) -> Any:
        g = step(self.ln_f, step(self.head, grad_output))
        g = step(self.drop, step(self.blocks, g))
        step(self.wpe, g.sum(axis=0))
        step(self.wte, g)
        return None  # no gradient for integer tokens

    def num_parameters(self) -> int:
        return sum(int(p.data.size) for p in self.parameters())

    def generate(self, idx: Any, max_new_tokens: int, temperature: float = 1.0, rng: Any = None):
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); eval mode, no gradient."""
        xp = array_namespace(idx)
        sampler = _rng(rng)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                context = idx[:, -self.config.block_size :]
                logits = self.forward(context)[:, -1, :].astype(np.float64) / temperature
                self.release_saved()
                if logits.shape[-1] != self.config.vocab_size:
                    raise ValueError(
                        f"GPT.generate samples from the logits of all {self.config.vocab_size} "
                        f"tokens, got {logits.shape[-1]}: a vocabulary-parallel head gives each "
                        "rank its part; generate with a head that gathers them "
                        "(ColwiseParallel(output_layouts=Replicate()))"
                    )
                logits = logits - logits.max(axis=-1, keepdims=True)
                probs = xp.exp(logits)
                probs /= probs.sum(axis=-1, keepdims=True)
                host = probs.get() if xp is not np else probs
                picks = [sampler.choice(host.shape[1], p=row) for row in host]
                idx = xp.concatenate([idx, xp.asarray(picks, dtype=idx.dtype)[:, None]], axis=1)
        finally:
            self.train(was_training)
        return idx

    def __repr__(self) -> str:
        c = self.config
        return (
            f"GPT(layers={c.n_layer}, heads={c.n_head}, embd={c.n_embd}, vocab={c.vocab_size}, "
            f"block={c.block_size}, params={self.num_parameters():,})"
        )
