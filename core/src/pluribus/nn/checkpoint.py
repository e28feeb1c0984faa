"""Activation checkpointing: keep a unit's input, recompute its activations in backward.

Memory for compute: a checkpointed unit holds only its input between forward and backward
(instead of every intermediate array), and runs its forward a second time when backward reaches
it. Dropout draws the same masks the second time (its random state is saved and restored), so
the gradients equal those of the plain unit exactly. Batch-norm running statistics are updated
again by the recomputation, as in torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .module import Module


class Checkpoint(Module):
    """Wrap ``module`` so that its activations are recomputed in backward.

    The wrapper is transparent to names: parameters, buffers and ``state_dict`` keys are the
    wrapped module's own (as torch's ``checkpoint_wrapper`` arranges), so a checkpoint saved
    with or without it loads into either.
    """

    def __init__(self, module: Module):
        super().__init__()
        self.module = module

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        yield from self.module.named_modules(prefix)

    def _random_states(self) -> dict[int, Any]:
        return {
            id(m): m.get_rng_state()
            for _, m in self.module.named_modules()
            if hasattr(m, "get_rng_state")
        }

    def forward(self, *args: Any) -> Any:
        states = self._random_states()
        output = self.module.forward(*args)
        self.module.release_saved()  # the point: nothing of the unit's activations stays
        self.save_for_backward(args=args, random_states=states, training=self.module.training)
        return output

    def _recompute(self) -> None:
        args, states, training = self.saved("args", "random_states", "training")
        modules = {id(m): m for _, m in self.module.named_modules()}
        for key, state in states.items():
            modules[key].set_rng_state(state)
        was_training = self.module.training
        self.module.train(training)
        try:
            self.module.forward(*args)
        finally:
            self.module.train(was_training)
        self.release_saved(recurse=False)

    def backward(self, grad_output: Any) -> Any:
        self._recompute()
        return self.module.backward(grad_output)

    def backward_input(self, grad_output: Any) -> Any:
        self._recompute()
        return self.module.backward_input(grad_output)

    def backward_weight(self) -> None:
        self.module.backward_weight()

    def __repr__(self) -> str:
        return f"Checkpoint({self.module!r})"
