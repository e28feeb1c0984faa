"""Optimizers with torch's update rules, working in place on ``Parameter.data``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .module import Parameter, array_namespace


class Optimizer:
    """Holds parameters and per-parameter state arrays; ``step`` skips parameters with no grad."""

    def __init__(self, params: Iterable[Parameter], lr: float):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.lr = lr
        self.state: list[dict[str, Any]] = [{} for _ in self.params]
        self.step_count = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad[...] = 0

    def step(self) -> None:
        self.step_count += 1
        for param, state in zip(self.params, self.state, strict=True):
            if param.grad is not None:
                self._update(param, state)

    def _update(self, param: Parameter, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Flat name -> array mapping (``"3.exp_avg"``), ready for ``np.savez``."""
        flat: dict[str, Any] = {"step_count": np.array(self.step_count)}
        for i, state in enumerate(self.state):
            for key, value in state.items():
                flat[f"{i}.{key}"] = value.copy()
        return flat

    def load_state_dict(self, flat: dict[str, Any]) -> None:
        self.step_count = int(flat["step_count"])
        self.state = [{} for _ in self.params]
        for name, value in flat.items():
            if name == "step_count":
                continue
            index, key = name.split(".", 1)
            target = self.params[int(index)].data
            self.state[int(index)][key] = array_namespace(target).asarray(value, dtype=target.dtype)


class SGD(Optimizer):
    """SGD with optional momentum (torch's form: ``v = mu v + g; p -= lr v``) and L2 decay."""

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        super().__init__(params, lr)
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov

    def _update(self, param: Parameter, state: dict[str, Any]) -> None:
        grad = param.grad
        if self.weight_decay:
            grad = grad + self.weight_decay * param.data
        if self.momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.copy()
            else:
                buf *= self.momentum
                buf += grad
            grad = grad + self.momentum * buf if self.nesterov else buf
        param.data -= self.lr * grad


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), torch's defaults."""

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        super().__init__(params, lr)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay

    def _update(self, param: Parameter, state: dict[str, Any]) -> None:
        xp = array_namespace(param.data)
        beta1, beta2 = self.betas
        if "exp_avg" not in state:
            state["exp_avg"] = xp.zeros_like(param.data)
            state["exp_avg_sq"] = xp.zeros_like(param.data)
            state["step"] = np.zeros((), dtype=np.int64)
        state["step"] += 1
        t = int(state["step"])
        m, v, g = state["exp_avg"], state["exp_avg_sq"], param.grad
        param.data *= 1 - self.lr * self.weight_decay
        m *= beta1
        m += (1 - beta1) * g
        v *= beta2
        v += (1 - beta2) * (g * g)
        step_size = self.lr / (1 - beta1**t)
        denom = xp.sqrt(v / (1 - beta2**t)) + self.eps
        param.data -= step_size * (m / denom)
