"""Reference layers: small, readable, on whatever array namespace their input comes from.

Each layer keeps in ``forward`` what its ``backward`` needs (one forward, then one backward), and
passes parameter gradients to :meth:`Parameter.accumulate_grad`. Shapes follow torch: ``Linear``
weights are ``(out_features, in_features)``, batch dimensions come first.
"""

from __future__ import annotations

import copy
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
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self!r} expects inputs whose last dimension is {self.in_features}, got shape "
                f"{tuple(x.shape)}"
            )
        _check_table(self, self.weight, (self.out_features, self.in_features))
        self.save_for_backward(input=x)
        y = x @ self.weight.data.T
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, grad_output: Any) -> Any:
        grad_input = self.backward_input(grad_output)
        self.backward_weight()
        return grad_input

    def backward_input(self, grad_output: Any) -> Any:
        x = self.saved("input")
        g = _matrix(grad_output)
        self.save_for_backward(grad_output=g)
        return (g @ self.weight.data).reshape(x.shape)

    def backward_weight(self) -> None:
        x, g = self.saved("input", "grad_output")
        # bias first: backward visits parameters in reverse definition order, as DDP buckets do
        if self.bias is not None:
            self.bias.accumulate_grad(g.sum(axis=0))
        self.weight.accumulate_grad(g.T @ _matrix(x))
        self.release_saved(recurse=False)

    def __repr__(self) -> str:
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias is not None})"


def _matrix(array: Any) -> Any:
    """``array`` as (rows, last dimension), also when that dimension is empty (a
    tensor-parallel rank may hold no features), where ``reshape(-1, 0)`` cannot tell the rows."""
    return array.reshape(math.prod(array.shape[:-1]), array.shape[-1])


class ReLU(Module):
    def forward(self, x: Any) -> Any:
        mask = x > 0
        self.save_for_backward(mask=mask)
        return x * mask

    def backward(self, grad_output: Any) -> Any:
        mask = self.saved("mask")
        self.release_saved(recurse=False)
        return grad_output * mask


class Tanh(Module):
    def forward(self, x: Any) -> Any:
        out = array_namespace(x).tanh(x)
        self.save_for_backward(output=out)
        return out

    def backward(self, grad_output: Any) -> Any:
        out = self.saved("output")
        self.release_saved(recurse=False)
        return grad_output * (1 - out * out)


def erf(x: Any) -> Any:
    """The error function elementwise, on numpy (scipy's when installed) or cupy arrays."""
    if array_namespace(x) is not np:
        import cupyx.scipy.special

        return cupyx.scipy.special.erf(x)
    try:
        from scipy.special import erf as scipy_erf
    except ImportError:  # exact but slow: one Python call per element
        return np.vectorize(math.erf, otypes=[x.dtype])(x)
    return scipy_erf(x)


class GELU(Module):
    """``x * Phi(x)``: exact (``approximate="none"``, torch's default, via erf) or with the
    tanh approximation (``approximate="tanh"``, GPT-2's choice and the faster one on numpy)."""

    _C = math.sqrt(2.0 / math.pi)

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Any) -> Any:
        xp = array_namespace(x)
        if self.approximate == "tanh":
            t = xp.tanh(x * (self._C + (self._C * 0.044715) * (x * x)))  # no pow: 10x faster
            self.save_for_backward(input=x, tanh=t)
            return 0.5 * x * (1 + t)
        cdf = 0.5 * (1 + erf(x * (1 / math.sqrt(2.0))))
        self.save_for_backward(input=x, cdf=cdf)
        return x * cdf

    def backward(self, grad_output: Any) -> Any:
        if self.approximate == "tanh":
            x, t = self.saved("input", "tanh")
            self.release_saved(recurse=False)
            dt = (1 - t * t) * self._C * (1 + 3 * 0.044715 * x * x)
            return grad_output * (0.5 * (1 + t) + 0.5 * x * dt)
        x, cdf = self.saved("input", "cdf")
        self.release_saved(recurse=False)
        pdf = array_namespace(x).exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
        return grad_output * (cdf + x * pdf)

    def __repr__(self) -> str:
        return f"GELU(approximate={self.approximate!r})"


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
            self.save_for_backward(mask=None)
            return x
        xp = array_namespace(x)
        rng = self._rngs.get(xp)
        if rng is None:
            rng = self._rngs[xp] = xp.random.default_rng(self.seed)
        keep = rng.random(x.shape) >= self.p
        mask = keep.astype(x.dtype) / (1 - self.p)
        self.save_for_backward(mask=mask)
        return x * mask

    def backward(self, grad_output: Any) -> Any:
        mask = self.saved("mask")
        self.release_saved(recurse=False)
        return grad_output if mask is None else grad_output * mask

    def reseed(self, seed: int) -> None:
        """Draw the masks from ``seed``'s stream from now on (tensor parallelism gives each
        rank one of its own where the ranks hold different parts)."""
        self.seed, self._rngs = seed, {}

    def get_rng_state(self) -> Any:
        """A copy of the random state, so a recomputed forward draws the same mask."""
        try:
            return {xp: copy.deepcopy(rng) for xp, rng in self._rngs.items()}
        except Exception as error:  # a generator that cannot be copied
            raise RuntimeError(
                f"Dropout cannot save its random state ({type(error).__name__}: {error}), so a "
                "recomputed forward would draw different masks; checkpoint units without "
                "dropout, or set its p to 0"
            ) from error

    def set_rng_state(self, state: Any) -> None:
        self._rngs = {xp: copy.deepcopy(rng) for xp, rng in state.items()}

    def __repr__(self) -> str:
        return f"Dropout(p={self.p})"


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
            if self.training and count <= 1:
                raise ValueError(
                    f"{type(self).__name__} in training needs more than one value per channel "
                    f"to compute a variance, got input shape {tuple(x.shape)} (the whole group's "
                    "batch for SyncBatchNorm): use a larger batch, or eval() to use the running "
                    "statistics"
                )
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
        self.save_for_backward(
            xhat=xhat,
            invstd=invstd,
            axes=axes,
            use_batch=use_batch,
            count=count if use_batch else 0,
        )
        if self.affine:
            return xhat * self._channel(self.weight.data, x.ndim) + self._channel(
                self.bias.data, x.ndim
            )
        return xhat

    def backward(self, grad_output: Any) -> Any:
        grad_input = self.backward_input(grad_output)
        self.backward_weight()
        return grad_input

    def backward_input(self, grad_output: Any) -> Any:
        xhat, invstd, axes, use_batch, count = self.saved(
            "xhat", "invstd", "axes", "use_batch", "count"
        )
        ndim = grad_output.ndim
        local_dy = grad_output.sum(axis=axes)
        local_dy_xhat = (grad_output * xhat).sum(axis=axes)
        self.save_for_backward(sum_dy=local_dy, sum_dy_xhat=local_dy_xhat)
        gamma = self.weight.data if self.affine else 1.0
        scale = self._channel(gamma * invstd, ndim)
        if not use_batch:  # running statistics are constants
            return grad_output * scale
        sum_dy, sum_dy_xhat = self._reduce_grad_sums(local_dy, local_dy_xhat)
        mean_dy = self._channel(sum_dy / count, ndim)
        mean_dy_xhat = self._channel(sum_dy_xhat / count, ndim)
        return scale * (grad_output - mean_dy - xhat * mean_dy_xhat)

    def backward_weight(self) -> None:
        if self.affine:
            sum_dy, sum_dy_xhat = self.saved("sum_dy", "sum_dy_xhat")
            self.bias.accumulate_grad(sum_dy)
            self.weight.accumulate_grad(sum_dy_xhat)
        self.release_saved(recurse=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_features}, eps={self.eps})"


class LayerNorm(Module):
    """Normalises over the trailing ``normalized_shape`` dimensions (an int means the last one),
    with a learned elementwise scale and shift of that shape, as torch does."""

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        dtype: Any = np.float32,
    ):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape, self.eps = tuple(int(n) for n in normalized_shape), eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = Parameter(np.ones(self.normalized_shape, dtype=dtype))
            self.bias = Parameter(np.zeros(self.normalized_shape, dtype=dtype))

    def _axes(self, x: Any) -> tuple[int, ...]:
        k = len(self.normalized_shape)
        if tuple(x.shape[x.ndim - k :]) != self.normalized_shape or x.ndim < k:
            raise ValueError(
                f"{self!r} normalises over trailing dimensions {self.normalized_shape}, but the "
                f"input has shape {tuple(x.shape)}"
            )
        return tuple(range(x.ndim - k, x.ndim))

    def forward(self, x: Any) -> Any:
        xp = array_namespace(x)
        axes = self._axes(x)
        mean = x.mean(axis=axes, keepdims=True)
        centered = x - mean
        invstd = 1.0 / xp.sqrt((centered * centered).mean(axis=axes, keepdims=True) + self.eps)
        xhat = centered * invstd
        self.save_for_backward(xhat=xhat, invstd=invstd)
        if not self.elementwise_affine:
            return xhat
        return xhat * self.weight.data + self.bias.data

    def backward(self, grad_output: Any) -> Any:
        grad_input = self.backward_input(grad_output)
        self.backward_weight()
        return grad_input

    def backward_input(self, grad_output: Any) -> Any:
        xhat, invstd = self.saved("xhat", "invstd")
        self.save_for_backward(grad_output=grad_output)
        axes = self._axes(grad_output)
        gx = grad_output * self.weight.data if self.elementwise_affine else grad_output
        return invstd * (
            gx
            - gx.mean(axis=axes, keepdims=True)
            - xhat * (gx * xhat).mean(axis=axes, keepdims=True)
        )

    def backward_weight(self) -> None:
        if self.elementwise_affine:
            xhat, grad_output = self.saved("xhat", "grad_output")
            shape = (-1, *self.normalized_shape)
            g = grad_output.reshape(shape)
            self.bias.accumulate_grad(g.sum(axis=0))
            self.weight.accumulate_grad((g * xhat.reshape(shape)).sum(axis=0))
        self.release_saved(recurse=False)

    def __repr__(self) -> str:
        return f"LayerNorm({self.normalized_shape}, eps={self.eps})"


def _check_table(layer: Module, weight: Parameter, shape: tuple[int, ...]) -> None:
    """Refuse a weight that no longer has the layer's shape: a parameter the layer shares with
    another (a tied head and token embedding) that was cut for that other layer alone."""
    if tuple(weight.data.shape) != shape:
        raise ValueError(
            f"{layer!r} holds a weight of shape {tuple(weight.data.shape)}, not {shape}: a "
            "parameter it shares with a layer that tensor parallelism split? Split this layer "
            "alike (a tied head ColwiseParallel, a tied token embedding RowwiseParallel)"
        )


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
        self._check_indices(indices)
        _check_table(self, self.weight, (self.num_embeddings, self.embedding_dim))
        self.save_for_backward(indices=indices)
        return self.weight.data[indices]

    def _check_indices(self, indices: Any) -> None:
        if indices.dtype.kind not in "iu":
            raise TypeError(f"{self!r} looks up integer indices, got dtype {indices.dtype}")
        if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= self.num_embeddings):
            raise IndexError(
                f"{self!r} got indices in [{int(indices.min())}, {int(indices.max())}], outside "
                f"0..{self.num_embeddings - 1}"
            )

    def backward(self, grad_output: Any) -> None:
        self.backward_input(grad_output)
        self.backward_weight()

    def backward_input(self, grad_output: Any) -> None:
        """No gradient flows to integer indices: only keep ``grad_output`` for the weight."""
        self.save_for_backward(grad_output=grad_output)
        return None

    def backward_weight(self) -> None:
        indices, grad_output = self.saved("indices", "grad_output")
        xp = array_namespace(grad_output)
        grad = xp.zeros_like(self.weight.data)
        _scatter_add(xp, grad, indices.reshape(-1), grad_output.reshape(-1, self.embedding_dim))
        self.weight.accumulate_grad(grad)
        self.release_saved(recurse=False)

    def __repr__(self) -> str:
        return f"Embedding({self.num_embeddings}, {self.embedding_dim})"
