"""Reference layers: small, readable, on whatever array namespace their input comes from.

Each layer keeps in ``forward`` what its ``backward`` needs (one forward, then one backward), and
passes parameter gradients to :meth:`Parameter.accumulate_grad`. Shapes follow torch: ``Linear``
weights are ``(out_features, in_features)``, batch dimensions come first.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .module import Module, Parameter, array_namespace


def _rng(seed_or_rng: Any) -> np.random.Generator:
    if isinstance(seed_or_rng, np.random.Generator):
        return seed_or_rng
    return np.random.default_rng(seed_or_rng)


class Linear(Module):
    """``y = x @ W.T + b`` over the last dimension; torch's default initialisation."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: Any = np.float32,
        rng: Any = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bound = 1.0 / math.sqrt(in_features)
        rng = _rng(rng)
        self.weight = Parameter(
            rng.uniform(-bound, bound, (out_features, in_features)).astype(dtype)
        )
        self.bias = (
            Parameter(rng.uniform(-bound, bound, out_features).astype(dtype)) if bias else None
        )
        self._input: Any = None

    def forward(self, x: Any) -> Any:
        self._input = x
        y = x @ self.weight.data.T
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, grad_output: Any) -> Any:
        x = self._input.reshape(-1, self.in_features)
        g = grad_output.reshape(-1, self.out_features)
        grad_input = (g @ self.weight.data).reshape(self._input.shape)
        # bias first: backward visits parameters in reverse definition order, as DDP buckets do
        if self.bias is not None:
            self.bias.accumulate_grad(g.sum(axis=0))
        self.weight.accumulate_grad(g.T @ x)
        self._input = None
        return grad_input

    def __repr__(self) -> str:
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias is not None})"


class ReLU(Module):
    def forward(self, x: Any) -> Any:
        self._mask = x > 0
        return x * self._mask

    def backward(self, grad_output: Any) -> Any:
        return grad_output * self._mask


class Tanh(Module):
    def forward(self, x: Any) -> Any:
        self._out = array_namespace(x).tanh(x)
        return self._out

    def backward(self, grad_output: Any) -> Any:
        return grad_output * (1 - self._out * self._out)


class GELU(Module):
    """GELU with the tanh approximation (torch's ``approximate="tanh"``): numpy has no erf."""

    _C = math.sqrt(2.0 / math.pi)

    def forward(self, x: Any) -> Any:
        xp = array_namespace(x)
        self._x = x
        self._t = xp.tanh(self._C * (x + 0.044715 * x**3))
        return 0.5 * x * (1 + self._t)

    def backward(self, grad_output: Any) -> Any:
        x, t = self._x, self._t
        dt = (1 - t * t) * self._C * (1 + 3 * 0.044715 * x * x)
        return grad_output * (0.5 * (1 + t) + 0.5 * x * dt)


class Dropout(Module):
    """Zeroes each element with probability ``p`` in training and scales the rest by 1/(1-p)."""

    def __init__(self, p: float = 0.5, seed: int | None = None):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"Dropout probability must be in [0, 1), got {p}")
        self.p, self.seed = p, seed
        self._rngs: dict[Any, Any] = {}

    def forward(self, x: Any) -> Any:
        if not self.training or self.p == 0:
            self._mask = None
            return x
        xp = array_namespace(x)
        rng = self._rngs.get(xp)
        if rng is None:
            rng = self._rngs[xp] = xp.random.default_rng(self.seed)
        keep = rng.random(x.shape) >= self.p
        self._mask = keep.astype(x.dtype) / (1 - self.p)
        return x * self._mask

    def backward(self, grad_output: Any) -> Any:
        return grad_output if self._mask is None else grad_output * self._mask


class BatchNorm1d(Module):
    """Batch normalisation over ``(N, C)`` or ``(N, C, L)`` inputs, per channel ``C``.

    Training normalises with the batch's biased variance and updates running statistics with the
    unbiased one, as torch does. The two ``_reduce_*`` methods are where
    :class:`~pluribus.parallel.SyncBatchNorm` makes the statistics span the whole group.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        dtype: Any = np.float32,
    ):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = Parameter(np.ones(num_features, dtype=dtype))
            self.bias = Parameter(np.zeros(num_features, dtype=dtype))
        if track_running_stats:
            self.register_buffer("running_mean", np.zeros(num_features, dtype=dtype))
            self.register_buffer("running_var", np.ones(num_features, dtype=dtype))
            self.register_buffer("num_batches_tracked", np.zeros((), dtype=np.int64))

    def _axes(self, x: Any) -> tuple[int, ...]:
        if x.ndim not in (2, 3) or x.shape[1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__}({self.num_features}) expects (N, {self.num_features}) "
                f"or (N, {self.num_features}, L) input, got shape {tuple(x.shape)}"
            )
        return (0,) if x.ndim == 2 else (0, 2)

    def _channel(self, v: Any, ndim: int) -> Any:
        return v if ndim == 2 else v[:, None]

    def _reduce_stats(self, x: Any, axes: tuple[int, ...]) -> tuple[Any, Any, int]:
        """Mean, biased variance and element count per channel of this batch."""
        count = x.size // x.shape[1]
        mean = x.mean(axis=axes)
        centered = x - self._channel(mean, x.ndim)
        var = (centered * centered).mean(axis=axes)
        return mean, var, count

    def _reduce_grad_sums(self, sum_dy: Any, sum_dy_xhat: Any) -> tuple[Any, Any]:
        """The per-channel sums backward needs; here over the local batch only."""
        return sum_dy, sum_dy_xhat

    def forward(self, x: Any) -> Any:
        axes = self._axes(x)
        use_batch = self.training or not self.track_running_stats
        if use_batch:
            mean, var, count = self._reduce_stats(x, axes)
            if self.training and self.track_running_stats:
                m = self.momentum
                unbiased = var * (count / max(count - 1, 1))
                self.running_mean[...] = (1 - m) * self.running_mean + m * mean
                self.running_var[...] = (1 - m) * self.running_var + m * unbiased
                self.num_batches_tracked[...] += 1
        else:
            mean, var = self.running_mean, self.running_var
        xp = array_namespace(x)
        invstd = 1.0 / xp.sqrt(var + self.eps)
        xhat = (x - self._channel(mean, x.ndim)) * self._channel(invstd, x.ndim)
        self._cache = (xhat, invstd, axes, use_batch, count if use_batch else None)
        if self.affine:
            return xhat * self._channel(self.weight.data, x.ndim) + self._channel(
                self.bias.data, x.ndim
            )
        return xhat

    def backward(self, grad_output: Any) -> Any:
        xhat, invstd, axes, use_batch, count = self._cache
        ndim = grad_output.ndim
        local_dy = grad_output.sum(axis=axes)
        local_dy_xhat = (grad_output * xhat).sum(axis=axes)
        gamma = self.weight.data if self.affine else 1.0
        if self.affine:
            self.bias.accumulate_grad(local_dy)
            self.weight.accumulate_grad(local_dy_xhat)
        scale = self._channel(gamma * invstd, ndim)
        if not use_batch:  # running statistics are constants
            return grad_output * scale
        sum_dy, sum_dy_xhat = self._reduce_grad_sums(local_dy, local_dy_xhat)
        mean_dy = self._channel(sum_dy / count, ndim)
        mean_dy_xhat = self._channel(sum_dy_xhat / count, ndim)
        return scale * (grad_output - mean_dy - xhat * mean_dy_xhat)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_features}, eps={self.eps})"


class LayerNorm(Module):
    """Normalises over the last dimension, with a learned per-feature scale and shift."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, dtype: Any = np.float32):
        super().__init__()
        self.normalized_shape, self.eps = normalized_shape, eps
        self.weight = Parameter(np.ones(normalized_shape, dtype=dtype))
        self.bias = Parameter(np.zeros(normalized_shape, dtype=dtype))

    def forward(self, x: Any) -> Any:
        xp = array_namespace(x)
        mean = x.mean(axis=-1, keepdims=True)
        centered = x - mean
        invstd = 1.0 / xp.sqrt((centered * centered).mean(axis=-1, keepdims=True) + self.eps)
        self._xhat, self._invstd = centered * invstd, invstd
        return self._xhat * self.weight.data + self.bias.data

    def backward(self, grad_output: Any) -> Any:
        xhat, invstd = self._xhat, self._invstd
        n = self.normalized_shape
        g2 = grad_output.reshape(-1, n)
        self.bias.accumulate_grad(g2.sum(axis=0))
        self.weight.accumulate_grad((g2 * xhat.reshape(-1, n)).sum(axis=0))
        gx = grad_output * self.weight.data
        return invstd * (
            gx - gx.mean(axis=-1, keepdims=True) - xhat * (gx * xhat).mean(axis=-1, keepdims=True)
        )

    def __repr__(self) -> str:
        return f"LayerNorm({self.normalized_shape}, eps={self.eps})"


def _scatter_add(xp: Any, target: Any, indices: Any, values: Any) -> None:
    if xp is np:
        np.add.at(target, indices, values)
    else:  # cupy
        import cupyx

        cupyx.scatter_add(target, indices, values)


class Embedding(Module):
    """Rows of a table looked up by integer indices; no gradient flows to the indices."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: Any = np.float32, rng: Any = None
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(
            _rng(rng).standard_normal((num_embeddings, embedding_dim)).astype(dtype)
        )

    def forward(self, indices: Any) -> Any:
        self._indices = indices
        return self.weight.data[indices]

    def backward(self, grad_output: Any) -> None:
        xp = array_namespace(grad_output)
        grad = xp.zeros_like(self.weight.data)
        _scatter_add(
            xp, grad, self._indices.reshape(-1), grad_output.reshape(-1, self.embedding_dim)
        )
        self.weight.accumulate_grad(grad)
        return None

    def __repr__(self) -> str:
        return f"Embedding({self.num_embeddings}, {self.embedding_dim})"
