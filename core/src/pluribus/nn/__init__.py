"""Modules, losses and optimizers on numpy or cupy arrays: the models the parallel layers train.

The protocol (what :mod:`pluribus.parallel` relies on) is small: ``named_parameters()`` yielding
objects with ``.data`` and ``.grad``, ``forward``, ``backward`` that accumulates ``.grad`` through
``Parameter.accumulate_grad`` and returns the input gradient, ``state_dict``/``load_state_dict``,
``train``/``eval``. See docs/nn.md for adapting another framework's modules.
"""

from .layers import GELU, BatchNorm1d, Dropout, Embedding, LayerNorm, Linear, ReLU, Tanh
from .losses import CrossEntropyLoss, MSELoss
from .module import Composite, Module, Parameter, RemovableHandle, Sequential, array_namespace
from .optim import SGD, AdamW, LambdaLR, Optimizer

__all__ = [
    "GELU",
    "SGD",
    "AdamW",
    "BatchNorm1d",
    "Composite",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "LambdaLR",
    "Linear",
    "MSELoss",
    "Module",
    "Optimizer",
    "Parameter",
    "ReLU",
    "RemovableHandle",
    "Sequential",
    "Tanh",
    "array_namespace",
]
