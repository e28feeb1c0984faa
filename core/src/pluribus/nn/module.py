"""The module protocol the parallel layers accept, and its base class.

A module is anything with named parameters (objects with ``.data`` and ``.grad`` arrays), a
``forward`` that remembers what its ``backward`` needs, and a ``backward`` that adds to every
parameter's ``.grad`` and returns the gradient with respect to the input. Parameters announce
that their gradient is complete through :meth:`Parameter.accumulate_grad`, which runs the hooks
that :class:`~pluribus.parallel.DistributedDataParallel` registers: that is what lets gradient
communication start while the rest of backward still runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

GradHook = Callable[["Parameter"], None]

#: The methods whose calls run the module hooks, wherever they are called from (a parent's
#: ``forward`` calling ``child.forward(x)`` runs the child's hooks too).
_FORWARD, _BACKWARDS = "forward", ("backward", "backward_input")


def array_namespace(array: Any) -> Any:
    """numpy or cupy, whichever ``array`` belongs to (cupy is imported only for cupy arrays)."""
    if type(array).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


class RemovableHandle:
    """Returned by hook registrations; ``remove()`` unregisters the hook."""

    def __init__(self, hooks: list, hook: Any):
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def _registered(hooks: list, hook: Callable, prepend: bool) -> RemovableHandle:
    hooks.insert(0, hook) if prepend else hooks.append(hook)
    return RemovableHandle(hooks, hook)


class _WithKwargs:
    """A forward hook registered with ``with_kwargs=True``: it also takes (and a pre hook may
    replace) the keyword arguments of forward."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable):
        self.hook = hook


class Parameter:
    """A trainable array and its gradient (``None`` until the first backward)."""

    def __init__(self, data: Any):
        self.data = data
        self.grad: Any = None
        #: Where :meth:`accumulate_grad` puts a fresh gradient, if set: DDP points it into its
        #: communication buffer, so gradients need no copy before or after the all-reduce.
        self.grad_view: Any = None
        #: How many equal blocks the parameter stacks along dimension 0 (a fused q, k, v
        #: projection: 3). Tensor parallelism splits each block alike, and a state dict for
        #: checkpoints holds them as a leading dimension, so that a rank's piece is one box.
        self.blocks = 1
        self._grad_hooks: list[GradHook] = []

    def __repr__(self) -> str:
        return f"Parameter(shape={tuple(self.data.shape)}, dtype={self.data.dtype})"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def accumulate_grad(self, grad: Any) -> None:
        """Add ``grad`` to ``.grad``, then tell the registered hooks it is there.

        Layers call this once per backward for each parameter they use; a framework adapting its
        own modules to the protocol calls it too (or, at least, fills ``.grad``: DDP then reduces
        after backward returns, without overlap). The first gradient of a step may be kept as
        ``.grad`` without a copy: pass an array the layer does not reuse.
        """
        if self.grad is None and self.grad_view is not None:
            self.grad_view[...] = grad.reshape(self.data.shape)
            self.grad = self.grad_view
        elif self.grad is None:
            self.grad = grad.astype(self.data.dtype, copy=False).reshape(self.data.shape)
        else:
            self.grad += grad.reshape(self.data.shape)
        for hook in list(self._grad_hooks):
            hook(self)

    def register_post_accumulate_grad_hook(self, hook: GradHook) -> RemovableHandle:
        """Run ``hook(param)`` after each :meth:`accumulate_grad` (torch's name for it)."""
        self._grad_hooks.append(hook)
        return RemovableHandle(self._grad_hooks, hook)


class Module:
    """Base class: tracks parameters, buffers and sub-modules assigned as attributes.

    Subclasses implement ``forward(x)`` and ``backward(grad_output) -> grad_input``. Buffers are
    arrays that are state but not trained (running statistics); they are updated in place so
    that DDP can broadcast them.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)
        #: arrays kept by ``forward`` for ``backward`` (see :meth:`save_for_backward`)
        object.__setattr__(self, "_saved", {})
        object.__setattr__(self, "_forward_pre_hooks", [])
        object.__setattr__(self, "_forward_hooks", [])
        object.__setattr__(self, "_backward_pre_hooks", [])
        object.__setattr__(self, "_backward_hooks", [])
        object.__setattr__(self, "_hooks_running", set())

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap the forward and backward a subclass defines so that they run the hooks."""
        super().__init_subclass__(**kwargs)
        if _FORWARD in cls.__dict__:
            setattr(cls, _FORWARD, _forward_with_hooks(cls.__dict__[_FORWARD]))
        for name in _BACKWARDS:
            if name in cls.__dict__:
                setattr(cls, name, _backward_with_hooks(cls.__dict__[name]))

    def __setattr__(self, name: str, value: Any) -> None:
        # re-assigning a name keeps its place, so a replaced layer stays where it was
        if isinstance(value, Parameter):
            self._modules.pop(name, None)
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._parameters.pop(name, None)
            self._modules[name] = value
        else:
            self._parameters.pop(name, None)
            self._modules.pop(name, None)
            if name in self._buffers:
                self._buffers[name] = value
        object.__setattr__(self, name, value)

    def register_buffer(self, name: str, array: Any) -> None:
        self._buffers[name] = array
        object.__setattr__(self, name, array)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, x: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def backward(self, grad_output: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement backward")

    # -- split backward -----------------------------------------------------------------------

    def backward_input(self, grad_output: Any) -> Any:
        """The input gradient only; the parameter gradients wait for :meth:`backward_weight`.

        Pipeline schedules (zero bubble) run this first, to unblock the previous stage, and the
        weight part later. ``backward_input`` then ``backward_weight`` leaves exactly the same
        gradients as ``backward``. Modules without parameters need not implement it.
        """
        if any(True for _ in self.named_parameters()):
            raise NotImplementedError(
                f"{type(self).__name__} has parameters but no split backward: implement "
                "backward_input and backward_weight (or call backward)"
            )
        return self.backward(grad_output)

    def backward_weight(self) -> None:
        """Accumulate the parameter gradients deferred by the last :meth:`backward_input`."""
        if any(True for _ in self.named_parameters()):
            raise NotImplementedError(
                f"{type(self).__name__} has parameters but no split backward: implement "
                "backward_input and backward_weight (or call backward)"
            )

    # -- saved activations --------------------------------------------------------------------

    def save_for_backward(self, **arrays: Any) -> None:
        """Keep arrays from ``forward`` for ``backward``; memory accounting and activation
        checkpointing find them here."""
        self._saved.update(arrays)

    def saved(self, *names: str) -> Any:
        """The arrays :meth:`save_for_backward` kept (one, or a tuple for several names)."""
        try:
            values = tuple(self._saved[name] for name in names)
        except KeyError as missing:
            raise RuntimeError(
                f"{type(self).__name__}.backward found no saved {missing.args[0]!r}: run forward "
                "before each backward (a second backward needs a second forward)"
            ) from None
        return values[0] if len(values) == 1 else values

    def release_saved(self, recurse: bool = True) -> None:
        """Drop what forward kept for backward (in this module and, by default, below it)."""
        modules = [m for _, m in self.named_modules()] if recurse else [self]
        for module in modules:
            module._saved.clear()

    # -- module hooks (torch's names and signatures) ------------------------------------------

    # ``prepend=True`` (torch's) runs the hook before those registered earlier.

    def register_forward_pre_hook(
        self, hook: Callable, *, prepend: bool = False, with_kwargs: bool = False
    ) -> RemovableHandle:
        """``hook(module, args)`` before forward; may return new args (a tuple, or one value).
        With ``with_kwargs``, ``hook(module, args, kwargs)``, which may return ``(args,
        kwargs)``."""
        return _registered(
            self._forward_pre_hooks, _WithKwargs(hook) if with_kwargs else hook, prepend
        )

    def register_forward_hook(
        self, hook: Callable, *, prepend: bool = False, with_kwargs: bool = False
    ) -> RemovableHandle:
        """``hook(module, args, output)`` after forward; may return a new output. With
        ``with_kwargs``, ``hook(module, args, kwargs, output)``."""
        return _registered(self._forward_hooks, _WithKwargs(hook) if with_kwargs else hook, prepend)

    def register_full_backward_pre_hook(
        self, hook: Callable, *, prepend: bool = False
    ) -> RemovableHandle:
        """``hook(module, grad_output)`` before backward (``grad_output`` is a 1-tuple, as in
        torch); may return a new tuple. Runs for ``backward`` and ``backward_input``."""
        return _registered(self._backward_pre_hooks, hook, prepend)

    def register_full_backward_hook(
        self, hook: Callable, *, prepend: bool = False
    ) -> RemovableHandle:
        """``hook(module, grad_input, grad_output)`` after backward (1-tuples); may return a new
        ``grad_input`` tuple. With split backward it runs after ``backward_input``, before the
        parameter gradients exist (their arrival is announced per parameter by
        :meth:`Parameter.register_post_accumulate_grad_hook`)."""
        return _registered(self._backward_hooks, hook, prepend)

    # -- traversal ----------------------------------------------------------------------------

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def children(self) -> Iterator[Module]:
        yield from self._modules.values()

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """Every parameter once, in definition order, with its dotted name."""
        seen: set[int] = set()
        for prefix, module in self.named_modules():
            for name, param in module._parameters.items():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield (f"{prefix}.{name}" if prefix else name), param

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_buffers(self) -> Iterator[tuple[str, Any]]:
        for prefix, module in self.named_modules():
            for name, array in module._buffers.items():
                yield (f"{prefix}.{name}" if prefix else name), array

    # -- modes and gradients ------------------------------------------------------------------

    def train(self, mode: bool = True) -> Module:
        for _, module in self.named_modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.parameters():
            if set_to_none or param.grad is None:
                param.grad = None
            else:
                param.grad[...] = 0

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Copies of every parameter and buffer, by dotted name."""
        state = {name: p.data.copy() for name, p in self.named_parameters()}
        state.update({name: b.copy() for name, b in self.named_buffers()})
        return state

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy arrays into the parameters and buffers in place (so optimizers keep theirs)."""
        targets = {name: p.data for name, p in self.named_parameters()}
        targets.update(dict(self.named_buffers()))
        if strict:
            missing = sorted(set(targets) - set(state))
            unexpected = sorted(set(state) - set(targets))
            if missing or unexpected:
                raise KeyError(
                    f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
                )
        for name, target in targets.items():
            if name not in state:
                continue
            value = state[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"load_state_dict: {name!r} has shape {tuple(value.shape)} in the state "
                    f"but {tuple(target.shape)} in the module"
                )
            xp = array_namespace(target)
            target[...] = xp.asarray(value, dtype=target.dtype)

    def to(self, device: str | None = None, dtype: Any = None) -> Module:
        """Move parameters and buffers to "cpu" (numpy) or "cuda" (cupy), and/or cast them."""

        def convert(array: Any) -> Any:
            if device == "cuda":
                import cupy

                array = cupy.asarray(array)
            elif device == "cpu" and not isinstance(array, np.ndarray):
                array = array.get()
            if dtype is not None and array.dtype.kind == "f":
                array = array.astype(dtype)
            return array

        for _, module in self.named_modules():
            for param in module._parameters.values():
                param.data = convert(param.data)
                param.grad = None
            for name, array in list(module._buffers.items()):
                setattr(module, name, convert(array))
        return self

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("]
        for name, child in self._modules.items():
            lines.append(f"  ({name}): " + repr(child).replace("\n", "\n  "))
        lines.append(")")
        return "\n".join(lines) if self._modules else f"{type(self).__name__}()"


def _forward_with_hooks(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(self: Module, *args: Any, **kwargs: Any) -> Any:
        running = self._hooks_running
        if (not self._forward_pre_hooks and not self._forward_hooks) or _FORWARD in running:
            return forward(self, *args, **kwargs)
        running.add(_FORWARD)  # a subclass calling super().forward runs the hooks once
        try:
            for hook in list(self._forward_pre_hooks):
                if type(hook) is _WithKwargs:
                    result = hook.hook(self, args, kwargs)
                    if result is not None:
                        args, kwargs = _args_and_kwargs(hook.hook, result)
                    continue
                result = hook(self, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
            output = forward(self, *args, **kwargs)
            for hook in list(self._forward_hooks):
                if type(hook) is _WithKwargs:
                    result = hook.hook(self, args, kwargs, output)
                else:
                    result = hook(self, args, output)
                if result is not None:
                    output = result
            return output
        finally:
            running.discard(_FORWARD)

    return run


def _args_and_kwargs(hook: Callable, result: Any) -> tuple[tuple, dict]:
    """What a ``with_kwargs`` pre hook returned, checked: ``(args, kwargs)`` (torch's rule)."""
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not isinstance(result[0], tuple)
        or not isinstance(result[1], dict)
    ):
        raise RuntimeError(
            f"forward pre hook {hook!r} registered with with_kwargs=True returned "
            f"{type(result).__name__}; it must return None or a tuple (args, kwargs)"
        )
    return result


def _backward_with_hooks(backward: Callable) -> Callable:
    @functools.wraps(backward)
    def run(self: Module, *grad_output: Any) -> Any:
        running = self._hooks_running
        if (not self._backward_pre_hooks and not self._backward_hooks) or "backward" in running:
            return backward(self, *grad_output)
        running.add("backward")  # backward built on backward_input runs the hooks once
        try:
            grads_out = grad_output  # empty for a loss's backward()
            for hook in list(self._backward_pre_hooks):
                result = hook(self, grads_out)
                if result is not None:
                    grads_out = result if isinstance(result, tuple) else (result,)
            grads_in = (backward(self, *grads_out),)
            for hook in list(self._backward_hooks):
                result = hook(self, grads_in, grads_out)
                if result is not None:
                    grads_in = result if isinstance(result, tuple) else (result,)
            return grads_in[0]
        finally:
            running.discard("backward")

    return run


class Composite(Module):
    """A module made of children: ``backward``, ``backward_input`` and ``backward_weight`` all
    come from one :meth:`_backward` that says how the gradient flows through the children.

    ``_backward(grad_output, step)`` calls ``step(child, grad)`` for each child it goes back
    through (and returns the input gradient). ``step`` is the child's whole backward in plain
    mode, its ``backward_input`` in split mode; ``backward_weight`` then visits the same
    children in the same order, so both leave the same gradients, accumulated in the same order.
    """

    def _backward(self, grad_output: Any, step: Callable[[Module, Any], Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement _backward")

    def backward(self, grad_output: Any) -> Any:
        return self._backward(grad_output, _plain_step)

    def backward_input(self, grad_output: Any) -> Any:
        visited: list[Module] = []

        def step(child: Module, grad: Any) -> Any:
            visited.append(child)
            return child.backward_input(grad)

        grad_input = self._backward(grad_output, step)
        self._saved["weight_order"] = visited
        return grad_input

    def backward_weight(self) -> None:
        for child in self.saved("weight_order"):
            child.backward_weight()
        self._saved.pop("weight_order")


def _plain_step(child: Module, grad: Any) -> Any:
    return child.backward(grad)


class Sequential(Composite):
    """Modules applied one after another; backward runs them in reverse."""

    def __init__(self, *layers: Module):
        super().__init__()
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> Module:
        return list(self._modules.values())[index]

    def forward(self, x: Any) -> Any:
        for layer in self._modules.values():
            x = layer.forward(x)
        return x

    def _backward(self, grad_output: Any, step: Callable[[Module, Any], Any]) -> Any:
        for layer in reversed(list(self._modules.values())):
            grad_output = step(layer, grad_output)
        return grad_output
