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
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.findings import did_you_mean

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

INFER = -1

# How long a rank waits in one collective of the plan's process groups before it gives
# up (torch's own default is 30 minutes for gloo, 10 for NCCL). A healthy collective
# takes milliseconds to seconds; the longest legitimate wait is a peer that is still
# compiling, loading or checkpointing, which takes a few minutes on the models this runs
# on CPU. Five minutes bounds a dead or stuck peer without cutting those off; a job with
# longer stalls raises it (``ParallelPlan(..., timeout=...)``, ``timeout`` in a plan file).
DEFAULT_TIMEOUT_S = 300.0


class MeshError(ValueError):
    """A mesh that cannot be laid out; the message gives the whole equation."""


def as_timeout(value: Any) -> timedelta:
    """A collective timeout from seconds (int or float) or a ``timedelta``; TypeError or
    ValueError naming the value for anything not positive and finite."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"timeout must be seconds (a number) or a datetime.timedelta; got {value!r}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0; got {value!r}")
    try:
        return value if isinstance(value, timedelta) else timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"timeout {value!r} s is longer than a timedelta can hold") from None


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

    # -- building the real thing ------------------------------------------------------

    def build(
        self, device_type: str | None = None, *, timeout: float | timedelta | None = None
    ) -> DeviceMesh:
        """Build the DeviceMesh on the current process group (cpu/gloo, cuda/nccl).

        The default process group must be initialized; its world size must fit.
        ``timeout`` (seconds or a timedelta) is given to every process group the mesh
        creates, for their creation and every collective on them; without it torch
        uses its default (30 minutes on gloo). A mesh dim that spans every rank runs on
        the default process group itself (torch makes no second group of the same
        ranks), which keeps the timeout ``init_process_group`` was given.
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise MeshError(
                "building a DeviceMesh needs an initialized process group: run under "
                "torchrun (or call torch.distributed.init_process_group) first"
            )
        world = dist.get_world_size()
        resolved = self.resolve(world)
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        wait = as_timeout(timeout) if timeout is not None else None
        override: dict[str | int, Any] = {}
        if wait is not None and device_type in ("cpu", "cuda"):
            for name, size in resolved.dims:
                if size != world or _new_group_for_whole_world():
                    override[name] = _options_with_timeout(device_type, wait)
        mesh = init_device_mesh(device_type, resolved.sizes, mesh_dim_names=resolved.names,
                                backend_override=override or None)
        if wait is not None:
            from composer_par.plugin import torch_private

            default = torch_private.default_group()
            for name in resolved.names:
                group = mesh.get_group(name)
                if group is default:
                    _warn_if_longer(group, device_type, wait, name)
                elif name not in override:
                    # A device type whose backend options are not known here: the
                    # group's creation waited on torch's default, its collectives do not.
                    group.set_timeout(wait)
        return mesh
    def to_dict(self) -> dict[str, int]:
        return dict(self.dims)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={s}" for n, s in self.dims)
        return f"MeshSpec({inner})"


def _new_group_for_whole_world() -> bool:
    """Whether torch makes a new group for a mesh dim spanning every rank (it does when
    CUDA is present but the default group is gloo-only), rather than reusing the default."""
    import torch
    import torch.distributed as dist

    return torch.cuda.is_available() and dist.get_backend() == "gloo"


def _options_with_timeout(device_type: str, wait: timedelta) -> Any:
    """Backend options carrying ``wait``, of the class the device's backend accepts (the
    default group's: a CUDA mesh over a gloo-only group keeps gloo). A fresh object per
    mesh dim: torch writes the group's name and ranks into it."""
    import torch.distributed as dist

    from composer_par.plugin import torch_private

    if (device_type == "cuda" and dist.is_nccl_available()
            and "nccl" in str(dist.get_backend())):
        return torch_private.set_options_timeout(dist.ProcessGroupNCCL.Options(), wait)
    return torch_private.gloo_options(wait)


# The (default group, plan) timeouts this process has warned about: every apply builds a
# mesh, and the same warning on every build would bury the rest of the output.
_TIMEOUTS_WARNED: set[tuple[float, float]] = set()


def _warn_if_longer(group: Any, device_type: str, wait: timedelta, name: str) -> None:
    """Warn, once per process and on rank 0 only (every rank has the same two
    timeouts), that the default group waits longer than the plan says."""
    import torch.distributed as dist

    from composer_par.plugin import torch_private

    current = torch_private.group_timeout(group, device_type)
    if current is None or current <= wait or dist.get_rank() != 0:
        return
    said = (current.total_seconds(), wait.total_seconds())
    if said in _TIMEOUTS_WARNED:
        return
    _TIMEOUTS_WARNED.add(said)
    from composer_par.logging import get_logger

    default_s, plan_s = said
    get_logger(__name__).warning(
        "mesh dim runs on the default process group, whose timeout is longer than the "
        "plan's",
        dim=name, default_group_timeout_s=default_s, plan_timeout_s=plan_s,
        fix=(f"give init_process_group the plan's timeout (timeout=plan.timeout, a "
             f"timedelta of {plan_s:g} s), or raise the plan's to {default_s:g} s "
             "(ParallelPlan(..., timeout=...), timeout in a plan file's [plan] table)"),
    )
