"""Losses: ``forward(prediction, target)`` returns the mean loss as a 0-d array, ``backward()``
returns the gradient of that mean with respect to the prediction."""

from __future__ import annotations

from typing import Any

from .module import Module, array_namespace


class CrossEntropyLoss(Module):
    """Softmax cross-entropy of logits ``(N, C)`` against integer class labels ``(N,)``.

    As torch: rows whose label is ``ignore_index`` count for nothing (the mean is over the
    others; NaN when none is left), and ``label_smoothing`` mixes the one-hot target with the
    uniform distribution over the ``C`` classes. Any other label outside ``0..C-1`` is an error.
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0):
        super().__init__()
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def _check(self, xp: Any, logits: Any, target: Any) -> Any:
        if logits.ndim != 2 or target.shape != logits.shape[:1]:
            raise ValueError(
                f"CrossEntropyLoss takes logits (N, C) and labels (N,), got {tuple(logits.shape)} "
                f"and {tuple(target.shape)}; flatten batch and sequence first "
                "(logits.reshape(-1, C), labels.reshape(-1))"
            )
        if target.dtype.kind not in "iu":
            raise TypeError(f"CrossEntropyLoss labels must be integers, got dtype {target.dtype}")
        keep = target != self.ignore_index
        classes = logits.shape[1]
        bad = keep & ((target < 0) | (target >= classes))
        if bool(bad.any()):
            first = int(target[bad][0])
            raise IndexError(
                f"CrossEntropyLoss got label {first}, outside 0..{classes - 1} (and not "
                f"ignore_index={self.ignore_index}); labels are class indices"
            )
        return keep

    def forward(self, logits: Any, target: Any) -> Any:
        xp = array_namespace(logits)
        keep = self._check(xp, logits, target)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        exp = xp.exp(shifted)
        total = exp.sum(axis=-1, keepdims=True)
        log_probs = shifted - xp.log(total)
        rows = xp.arange(logits.shape[0])
        safe_target = xp.where(keep, target, 0)
        picked = log_probs[rows, safe_target]
        eps = self.label_smoothing
        per_row = -picked if eps == 0 else -(1 - eps) * picked - eps * log_probs.mean(axis=-1)
        count = int(keep.sum())
        self.save_for_backward(probs=exp / total, target=safe_target, keep=keep, count=count)
        if count == 0:  # every label ignored: torch's mean over nothing
            return xp.asarray(float("nan"), dtype=logits.dtype)
        return (per_row * keep).sum() / count

    def backward(self, grad_output: Any = 1.0) -> Any:
        probs, target, keep, count = self.saved("probs", "target", "keep", "count")
        self.release_saved(recurse=False)
        xp = array_namespace(probs)
        eps = self.label_smoothing
        grad = probs - eps / probs.shape[1] if eps else probs.copy()
        grad[xp.arange(grad.shape[0]), target] -= 1 - eps
        grad *= keep[:, None]
        return grad * (grad_output / max(count, 1))


class MSELoss(Module):
    """Mean of squared differences over every element."""

    def forward(self, prediction: Any, target: Any) -> Any:
        diff = prediction - target
        self.save_for_backward(diff=diff)
        return (diff * diff).mean()

    def backward(self, grad_output: Any = 1.0) -> Any:
        diff = self.saved("diff")
        self.release_saved(recurse=False)
        return diff * (2.0 * grad_output / diff.size)
