"""Distributed tensors: a global array as one piece per rank of a :class:`DeviceMesh`.

``placements`` (one per mesh dimension: :class:`Shard`, :class:`Replicate`, :class:`Partial`)
say how; the :class:`Layout` adds each rank's shard size; :func:`redistribute_plan` shows the
collectives a change of placements costs, and ``redistribute`` runs exactly those.
"""

from ..mesh import DeviceMesh, init_device_mesh
from . import ops
from .api import DTensor, distribute_tensor, from_local, redistribute_plan
from .factories import empty, full, ones, rand, randn, zeros
from .layout import Layout, split_sizes
from .local_map import local_map
from .ops import elementwise, matmul
from .placements import Partial, Placement, Replicate, Shard
from .plan import DEFAULT_COST, CostModel, Plan, Step

__all__ = [
    "DEFAULT_COST",
    "CostModel",
    "DTensor",
    "DeviceMesh",
    "Layout",
    "Partial",
    "Placement",
    "Plan",
    "Replicate",
    "Shard",
    "Step",
    "distribute_tensor",
    "elementwise",
    "empty",
    "from_local",
    "full",
    "init_device_mesh",
    "local_map",
    "matmul",
    "ones",
    "ops",
    "rand",
    "randn",
    "redistribute_plan",
    "split_sizes",
    "zeros",
]
