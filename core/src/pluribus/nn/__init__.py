"""Modules, losses and optimizers on numpy or cupy arrays: the models the parallel layers train.

The protocol (what :mod:`pluribus.parallel` relies on) is small: ``named_parameters()`` yielding
objects with ``.data`` and ``.grad``, ``forward``, ``backward`` that accumulates ``.grad`` through
``Parameter.accumulate_grad`` and returns the input gradient, ``state_dict``/``load_state_dict``,
``train``/``eval``. Layers with weights also split their backward (``backward_input``, then
``backward_weight``), and every module runs torch-named forward and backward hooks. See
docs/nn.md for the layers, the small GPT, and adapting another framework's modules.
"""

from .checkpoint import Checkpoint
from .layers import GELU, BatchNorm1d, Dropout, Embedding, LayerNorm, Linear, ReLU, Tanh, erf
from .losses import CrossEntropyLoss, MSELoss
from .memory import MemoryReport, memory_report, peak_rss_bytes
from .module import Composite, Module, Parameter, RemovableHandle, Sequential, array_namespace
from .optim import SGD, AdamW, LambdaLR, Optimizer
from .transformer import GPT, PRESETS, CausalSelfAttention, GPTConfig, TransformerBlock

__all__ = [
    "GELU",
    "GPT",
    "PRESETS",
    "SGD",
    "AdamW",
    "BatchNorm1d",
    "CausalSelfAttention",
    "Checkpoint",
    "Composite",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "GPTConfig",
    "LayerNorm",
    "LambdaLR",
    "Linear",
    "MSELoss",
    "MemoryReport",
    "Module",
    "Optimizer",
    "Parameter",
    "ReLU",
    "RemovableHandle",
    "Sequential",
    "Tanh",
    "TransformerBlock",
    "array_namespace",
    "erf",
    "memory_report",
    "peak_rss_bytes",
]
