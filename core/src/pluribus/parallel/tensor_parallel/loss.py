"""Cross-entropy of logits whose classes are split over a 1-d mesh (Megatron's vocab-parallel
cross-entropy, torch's ``loss_parallel``): a column-parallel head with
``output_layouts=Shard(-1)`` leaves each rank the logits of its part of the vocabulary, and the
loss is computed from those parts without ever gathering them. That saves the memory of the
whole ``(tokens, vocabulary)`` logits, the largest activation of a language model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import distributed as dist
from ...dtensor.layout import split_sizes
from ...mesh import DeviceMesh
from ...nn.module import Module, array_namespace


class VocabParallelCrossEntropyLoss(Module):
    """``nn.CrossEntropyLoss`` (``ignore_index``, ``label_smoothing``, the mean over the kept
    rows) of logits ``(N, this rank's classes)``, split by the array_split rule over
    ``device_mesh``, against the whole labels ``(N,)`` on every rank. ``forward`` returns the
    loss, the same on every rank; ``backward`` the gradient of this rank's logits.

    Per forward: an all-gather of each rank's class count (which also checks the split), then
    two all-reduces, of ``N`` and ``3 N`` numbers: the rows' maxima, then their sums of
    exponentials, target logits and logit sums (for label smoothing) together, in float32 at
    least. Every rank of the mesh calls it with the same labels."""

    def __init__(
        self, device_mesh: DeviceMesh, ignore_index: int = -100, label_smoothing: float = 0.0
    ):
        super().__init__()
        if device_mesh.ndim != 1:
            raise ValueError(
                f"rank {dist.get_rank()}: VocabParallelCrossEntropyLoss takes the 1-d "
                f"tensor-parallel mesh, got shape {device_mesh.shape}"
            )
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        self.device_mesh, self.ignore_index = device_mesh, ignore_index
        self.label_smoothing = label_smoothing

    def _classes_and_first(self, xp: Any, local: int) -> tuple[int, int]:
        """(classes on all ranks, this rank's first), from every rank's count (exchanged on
        every call: a count one rank remembered would leave the others waiting), in the
        logits' array library (an nccl-only world carries cupy arrays only)."""
        mesh, me = self.device_mesh, self.device_mesh.get_local_rank()
        counts = [xp.zeros(1, np.int64) for _ in range(mesh.size())]
        dist.all_gather(counts, xp.asarray([local], np.int64), group=mesh.get_group())
        counts = [int(c[0]) for c in counts]
        total = sum(counts)
        if tuple(counts) != split_sizes(total, len(counts)):
            raise ValueError(
                f"rank {dist.get_rank()}: VocabParallelCrossEntropyLoss takes logits split "
                f"by the array_split rule ({list(split_sizes(total, len(counts)))} classes "
                f"for the ranks of the mesh), got {counts}"
            )
        return total, sum(counts[:me])

    def forward(self, logits: Any, target: Any) -> Any:
        xp = array_namespace(logits)
        if logits.ndim != 2 or target.shape != logits.shape[:1]:
            raise ValueError(
                f"rank {dist.get_rank()}: VocabParallelCrossEntropyLoss takes logits (N, this "
                f"rank's classes) and labels (N,), got {tuple(logits.shape)} and "
                f"{tuple(target.shape)}; flatten batch and sequence first"
            )
        if target.dtype.kind not in "iu":
            raise TypeError(f"labels must be integers, got dtype {target.dtype}")
        classes, first = self._classes_and_first(xp, int(logits.shape[1]))
        target = target.astype(np.int64)  # target - first in a narrow or unsigned type wraps
        keep = target != self.ignore_index
        bad = keep & ((target < 0) | (target >= classes))
        if bool(bad.any()):
            raise IndexError(
                f"rank {dist.get_rank()}: VocabParallelCrossEntropyLoss got label "
                f"{int(target[bad][0])}, outside 0..{classes - 1} (and not "
                f"ignore_index={self.ignore_index})"
            )
        group, n = self.device_mesh.get_group(), logits.shape[0]
        top = logits.max(axis=1) if logits.shape[1] else xp.full(n, -xp.inf, logits.dtype)
        dist.all_reduce(top, dist.ReduceOp.MAX, group)
        shifted = logits - top[:, None]
        exp = xp.exp(shifted)
        local = target - first
        mine = keep & (local >= 0) & (local < logits.shape[1])
        rows = xp.arange(n)
        wide = np.promote_types(logits.dtype, np.float32)  # float16 sums overflow at 65504
        sums = xp.zeros((3, n), wide)
        sums[0] = exp.sum(axis=1, dtype=wide)
        if logits.shape[1]:  # a rank may hold no classes (more ranks than classes)
            sums[1] = xp.where(mine, shifted[rows, xp.where(mine, local, 0)], 0)
        sums[2] = shifted.sum(axis=1, dtype=wide)
        dist.all_reduce(sums, dist.ReduceOp.SUM, group)
        exp_sum, label_logit, logit_sum = sums  # over every class, each row
        log_total = xp.log(exp_sum)
        picked = label_logit - log_total  # the log-probability of each row's label
        eps = self.label_smoothing
        per_row = (
            -picked if eps == 0 else -(1 - eps) * picked - eps * (logit_sum / classes - log_total)
        )
        count = int(keep.sum())
        probs = (exp / exp_sum[:, None]).astype(logits.dtype, copy=False)
        self.save_for_backward(
            probs=probs, local=local, mine=mine, keep=keep, count=count, classes=classes
        )
        if count == 0:  # every label ignored: torch's mean over nothing
            return xp.asarray(float("nan"), dtype=logits.dtype)
        return ((per_row * keep).sum() / count).astype(logits.dtype)

    def backward(self, grad_output: Any = 1.0) -> Any:
        probs, local, mine, keep, count, classes = self.saved(
            "probs", "local", "mine", "keep", "count", "classes"
        )
        self.release_saved(recurse=False)
        xp = array_namespace(probs)
        eps = self.label_smoothing
        grad = probs - eps / classes if eps else probs.copy()
        rows = xp.arange(grad.shape[0])[mine]
        grad[rows, local[mine]] -= 1 - eps
        grad *= keep[:, None]
        return grad * (grad_output / max(count, 1))

    def __repr__(self) -> str:
        return f"VocabParallelCrossEntropyLoss({self.device_mesh!r})"
