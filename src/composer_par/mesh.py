"""Named mesh dims and their rank arithmetic, without processes.

A :class:`MeshSpec` is the plan's description of the device mesh: ordered named mesh
dims, outermost first. The order is the rank layout (row-major, as DeviceMesh lays
ranks out), so every rank group can be computed here, on a laptop, and equals what
``init_device_mesh`` builds on the cluster.

This module never imports torch at import time: the static validation path uses it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.findings import did_you_mean

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

INFER = -1


class MeshError(ValueError):
    """A mesh that cannot be laid out; the message gives the whole equation."""


def _check_dims(instance: MeshSpec, attribute: attrs.Attribute[Any], value: Any) -> None:
    seen: set[str] = set()
    inferred: list[str] = []
    for name, size in value:
        if not isinstance(name, str) or not name.isidentifier():
            raise MeshError(f"mesh dim names must be identifiers; got {name!r}")
        if name in seen:
            raise MeshError(f"mesh dim {name!r} appears twice")
        seen.add(name)
        if isinstance(size, bool) or not isinstance(size, int):
            raise MeshError(f"mesh dim {name!r}: size must be an int; got {size!r}")
        if size == INFER:
            inferred.append(name)
        elif size < 1:
            raise MeshError(f"mesh dim {name!r}: size must be >= 1 or -1 (inferred); got {size}")
    if len(inferred) > 1:
        raise MeshError(
            "at most one mesh dim may be -1 (inferred from the world size); got -1 for "
            + " and ".join(repr(n) for n in inferred)
        )


@attrs.frozen(init=False)
class MeshSpec:
    """Ordered named mesh dims, outermost first: ``MeshSpec(dp_replicate=2, dp_shard=4)``.

    One size may be ``-1``: it is inferred from the world size by :meth:`resolve`.
    """

    dims: tuple[tuple[str, int], ...] = attrs.field(validator=_check_dims)

    def __init__(self, **sizes: int) -> None:
        self.__attrs_init__(tuple(sizes.items()))

    @classmethod
    def from_pairs(cls, pairs: Any) -> MeshSpec:
        """Build from ``[(name, size), ...]`` or a mapping, keeping its order."""
        items = pairs.items() if isinstance(pairs, Mapping) else pairs
        spec = cls.__new__(cls)
        spec.__attrs_init__(tuple((str(k), v) for k, v in items))
        return spec

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh) -> MeshSpec:
        names = mesh.mesh_dim_names
        if not names:
            raise MeshError(
                "the DeviceMesh has no mesh dim names; build it with "
                "init_device_mesh(..., mesh_dim_names=(...)) so plugins can claim its dims"
            )
        return cls.from_pairs(zip(names, tuple(mesh.shape), strict=True))

    # -- queries -----------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self.dims)

    def size(self, name: str) -> int:
        for n, s in self.dims:
            if n == name:
                return s
        raise MeshError(
            f"no mesh dim {name!r}{did_you_mean(name, self.names)}; the mesh has {list(self.names)}"
        )

    @property
    def is_resolved(self) -> bool:
        return INFER not in self.sizes

    @property
    def world_size(self) -> int:
        """The product of all sizes; the mesh must be resolved."""
        if not self.is_resolved:
            raise MeshError(f"{self.equation()}: a size is -1; call resolve(world_size) first")
        return math.prod(self.sizes)

    def equation(self, world_size: int | None = None) -> str:
        """``dp_replicate(4) * dp_shard(8) * tp(2) = 64`` (and ``!= world_size(32)``)."""
        lhs = " * ".join(f"{n}({s})" for n, s in self.dims) or "(no mesh dims)"
        known = math.prod(s for s in self.sizes if s != INFER)
        if (not self.is_resolved and isinstance(world_size, int) and world_size > 0
                and world_size % known == 0):
            # Show the layout the world size gives, and which size was inferred.
            inferred = next(n for n, s in self.dims if s == INFER)
            return f"{self.resolve(world_size).equation(world_size)} ({inferred} inferred)"
        text = f"{lhs} = {known}" if self.is_resolved else f"{lhs} = {known} * ?"
        if world_size is not None:
            text += f" {'==' if self.is_resolved and known == world_size else '!='} "
            text += f"world_size({world_size})"
        return text

    def check_world_size(self, world_size: int) -> str | None:
        """The problem laying this mesh on ``world_size`` ranks, or None if it fits."""
        known = math.prod(s for s in self.sizes if s != INFER)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            return f"{self.equation()}: world_size must be a positive int; got {world_size!r}"
        if self.is_resolved:
            if known != world_size:
                return self.equation(world_size)
            return None
        if world_size % known:
            return f"{self.equation(world_size)}: {world_size} is not divisible by {known}"
        return None

    def resolve(self, world_size: int) -> MeshSpec:
        """The same mesh with ``-1`` replaced so the product equals ``world_size``."""
        problem = self.check_world_size(world_size)
        if problem:
            raise MeshError(problem)
        if self.is_resolved:
            return self
        known = math.prod(s for s in self.sizes if s != INFER)
        return MeshSpec.from_pairs(
            (n, world_size // known if s == INFER else s) for n, s in self.dims
        )

    # -- rank arithmetic ------------------------------------------------------------

    def coordinate(self, rank: int) -> dict[str, int]:
        """Rank -> its coordinate on every mesh dim (row-major, outermost first)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the mesh: {self.equation()}")
        coord: dict[str, int] = {}
        for name, size in reversed(self.dims):
            coord[name] = rank % size
            rank //= size
        return dict(reversed(list(coord.items())))

    def rank_of(self, coordinate: Mapping[str, int]) -> int:
        """Coordinate -> rank, the inverse of :meth:`coordinate`; a missing mesh dim is 0."""
        if not self.is_resolved:
            raise MeshError(f"{self.equation()}: a size is -1; call resolve(world_size) first")
        unknown = [n for n in coordinate if n not in self.names]
        if unknown:
            raise MeshError(
                f"no mesh dim {unknown[0]!r}{did_you_mean(unknown[0], self.names)}; "
                f"the mesh has {list(self.names)}"
            )
        rank = 0
        for name, size in self.dims:
            index = coordinate.get(name, 0)
            if not 0 <= index < size:
                raise MeshError(
                    f"coordinate {name}={index} is outside mesh dim {name}({size}): "
                    f"expected 0 <= {name} < {size}"
                )
            rank = rank * size + index
        return rank

    def rank_groups(self, name: str) -> list[tuple[int, ...]]:
        """The groups of ranks that communicate over mesh dim ``name``.

        Same content and order as DeviceMesh: the groups are enumerated with the other
        mesh dims in row-major order, each group ordered by its coordinate on ``name``.
        """
        names = self.names
        if name not in names:
            raise MeshError(
                f"no mesh dim {name!r}{did_you_mean(name, names)}; the mesh has {list(names)}"
            )
        if not self.is_resolved:
            raise MeshError(f"{self.equation()}: a size is -1; call resolve(world_size) first")
        others = [(n, s) for n, s in self.dims if n != name]
        groups = []
        for flat in range(math.prod(s for _, s in others)):
            coord: dict[str, int] = {}
            for n, s in reversed(others):
                coord[n] = flat % s
                flat //= s
            groups.append(
                tuple(self.rank_of({**coord, name: i}) for i in range(self.size(name)))
            )
        return groups

    def group_of(self, name: str, rank: int) -> tuple[int, ...]:
        """The group of ``rank`` on mesh dim ``name``."""
        for group in self.rank_groups(name):
            if rank in group:
                return group
        raise MeshError(f"rank {rank} is outside the mesh: {self.equation()}")

    # -- building the real thing ------------------------------------------------------

    def build(self, device_type: str | None = None) -> DeviceMesh:
        """Build the DeviceMesh on the current process group (cpu/gloo, cuda/nccl).

        The default process group must be initialized; its world size must fit.
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise MeshError(
                "building a DeviceMesh needs an initialized process group: run under "
                "torchrun (or call torch.distributed.init_process_group) first"
            )
        resolved = self.resolve(dist.get_world_size())
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return init_device_mesh(device_type, resolved.sizes, mesh_dim_names=resolved.names)

    def to_dict(self) -> dict[str, int]:
        return dict(self.dims)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={s}" for n, s in self.dims)
        return f"MeshSpec({inner})"
