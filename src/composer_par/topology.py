"""Nodes x devices per node, and which mesh dims cross nodes.

Ranks are laid out on nodes contiguously, as torchrun does: node ``k`` holds ranks
``k * devices_per_node ... (k + 1) * devices_per_node - 1``. A mesh dim "stays inside a
node" when each of its rank groups lies on one node; otherwise it crosses nodes and its
collectives run over the (much slower) inter-node links.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from composer_par.mesh import MeshSpec


class TopologyError(ValueError):
    """A topology that cannot describe the job."""


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TopologyError(f"{attribute.name} must be a positive int; got {value!r}")


def _optional_positive_number(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
            or not math.isfinite(value)):
        raise TopologyError(f"{attribute.name} must be a finite positive number; got {value!r}")


@attrs.frozen
class Topology:
    """``Topology(nodes=4, devices_per_node=8)``, with optional link bandwidths in Gbit/s."""

    nodes: int = attrs.field(validator=_positive)
    devices_per_node: int = attrs.field(validator=_positive)
    intra_node_gbps: float | None = attrs.field(
        default=None, validator=_optional_positive_number, kw_only=True
    )
    inter_node_gbps: float | None = attrs.field(
        default=None, validator=_optional_positive_number, kw_only=True
    )

    @classmethod
    def single_node(cls, world_size: int) -> Topology:
        return cls(nodes=1, devices_per_node=world_size)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Topology | None:
        """Read the topology torchrun exports (WORLD_SIZE, LOCAL_WORLD_SIZE, and
        GROUP_WORLD_SIZE: the number of nodes that joined); None outside it.

        The rank layout (node ``k`` holds ranks ``k * L ... k * L + L - 1``) needs the same
        ``L`` processes on every node; a node that sees otherwise is an error.
        """
        env = os.environ if environ is None else environ
        try:
            world = int(env["WORLD_SIZE"])
            local = int(env["LOCAL_WORLD_SIZE"])
        except (KeyError, ValueError):
            return None
        if local < 1 or world % local:
            raise TopologyError(
                f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: "
                "torchrun needs the same number of processes on every node"
            )
        nodes = env.get("GROUP_WORLD_SIZE", "")
        if nodes.strip().isdigit() and int(nodes) * local != world:
            raise TopologyError(
                f"GROUP_WORLD_SIZE={nodes} nodes x LOCAL_WORLD_SIZE={local} processes != "
                f"WORLD_SIZE={world}: the nodes run different numbers of processes; give "
                "every node the same --nproc-per-node"
            )
        return cls(nodes=world // local, devices_per_node=local)

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside {self.describe()}")
        return rank // self.devices_per_node

    def nodes_spanned(self, mesh: MeshSpec, *names: str) -> int:
        """How many nodes the widest rank group of mesh dim ``name`` spans (of several
        mesh dims: of their groups flattened together)."""
        self.node_patterns(mesh, names)  # the names and the world size checked
        return _widest_span(mesh.dims, tuple(names), self.devices_per_node)

    def node_patterns(self, mesh: MeshSpec, names: Sequence[str]) -> list[tuple[int, ...]]:
        """The rank groups of the mesh dims ``names`` flattened together (the ranks that
        differ only on them, ordered by their coordinates), one per way such a group sits
        on the nodes: every other group is one of these moved by whole nodes, so how many
        nodes a group spans, and which of its members share a node, are the same for it.
        At most ``devices_per_node`` groups, however many ranks the mesh has."""
        for name in names:
            mesh.size(name)  # an unknown name is a MeshError naming the mesh's dims
        if mesh.world_size > self.world_size:
            raise TopologyError(f"{mesh.equation()} has more ranks than {self.describe()}")
        return list(_node_patterns(mesh.dims, tuple(names), self.devices_per_node))

    def crosses_nodes(self, mesh: MeshSpec, name: str) -> bool:
        return self.nodes_spanned(mesh, name) > 1

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.devices_per_node} device(s) = {self.world_size} ranks"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


@functools.lru_cache(maxsize=4096)
def _widest_span(dims: tuple[tuple[str, int], ...], names: tuple[str, ...],
                 per_node: int) -> int:
    """See :meth:`Topology.nodes_spanned`: cached, as suggest asks it of the same few
    meshes for every layout and a group may hold thousands of ranks."""
    return max(len({r // per_node for r in g})
               for g in _node_patterns(dims, names, per_node))


@functools.lru_cache(maxsize=4096)
def _node_patterns(dims: tuple[tuple[str, int], ...], names: tuple[str, ...],
                   per_node: int) -> tuple[tuple[int, ...], ...]:
    """See :meth:`Topology.node_patterns`. A group is its first rank plus the same offsets
    (its members' steps along ``names``); the nodes it spans depend only on that first
    rank's remainder modulo ``per_node``, so one group per remainder is enough."""
    strides: dict[str, int] = {}
    step = 1
    for name, size in reversed(dims):
        strides[name] = step
        step *= size
    offsets = [0]
    for name, size in dims:
        if name in names:
            offsets = [o + i * strides[name] for o in offsets for i in range(size)]
    # The first ranks of the groups, one per remainder: along another dim the remainders
    # repeat after per_node steps, so no more steps than that are needed to reach them all.
    firsts = {0: 0}
    for name, size in dims:
        if name in names:
            continue
        reached: dict[int, int] = {}
        for first in firsts.values():
            for i in range(min(size, per_node)):
                rank = first + i * strides[name]
                reached.setdefault(rank % per_node, rank)
        firsts = reached
    return tuple(tuple(first + o for o in offsets) for first in sorted(firsts.values()))

