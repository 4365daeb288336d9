"""Communication time: ring collectives, rail optimized (:func:`split_bytes`), over the
intra- and inter-node bandwidths, summed per mesh dim (no latency term), and split by
what each collective runs behind (its ``overlap``), which the step-time model uses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from composer_par.estimate.collectives import Collective
from composer_par.estimate.layout import DimInfo, Layout
from composer_par.topology import Topology

# Link bandwidths assumed when neither the topology nor a flag gives them (Gbit/s).
DEFAULT_INTRA_NODE_GBPS = 900.0
DEFAULT_INTER_NODE_GBPS = 100.0


@attrs.frozen
class DimTraffic:
    """One mesh dim's communication per step and rank."""

    dim: DimInfo
    collectives: tuple[Collective, ...]
    payload: int
    intra_bytes: float
    inter_bytes: float
    seconds: float
    # of ``seconds``, the collectives that may run behind compute (overlap "compute")
    overlapped_seconds: float = 0.0

    @property
    def exposed_seconds(self) -> float:
        """The seconds of collectives nothing hides (overlap "none")."""
        return self.seconds - self.overlapped_seconds

    def calls(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + c.calls
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "dim": self.dim.name, "size": self.dim.size,
            "role": self.dim.role.value if self.dim.role else None,
            "plugin": self.dim.plugin, "nodes_spanned": self.dim.nodes,
            "crosses_nodes": self.dim.crosses_nodes, "payload_bytes": self.payload,
            "calls": self.calls(), "intra_node_bytes": round(self.intra_bytes),
            "inter_node_bytes": round(self.inter_bytes), "seconds": self.seconds,
            "overlapped_seconds": self.overlapped_seconds,
            "collectives": [c.to_dict() for c in self.collectives],
        }


def split_bytes(kind: str, payload: float, group: int, nodes: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends for a collective of ``payload``
    logical bytes over ``group`` ranks on ``nodes`` nodes.

    Ring collectives (NCCL's algorithm for all-gather and reduce-scatter), rail
    optimized: a rank sends ``X*(n-1)/n`` for an all-gather or reduce-scatter of X bytes
    over n ranks, twice that for an all-reduce; when the group spans k > 1 nodes with m
    ranks on each, NCCL spreads the ring's node crossings over the m ranks' own network
    links, so 1/m of it leaves the node and the rest stays on intra-node links.

    An ``all_to_all`` (X = this rank's input) is no ring: the rank sends X/n straight to
    each other rank, so (m-1)/n of X stays in the node and (n-m)/n of it leaves it.

    A ``send`` (point-to-point) sends its payload once: between nodes when ``nodes`` > 1.
    """
    if kind == "send":
        return (0.0, float(payload)) if nodes > 1 else (float(payload), 0.0)
    if group <= 1 or payload <= 0:
        return 0.0, 0.0
    nodes = max(1, min(nodes, group))
    if kind == "all_to_all":
        local = group / nodes
        return payload * (local - 1) / group, payload * (group - local) / group
    wire = payload * (group - 1) / group
    if kind == "all_reduce":
        wire *= 2
    if nodes == 1:
        return wire, 0.0
    per_node = group / nodes
    return wire * (per_node - 1) / per_node, wire / per_node


def bandwidths(
    topology: Topology | None, intra: float | None, inter: float | None
) -> tuple[float, float, tuple[str, ...]]:
    assumed = []
    if intra is None:
        intra = topology.intra_node_gbps if topology is not None else None
    if intra is None:
        intra = DEFAULT_INTRA_NODE_GBPS
        assumed.append("intra_node")
    if inter is None:
        inter = topology.inter_node_gbps if topology is not None else None
    if inter is None:
        inter = DEFAULT_INTER_NODE_GBPS
        assumed.append("inter_node")
    return float(intra), float(inter), tuple(assumed)


def seconds_of(intra: float, inter: float, intra_gbps: float, inter_gbps: float) -> float:
    """Seconds to send ``intra`` bytes inside the node and ``inter`` between nodes, one
    after the other, at the bandwidths (Gbit/s per device)."""
    return intra / (intra_gbps * 1e9 / 8) + inter / (inter_gbps * 1e9 / 8)


def dim_traffic(
    layout: Layout, collectives: Sequence[Collective], intra_gbps: float, inter_gbps: float
) -> tuple[DimTraffic, ...]:
    """Each mesh dim's collectives as the bytes one rank sends inside and between nodes
    (:func:`split_bytes`), timed at the bandwidths (Gbit/s per device)."""
    traffic = []
    for dim in layout.dims:
        mine = tuple(c for c in collectives if c.dim == dim.name)
        if not mine:
            continue
        intra = inter = overlapped = 0.0
        for c in mine:
            group = c.group_size or dim.size
            nodes = c.nodes if c.nodes is not None else dim.nodes
            a, e = split_bytes(c.kind, c.payload, group, nodes)
            intra, inter = intra + a, inter + e
            if c.overlap == "compute":
                overlapped += seconds_of(a, e, intra_gbps, inter_gbps)
        seconds = seconds_of(intra, inter, intra_gbps, inter_gbps)
        traffic.append(DimTraffic(dim, mine, sum(c.payload for c in mine), intra, inter,
                                  seconds, min(overlapped, seconds)))
    return tuple(traffic)
