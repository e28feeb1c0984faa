"""DeviceMesh: the job's ranks as an n-d array, with one process group per mesh dimension.

``init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))`` lays ranks 0..7 out row-major
(a mesh holds every rank of the world, in any order; slices hold part of it);
``mesh["tp"]`` is the 1-d slice through this rank, ``mesh.get_group("tp")`` the group of the
ranks it shares a row with. Groups are created on first use, all the groups along a mesh
dimension at once (``new_group`` must be called by every rank in the same order), and cached per
rank set for the whole job: a mesh, its slices and a second mesh with the same rows share them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import distributed as dist
from .group import ProcessGroup

#: default group -> {sorted global ranks: group}: every group the meshes of one job created
_GROUPS: weakref.WeakKeyDictionary[ProcessGroup, dict[tuple[int, ...], ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def _group_for(world: ProcessGroup, ranks: tuple[int, ...]) -> ProcessGroup | None:
    with _LOCK:
        return _GROUPS.setdefault(world, {}).get(ranks)


def _remember(world: ProcessGroup, ranks: tuple[int, ...], group: ProcessGroup) -> None:
    with _LOCK:
        _GROUPS.setdefault(world, {})[ranks] = group


class DeviceMesh:
    """An n-d array of global ranks on which this rank has a coordinate.

    ``device_type`` ("cpu" or "cuda") says where the arrays of DTensors on it live; the groups
    carry whatever backends the default group has (hybrid groups included).
    """

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        mesh_dim_names: Sequence[str] | None = None,
        *,
        _root: DeviceMesh | None = None,
        _root_dims: tuple[int, ...] | None = None,
    ):
        world = dist.get_default_group()
        me = world.global_rank
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"rank {me}: device_type must be 'cpu' or 'cuda', got {device_type!r}")
        given = np.asarray(mesh)
        if given.dtype.kind not in "iu":
            raise TypeError(f"rank {me}: a DeviceMesh holds integer ranks, got {given.tolist()}")
        # the mesh's own read-only copy: a caller reusing its array cannot change the mesh
        # under the coordinate and groups worked out from it
        ranks = given.astype(np.int64).reshape(given.shape or (1,))
        ranks.flags.writeable = False
        if _root is None:
            flat = ranks.reshape(-1).tolist()
            bad = sorted(r for r in set(flat) if not 0 <= r < world.size)
            if bad or len(set(flat)) != len(flat):
                raise ValueError(
                    f"rank {me}: a DeviceMesh needs distinct ranks of the world 0..{world.size - 1}"
                    f", got {ranks.tolist()}"
                )
            if sorted(flat) != list(range(world.size)):
                where = "is not" if me not in flat else "is"
                raise ValueError(
                    f"rank {me}: a DeviceMesh must hold every rank of the world 0..{world.size - 1}"
                    f" (its groups are made by all ranks together); {ranks.tolist()} does not, and "
                    f"this rank {where} in it. Build the mesh over the world and slice it "
                    '(mesh["tp"]) for part of it'
                )
        if isinstance(mesh_dim_names, str):
            raise TypeError(
                f"rank {me}: mesh_dim_names must be a sequence of names, one per mesh dimension, "
                f"got the string {mesh_dim_names!r}; pass ({mesh_dim_names!r},) for one"
            )
        names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        if names is not None and (
            len(names) != ranks.ndim
            or len(set(names)) != len(names)
            or not all(isinstance(n, str) for n in names)
        ):
            raise ValueError(
                f"rank {me}: mesh_dim_names {names} must name each of the mesh's {ranks.ndim} "
                "dimensions once, with strings"
            )
        self.device_type = device_type
        self.mesh = ranks
        self.mesh_dim_names = names
        self._world = world
        self._root = _root if _root is not None else self
        self._root_dims = _root_dims if _root_dims is not None else tuple(range(ranks.ndim))
        where = np.argwhere(ranks == me)
        self._coordinate = tuple(int(i) for i in where[0]) if len(where) else None
        self._groups: dict[int, ProcessGroup] = {}
        self._orders: dict[int, list[int]] = {}
        self._info: dict[int, tuple[ProcessGroup, list[int], bool]] = {}
        #: redistribute plans, each with the function that runs it once compiled (``[plan,
        #: run]``), by (source layout, target placements, array type, dtype, donate); see
        #: pluribus.dtensor.api
        self.plan_cache: dict[Any, Any] = {}

    # -- shape ------------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        return int(self.mesh.size) if mesh_dim is None else self.shape[self._dim(mesh_dim)]

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's index in the mesh array."""
        return self._coordinate

    def get_coordinate(self) -> list[int]:
        """This rank's index in the mesh array, as torch gives it: a list."""
        return list(self._coordinate)

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._world.global_rank

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(
                    f"{self!r}: get_local_rank needs mesh_dim= on a mesh of {self.ndim} dims"
                )
            mesh_dim = 0
        return self._coordinate[self._dim(mesh_dim)]

    def _dim(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if not self.mesh_dim_names or dim not in self.mesh_dim_names:
                raise KeyError(
                    f"rank {self._world.global_rank}: the mesh has no dimension {dim!r} (its "
                    f"names are {self.mesh_dim_names})"
                )
            return self.mesh_dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(
                f"rank {self._world.global_rank}: mesh dimension {dim} does not exist in a mesh "
                f"of shape {self.shape}"
            )
        return dim % self.ndim

    # -- groups -----------------------------------------------------------------------------

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The group of the ranks that share this rank's coordinates except along
        ``mesh_dim``."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(
                    f"{self!r}: get_group needs mesh_dim= on a mesh of {self.ndim} dims"
                )
            mesh_dim = 0
        d = self._dim(mesh_dim)
        group = self._groups.get(d)
        if group is None:
            group = self._groups[d] = self._root._group_along(self._root_dims[d])
        return group

    def group_order(self, dim: int | str) -> list[int]:
        """For each index along mesh dimension ``dim`` (through this rank), that rank's rank in
        ``get_group(dim)``: the two orders differ when the mesh is not laid out row-major."""
        d = self._dim(dim)
        found = self._orders.get(d)
        if found is None:
            index = list(self._coordinate)
            index[d] = slice(None)
            row = [int(r) for r in self.mesh[tuple(index)]]
            ranks = self.get_group(d).ranks
            found = self._orders[d] = [ranks.index(r) for r in row]
        return found

    def group_info(self, dim: int) -> tuple[ProcessGroup, list[int], bool]:
        """``get_group(dim)``, ``group_order(dim)`` and whether that order is the identity, cached
        for redistribute's fast path."""
        found = self._info.get(dim)
        if found is None:
            order = self.group_order(dim)
            found = self._info[dim] = (self.get_group(dim), order, order == sorted(order))
        return found

    def get_all_groups(self) -> list[ProcessGroup]:
        return [self.get_group(d) for d in range(self.ndim)]

    def _group_along(self, dim: int) -> ProcessGroup:
        """Create (once per rank set, for the job) every group along root dimension ``dim`` and
        return this rank's. Every rank takes the rank sets in the same order."""
        rows = np.moveaxis(self.mesh, dim, -1).reshape(-1, self.mesh.shape[dim])
        mine = None
        world = self._world
        current = dist.get_default_group() if dist.is_initialized() else None
        if world is not current:  # new_group would make it in the new world, cached in the old
            raise ValueError(
                f"rank {world.global_rank}: this mesh was made in a world that "
                "destroy_process_group ended; make a new mesh (init_device_mesh) in the "
                "current one"
            )
        for row in rows:
            ranks = tuple(sorted(int(r) for r in row))
            if ranks == tuple(range(world.size)):
                group = world  # not cached: the cache is keyed weakly by the world itself
            else:
                group = _group_for(world, ranks)
                if group is None:
                    group = dist.new_group(list(ranks))
                    _remember(world, ranks, group)
                elif getattr(group, "closed", False):  # members know; they cannot remake it alone
                    raise ValueError(
                        f"rank {world.global_rank}: the group of ranks {list(ranks)} that meshes "
                        "share was destroyed (destroy_process_group), and a mesh cannot make it "
                        "again: every rank creates groups together. Destroy a mesh's groups only "
                        "when done with every mesh over them, or start a new world"
                    )
            if world.global_rank in ranks:
                mine = group
        return mine

    # -- slicing ----------------------------------------------------------------------------

    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh through this rank spanned by the named dimensions, in the order given."""
        wanted = (names,) if isinstance(names, str) else names
        if isinstance(wanted, list):
            wanted = tuple(wanted)
        if not isinstance(wanted, tuple) or not all(isinstance(n, str) for n in wanted):
            raise TypeError(
                f"rank {self._world.global_rank}: slice a DeviceMesh by dimension names "
                f'(mesh["tp"], mesh["dp", "tp"]), got {names!r}'
                + ("" if self.mesh_dim_names else "; this mesh has none: pass mesh_dim_names=")
            )
        dims = [self._dim(n) for n in wanted]
        if len(set(dims)) != len(dims):
            raise ValueError(f"rank {self._world.global_rank}: mesh dimensions {wanted} repeat")
        index = tuple(slice(None) if d in dims else self._coordinate[d] for d in range(self.ndim))
        kept = [d for d in range(self.ndim) if d in dims]
        sub = self.mesh[index]
        order = [kept.index(d) for d in dims]
        sub = np.transpose(sub, order)
        return DeviceMesh(
            self.device_type,
            sub,
            wanted,
            _root=self._root,
            _root_dims=tuple(self._root_dims[d] for d in dims),
        )

    def __copy__(self) -> DeviceMesh:
        return self  # a handle on the job's groups, immutable: copies are the mesh itself

    def __deepcopy__(self, memo: dict) -> DeviceMesh:
        return self

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DeviceMesh)
            and self.device_type == other.device_type
            and self.mesh.shape == other.mesh.shape
            and bool((self.mesh == other.mesh).all())
            and self.mesh_dim_names == other.mesh_dim_names
        )

    def __hash__(self) -> int:
        return hash((self.device_type, self.mesh.tobytes(), self.mesh.shape, self.mesh_dim_names))

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """The world's ranks laid out row-major in ``mesh_shape`` (its product is the world size)."""
    world = dist.get_default_group()
    shape = tuple(int(s) for s in mesh_shape)
    if any(s < 1 for s in shape):
        raise ValueError(
            f"rank {world.global_rank}: mesh shape {shape} has a dimension below 1; every "
            "dimension holds at least one rank"
        )
    if int(np.prod(shape)) != world.size:
        raise ValueError(
            f"rank {world.global_rank}: mesh shape {shape} holds {int(np.prod(shape))} ranks but "
            f"the world has {world.size}; pick a shape whose product is {world.size}"
        )
    return DeviceMesh(device_type, np.arange(world.size).reshape(shape), mesh_dim_names)
