"""Optimizers with torch's update rules, working in place on ``Parameter.data``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .module import Parameter, array_namespace


class Optimizer:
    """Parameters in ``param_groups`` (torch's: dicts with ``"params"`` and hyperparameters)
    and per-parameter state arrays; ``step`` skips parameters with no grad.

    ``params`` is an iterable of parameters, or of dicts ``{"params": [...], "lr": ...}`` whose
    missing hyperparameters take the constructor's values. A scheduler changes ``group["lr"]``.
    """

    def __init__(self, params: Iterable[Parameter] | Iterable[dict], defaults: dict[str, Any]):
        self.defaults = dict(defaults)
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups: list[dict[str, Any]] = []
        seen: set[int] = set()
        for group in groups:
            if not isinstance(group, dict) or "params" not in group:
                raise TypeError(
                    "optimizer params must be all parameters or all dicts with a 'params' key"
                )
            unknown = set(group) - set(self.defaults) - {"params", "initial_lr"}
            if unknown:
                raise ValueError(
                    f"unknown hyperparameters {sorted(unknown)} in a parameter group; "
                    f"{type(self).__name__} takes {sorted(self.defaults)}"
                )
            members = list(group["params"])
            for p in members:
                if id(p) in seen:
                    raise ValueError("a parameter appears in more than one parameter group")
                seen.add(id(p))
            self.param_groups.append({**self.defaults, **group, "params": members})
        #: every parameter, in group order: the index that names its state in ``state_dict``
        self.params = [p for group in self.param_groups for p in group["params"]]
        self.state: list[dict[str, Any]] = [{} for _ in self.params]
        self.step_count = 0

    @property
    def lr(self) -> float:
        """The first group's learning rate; setting it sets every group's."""
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.param_groups:
            group["lr"] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad[...] = 0

    def step(self) -> None:
        self.step_count += 1
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, self.state[index], group)
                index += 1

    def _update(self, param: Parameter, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _initial_state(self, param: Parameter, group: dict[str, Any]) -> dict[str, Any]:
        """The state a parameter's first step starts from (nothing, for a stateless rule)."""
        return {}

    def init_state(self) -> None:
        """Give every parameter that has no state yet the state its first step starts from, so
        that a checkpoint load has arrays to fill (torch's ``_init_optim_state``); the next
        step then does what a first one would."""
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                if not self.state[index]:
                    self.state[index] = self._initial_state(param, group)
                index += 1

    def state_dict(self) -> dict[str, Any]:
        """Flat name -> array mapping (``"3.exp_avg"``, ``"group.0.lr"``), ready for
        ``np.savez``."""
        flat: dict[str, Any] = {"step_count": np.array(self.step_count)}
        for g, group in enumerate(self.param_groups):
            for key, value in group.items():
                if key != "params":
                    flat[f"group.{g}.{key}"] = np.array(value)
        for i, state in enumerate(self.state):
            for key, value in state.items():
                flat[f"{i}.{key}"] = value.copy()
        return flat

    def load_state_dict(self, flat: dict[str, Any]) -> None:
        """Restore the state and the groups' hyperparameters (a scheduler's lr included).

        Floating state takes its parameter's dtype and device; counters (``step``) stay
        integers: a float16 counter would stop at 2048."""
        self.step_count = int(flat["step_count"])
        self.state = [{} for _ in self.params]
        for name, value in flat.items():
            if name == "step_count":
                continue
            if name.startswith("group."):
                _, g, key = name.split(".", 2)
                value = np.asarray(value)
                self.param_groups[int(g)][key] = value.tolist()
                continue
            index, key = name.split(".", 1)
            target = self.params[int(index)].data
            if np.asarray(value).dtype.kind in "iub":
                self.state[int(index)][key] = np.array(value, dtype=np.int64)
            else:
                xp = array_namespace(target)
                self.state[int(index)][key] = xp.asarray(value, dtype=target.dtype).copy()


class SGD(Optimizer):
    """SGD with optional momentum (torch's form: ``v = mu v + g; p -= lr v``) and L2 decay."""

    def __init__(
        self,
        params: Iterable[Parameter] | Iterable[dict],
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        super().__init__(
            params,
            {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov},
        )

    def _update(self, param: Parameter, state: dict[str, Any], group: dict[str, Any]) -> None:
        xp = array_namespace(param.data)
        grad = param.grad
        weight_decay, momentum = group["weight_decay"], group["momentum"]
        if weight_decay:
            # asarray: on a 0-d parameter the sum is a numpy scalar, which in-place ops rebind
            grad = xp.asarray(grad + weight_decay * param.data)
        if momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = xp.array(grad, copy=True)
            else:  # a zero buffer (init_state) gives the first step's copy of the gradient
                buf *= momentum
                buf += grad
            grad = grad + momentum * buf if group["nesterov"] else buf
        param.data -= group["lr"] * grad

    def _initial_state(self, param: Parameter, group: dict[str, Any]) -> dict[str, Any]:
        if not group["momentum"]:
            return {}
        return {"momentum_buffer": array_namespace(param.data).zeros_like(param.data)}


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), torch's defaults."""

    def __init__(
        self,
        params: Iterable[Parameter] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    def _update(self, param: Parameter, state: dict[str, Any], group: dict[str, Any]) -> None:
        xp = array_namespace(param.data)
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        if "exp_avg" not in state:
            state.update(self._initial_state(param, group))
        state["step"] += 1
        t = int(state["step"])
        m, v, g = state["exp_avg"], state["exp_avg_sq"], param.grad
        param.data *= 1 - lr * group["weight_decay"]
        m *= beta1
        m += (1 - beta1) * g
        v *= beta2
        v += (1 - beta2) * (g * g)
        step_size = lr / (1 - beta1**t)
        denom = xp.sqrt(v / (1 - beta2**t)) + eps
        param.data -= step_size * (m / denom)

    def _initial_state(self, param: Parameter, group: dict[str, Any]) -> dict[str, Any]:
        xp = array_namespace(param.data)
        return {
            "exp_avg": xp.zeros_like(param.data),
            "exp_avg_sq": xp.zeros_like(param.data),
            "step": np.zeros((), dtype=np.int64),
        }


class LambdaLR:
    """torch's ``LambdaLR``: each group's lr is its initial lr times ``lr_lambda(epoch)``.

    Call ``step()`` after each ``optimizer.step()``; ``lr_lambda`` may be one function or one
    per group. Its position survives a checkpoint through the optimizer's group lrs and
    :meth:`state_dict`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_lambda: Callable[[int], float] | list[Callable[[int], float]],
        last_epoch: int = -1,
    ):
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.lr_lambdas = (
            list(lr_lambda) if isinstance(lr_lambda, list) else [lr_lambda] * len(groups)
        )
        if len(self.lr_lambdas) != len(groups):
            raise ValueError(
                f"LambdaLR got {len(self.lr_lambdas)} lr_lambdas for {len(groups)} groups"
            )
        for group in groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [group["initial_lr"] for group in groups]
        self.last_epoch = last_epoch
        self.step()

    def step(self) -> None:
        self.last_epoch += 1
        for group, base, factor in zip(
            self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True
        ):
            group["lr"] = base * factor(self.last_epoch)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self.base_lrs = [float(b) for b in state["base_lrs"]]
