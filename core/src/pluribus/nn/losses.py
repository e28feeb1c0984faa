"""Losses: ``forward(prediction, target)`` returns the mean loss as a 0-d array, ``backward()``
returns the gradient of that mean with respect to the prediction."""

from __future__ import annotations

from typing import Any

from .module import Module, array_namespace


class CrossEntropyLoss(Module):
    """Softmax cross-entropy of logits ``(N, C)`` against integer class labels ``(N,)``."""

    def forward(self, logits: Any, target: Any) -> Any:
        xp = array_namespace(logits)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        exp = xp.exp(shifted)
        total = exp.sum(axis=-1, keepdims=True)
        self._probs = exp / total
        self._target = target
        rows = xp.arange(logits.shape[0])
        log_probs = shifted[rows, target] - xp.log(total[:, 0])
        return -log_probs.mean()

    def backward(self, grad_output: Any = 1.0) -> Any:
        xp = array_namespace(self._probs)
        grad = self._probs.copy()
        grad[xp.arange(grad.shape[0]), self._target] -= 1
        return grad * (grad_output / grad.shape[0])


class MSELoss(Module):
    """Mean of squared differences over every element."""

    def forward(self, prediction: Any, target: Any) -> Any:
        self._diff = prediction - target
        return (self._diff * self._diff).mean()

    def backward(self, grad_output: Any = 1.0) -> Any:
        return self._diff * (2.0 * grad_output / self._diff.size)
