"""One stage of a pipelined model: a module, its place in the pipeline, and the activations of
every micro-batch in flight.

Modules keep what backward needs in ``_saved`` (one forward at a time). A stage runs several
micro-batches' forwards before their backwards, so after each forward it takes the saved arrays
of every sub-module aside, keyed by micro-batch, and puts them back before that micro-batch's
backward (and again between ``backward_input`` and ``backward_weight``). The module needs no
change; the arrays taken aside are this stage's activation ledger.
"""

from __future__ import annotations

from typing import Any

from ...distributed import get_default_group
from ...nn.layers import GELU, Dropout, Linear, ReLU, Tanh
from ...nn.memory import _Counter, arrays_in
from ...nn.module import Module, Sequential


def _leaves(module: Module) -> list[Module]:
    """The layers of nested ``Sequential``s, in the order they run (other modules whole)."""
    if isinstance(module, Sequential):
        return [leaf for child in module for leaf in _leaves(child)]
    return [module]


def _features(module: Module, first: bool) -> int | None:
    """The input width of the stage's first layer (or output width of its last, looking past
    element-wise layers) when that layer is a ``Linear`` of nested ``Sequential``s; else None.
    Only then is the width certain: other modules may register layers in another order."""
    leaves = _leaves(module)
    if not first:
        leaves = [m for m in reversed(leaves) if not isinstance(m, _ELEMENTWISE)]
    if leaves and isinstance(leaves[0], Linear):
        return int(leaves[0].in_features if first else leaves[0].out_features)
    return None


_ELEMENTWISE = (ReLU, Tanh, GELU, Dropout)


class PipelineStage:
    """``module`` as stage ``stage_index`` of ``num_stages`` on this rank of ``group``."""

    def __init__(self, module: Module, stage_index: int, num_stages: int, group: Any = None):
        if not 0 <= stage_index < num_stages:
            raise ValueError(
                f"PipelineStage: stage_index {stage_index} is outside 0..{num_stages - 1}"
            )
        self.module = module
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group = group if group is not None else get_default_group()
        self._modules = [m for _, m in module.named_modules()]
        self._after_forward: dict[int, list[dict]] = {}
        self._after_input_grad: dict[int, list[dict]] = {}
        self.output_shapes: dict[int, tuple[int, ...]] = {}
        #: The most bytes of activations this stage held at once (reset by :meth:`reset_peak`).
        self.peak_activation_bytes = 0
        self.peak_microbatches = 0

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, {type(self.module).__name__})"

    def describe(self) -> dict[str, Any]:
        """What the other ranks check before the first step."""
        return {
            "stage": self.stage_index,
            "num_stages": self.num_stages,
            "in_features": _features(self.module, True),
            "out_features": _features(self.module, False),
        }

    # -- saved activations per micro-batch ------------------------------------------------------

    def _install(self, saved: list[dict] | None) -> None:
        for i, module in enumerate(self._modules):
            object.__setattr__(module, "_saved", {} if saved is None else saved[i])

    def _take(self) -> list[dict]:
        taken = [module._saved for module in self._modules]
        self._install(None)
        return taken

    def activation_bytes(self) -> int:
        """Bytes of the activations held for micro-batches in flight (each buffer once)."""
        held = list(self._after_forward.values()) + list(self._after_input_grad.values())
        return _Counter().add(arrays_in(held))

    def _account(self) -> None:
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.activation_bytes())
        self.peak_microbatches = max(self.peak_microbatches, len(self._after_forward))

    def reset_peak(self) -> None:
        self.peak_activation_bytes = self.peak_microbatches = 0

    def clear(self) -> None:
        """Forget every micro-batch in flight (after a failed step)."""
        self._after_forward.clear()
        self._after_input_grad.clear()
        self.output_shapes.clear()
        self._install(None)

    # -- the three computations ---------------------------------------------------------------

    def forward(self, microbatch: int, x: Any) -> Any:
        if microbatch in self._after_forward:
            raise RuntimeError(
                f"stage {self.stage_index}: micro-batch {microbatch} ran forward twice"
            )
        self._install(None)
        y = self.module.forward(x)
        self._after_forward[microbatch] = self._take()
        self.output_shapes[microbatch] = tuple(y.shape)
        self._account()
        return y

    def backward(self, microbatch: int, grad_output: Any, split: bool = False) -> Any:
        """The input gradient; with ``split`` the weight gradients wait for
        :meth:`backward_weight`."""
        self._install(self._after_forward.pop(microbatch))
        try:
            if split:
                grad_input = self.module.backward_input(grad_output)
                self._after_input_grad[microbatch] = self._take()
            else:
                grad_input = self.module.backward(grad_output)
        finally:
            self._install(None)
        self.output_shapes.pop(microbatch, None)
        return grad_input

    def backward_weight(self, microbatch: int) -> None:
        self._install(self._after_input_grad.pop(microbatch))
        try:
            self.module.backward_weight()
        finally:
            self._install(None)
