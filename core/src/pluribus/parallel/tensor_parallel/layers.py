"""The layers whose forward changes when split: a row-parallel Linear sums its partial
products before adding its bias once, and a row-parallel Embedding holds rows of the
vocabulary and sums the ranks' lookups."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...dtensor import Partial, Shard
from ...nn.layers import Embedding, Linear, _scatter_add
from ...nn.module import array_namespace
from .boundaries import move


class RowParallelLinear(Linear):
    """A Linear whose partial products are reduced before the bias is added (once). What the
    reduction needs lives on the module (no closure over it), so a deep copy reduces its own."""

    def forward(self, x: Any) -> Any:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self!r} (row-parallel) expects this rank's {self.in_features} input features, "
                f"got shape {tuple(x.shape)}"
            )
        self.save_for_backward(input=x)
        y = x @ self.weight.data.T
        self._tp_output_shape = y.shape  # for the gradient's sizes
        y = move(y, self._tp_mesh, Partial(), self._tp_output_layout, self.out_features)
        if self.bias is not None:
            out = self._tp_output_layout
            bias = self.bias.data
            if isinstance(out, Shard) and out.dim % y.ndim == y.ndim - 1:
                bias = bias[self._tp_output_features]  # the output holds this rank's features
            y = y + bias
        return y


class VocabParallelEmbedding(Embedding):
    """An Embedding holding rows ``_tp_rows`` of the table (``num_embeddings`` stays the whole
    vocabulary): a token of another rank's rows looks up zeros here, and the ranks' lookups
    are summed (one all-reduce, or a reduce-scatter into this rank's part of the sequence).
    The gradient of the table is this rank's rows only."""

    def forward(self, indices: Any) -> Any:
        self._check_indices(indices)
        start, stop = self._tp_rows
        xp = array_namespace(self.weight.data)
        local = indices.astype(np.int64) - start  # in a narrow or unsigned type it would wrap
        mine = (local >= 0) & (local < stop - start)
        if stop > start:
            rows = self.weight.data[xp.where(mine, local, 0)]  # a new array: zeroed in place
            rows[~mine] = 0  # not a product: inf * 0 is nan
        else:  # no rows here (more ranks than tokens): zeros to sum
            rows = xp.zeros((*indices.shape, self.embedding_dim), self.weight.data.dtype)
        self.save_for_backward(local=local, mine=mine)
        out = self._tp_output_layout
        if isinstance(out, Shard):
            self._tp_output_rows = rows.shape[out.dim]  # for the gradient's sizes
        return move(rows, self._tp_mesh, Partial(), out, self.embedding_dim)

    def backward_weight(self) -> None:
        local, mine, grad_output = self.saved("local", "mine", "grad_output")
        xp = array_namespace(grad_output)
        grad = xp.zeros_like(self.weight.data)
        mine = mine.reshape(-1)
        rows = grad_output.reshape(-1, self.embedding_dim)[mine]
        _scatter_add(xp, grad, local.reshape(-1)[mine], rows)
        self.weight.accumulate_grad(grad)
        self.release_saved(recurse=False)
