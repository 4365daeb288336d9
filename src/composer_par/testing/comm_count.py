"""Count collectives per process group, with their bytes: a dispatch mode over c10d ops.

``CommDebugMode`` counts FSDP2's collectives but says neither how many bytes moved nor
over which process group. :class:`CommCounter` does both, for the c10d ops
(``dist.all_gather_into_tensor`` and friends, what FSDP2 and DDP call) and the
functional collectives (``torch.ops._c10d_functional``, what DTensor and TP call)::

    with CommCounter() as counter:
        loss = model(batch).sum()
        loss.backward()
    counter.summary(mesh_spec, rank)
    # {"dp_shard": {"all_gather": {"calls": 5, "bytes": 1234}, ...}, "dp_replicate": ...}

Bytes are *logical payload* bytes, the size of the whole tensor the collective is
about, never what a backend moves on the wire:

* all-gather: the gathered output (every rank's shard together);
* reduce-scatter: the input (the full tensor before scattering);
* all-reduce, broadcast, reduce: the tensor;
* all-to-all, gather, scatter, send, recv: the input (or the tensors) of this rank.

So a backend that runs a reduce-scatter as an all-reduce of the full tensor and keeps
its slice has the same payload as one that runs a real reduce-scatter, and
:mod:`composer_par.estimate` reports its predictions in the same unit.

Collectives DTensor issues inside its own dispatch (an operator's redistribution of
its inputs, loss-parallel cross-entropy's reductions) are counted too: the mode declines
ops on DTensors, as ``CommDebugMode`` does, so they reach it after DTensor has turned
them into plain-tensor ops and collectives. The two agree call for call (tested).

A call is recorded at dispatch, before the backend runs it; asynchronous work is
counted when issued. The mode must be active on the thread that issues the
collectives (on CPU the autograd engine runs backward on the calling thread).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import torch_private

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from composer_par.mesh import MeshSpec

__all__ = ["Call", "CommCounter", "collective_kind", "group_label", "wire_bytes"]

NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})

# op name -> (kind, the argument whose bytes are the payload, multiply by group_size).
# Names are the same in every namespace that has them.
_OPS: dict[str, tuple[str, str, bool]] = {
    # c10d (torch.distributed's eager API)
    "allgather_": ("all_gather", "output_tensors", False),
    "_allgather_base_": ("all_gather", "output_tensor", False),
    "allgather_coalesced_": ("all_gather", "output_lists", False),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs", False),
    "reduce_scatter_": ("reduce_scatter", "input_tensors", False),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", False),
    "allreduce_": ("all_reduce", "tensors", False),
    "allreduce_coalesced_": ("all_reduce", "tensors", False),
    "broadcast_": ("broadcast", "tensors", False),
    "reduce_": ("reduce", "tensors", False),
    "alltoall_": ("all_to_all", "input_tensors", False),
    "alltoall_base_": ("all_to_all", "input", False),
    "gather_": ("gather", "input_tensors", False),
    "scatter_": ("scatter", "input_tensors", False),
    "send": ("send", "tensors", False),
    "recv_": ("recv", "tensors", False),
    "recv_any_source_": ("recv", "tensors", False),
    "barrier": ("barrier", "", False),
    "monitored_barrier_": ("barrier", "", False),
    # functional collectives (DTensor, TP, compiled code)
    "all_gather_into_tensor": ("all_gather", "input", True),
    "all_gather_into_tensor_out": ("all_gather", "input", True),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs", True),
    "reduce_scatter_tensor": ("reduce_scatter", "input", False),
    "reduce_scatter_tensor_out": ("reduce_scatter", "input", False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", False),
    "all_reduce": ("all_reduce", "input", False),
    "all_reduce_": ("all_reduce", "input", False),
    "all_reduce_coalesced": ("all_reduce", "inputs", False),
    "all_reduce_coalesced_": ("all_reduce", "inputs", False),
    "broadcast": ("broadcast", "input", False),
    "all_to_all_single": ("all_to_all", "input", False),
    # DTensor's own (a shard-dim change on one mesh dim)
    "shard_dim_alltoall": ("all_to_all", "input", False),
    "isend": ("send", "tensor", False),
    "irecv": ("recv", "tensor", False),
    "batch_p2p_ops": ("p2p", "tensors", False),
}


@attrs.frozen
class Call:
    """One collective as issued by this rank."""

    kind: str  # all_gather, reduce_scatter, all_reduce, broadcast, all_to_all, ...
    op: str  # e.g. "c10d._reduce_scatter_base_.default"
    group: tuple[int, ...]  # the global ranks of its process group, sorted
    group_name: str
    payload_bytes: int  # logical bytes (see the module docstring)
    dtypes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "op": self.op, "group": list(self.group),
                "group_name": self.group_name, "bytes": self.payload_bytes,
                "dtypes": list(self.dtypes)}


def wire_bytes(call: Call) -> float:
    """Bytes this rank sends for ``call`` with a bandwidth-optimal algorithm (ring).

    Logical payload (``Call.payload_bytes``) counts an all-reduce of ``n`` bytes as ``n``
    and the reduce-scatter plus all-gather it is made of as ``2n``, so it cannot compare
    an all-reduce with other collectives. Wire bytes can: with ``G`` ranks in the group,
    an all-reduce sends ``2 (G-1)/G * n``, a reduce-scatter (``n`` = its input), an
    all-gather (``n`` = its output) and an all-to-all (``n`` = this rank's input)
    ``(G-1)/G * n``; a broadcast, reduce, gather, scatter or send ``(G-1)/G * n`` (as a
    pipelined tree would, on average per rank); a receive nothing. A group of one rank
    sends nothing.
    """
    size = len(call.group)
    if size <= 1 or call.kind in ("recv", "barrier"):
        return 0.0
    share = (size - 1) / size
    if call.kind == "all_reduce":
        return 2 * share * call.payload_bytes
    if call.kind in ("send", "p2p"):
        return float(call.payload_bytes)
    return share * call.payload_bytes


def collective_kind(op_name: str) -> str | None:
    """``"all_gather"`` for ``_allgather_base_`` etc.; None for a non-collective op."""
    entry = _OPS.get(op_name)
    return entry[0] if entry else None


def _tensors(value: Any) -> Iterable[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _resolve_group(value: Any) -> Any:
    """The ProcessGroup an op argument names (a boxed ScriptObject, a ProcessGroup, or
    the group name functional collectives pass)."""
    import torch.distributed as dist
    if isinstance(value, str):
        return torch_private.resolve_group(value)
    if isinstance(value, dist.ProcessGroup):
        return value
    return dist.ProcessGroup.unbox(value)


class CommCounter(torch_private.torch_dispatch_mode()):  # type: ignore[misc]
    """A dispatch mode recording every collective issued while it is active.

    ``calls`` lists them in order; :meth:`by_group` and :meth:`summary` total them.
    The mode passes every op through unchanged.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self._groups: dict[int, tuple[tuple[int, ...], str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch_private.higher_order_operator()):
            return func(*args, **kwargs)
        if _DTensor is not None and any(issubclass(t, _DTensor) for t in types):
            # A mode runs before tensor subclasses do: an op on DTensors reaches here whole,
            # and the collectives DTensor issues to carry it out (redistributions inside
            # its dispatch, loss-parallel's reductions) would run with this mode popped.
            # Declining lets DTensor run first; those collectives then come back here as
            # plain-tensor ops.
            return NotImplemented
        if func.namespace in NAMESPACES:
            entry = _OPS.get(torch_private.op_schema(func)[0].split("::", 1)[1])
            if entry is not None:
                self._record(func, entry, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func: Any, entry: tuple[str, str, bool], args: Any, kwargs: Any) -> None:
        kind, payload_arg, times_group = entry
        named: dict[str, Any] = {}
        for index, argument in enumerate(torch_private.op_schema(func)[1]):
            if index < len(args):
                named[argument] = args[index]
            elif argument in kwargs:
                named[argument] = kwargs[argument]
        group_arg = named.get("process_group", named.get("group_name"))
        group, name = self._group(group_arg)
        tensors = list(_tensors(named.get(payload_arg))) if payload_arg else []
        payload = sum(t.numel() * t.element_size() for t in tensors)
        if times_group:
            payload *= int(named.get("group_size", len(group)))
        dtypes = tuple(sorted({str(t.dtype).removeprefix("torch.") for t in tensors}))
        self.calls.append(Call(kind, str(func), group, name, payload, dtypes))

    def _group(self, value: Any) -> tuple[tuple[int, ...], str]:
        import torch.distributed as dist

        if value is None:
            return (), ""
        pg = _resolve_group(value)
        key = id(pg)
        if key not in self._groups:
            ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
            self._groups[key] = (ranks, str(getattr(pg, "group_name", "")))
        return self._groups[key]

    # -- totals ---------------------------------------------------------------------

    def clear(self) -> None:
        self.calls.clear()

    def by_group(self) -> dict[tuple[int, ...], dict[str, dict[str, int]]]:
        """``{group ranks: {kind: {"calls": n, "bytes": b}}}``."""
        out: dict[tuple[int, ...], dict[str, dict[str, int]]] = defaultdict(dict)
        for call in self.calls:
            slot = out[call.group].setdefault(call.kind, {"calls": 0, "bytes": 0})
            slot["calls"] += 1
            slot["bytes"] += call.payload_bytes
        return dict(out)

    def summary(self, mesh: MeshSpec, rank: int) -> dict[str, dict[str, dict[str, int]]]:
        """Totals per mesh dim: ``{dim label: {kind: {"calls": n, "bytes": b}}}``.

        A group is labelled by :func:`group_label` (``"dp_shard"``, ``"dp_replicate+dp_shard"``,
        ``"dp_shard (subgroup)"``, ...).
        """
        out: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
        for group, kinds in self.by_group().items():
            label = group_label(mesh, rank, group)
            for kind, totals in kinds.items():
                slot = out[label].setdefault(kind, {"calls": 0, "bytes": 0})
                slot["calls"] += totals["calls"]
                slot["bytes"] += totals["bytes"]
        return dict(out)

    def wire_bytes_by_dim(self, mesh: MeshSpec, rank: int) -> dict[str, float]:
        """Bytes this rank sends per mesh dim label (see :func:`wire_bytes`)."""
        out: dict[str, float] = defaultdict(float)
        for call in self.calls:
            out[group_label(mesh, rank, call.group)] += wire_bytes(call)
        return dict(out)



def group_label(mesh: MeshSpec, rank: int, group: Iterable[int]) -> str:
    """Which mesh dims a process group of ``rank`` spans.

    The group of the ranks that differ from ``rank`` only on mesh dims S is labelled
    with S joined by ``+`` (outermost first); a group inside such a set but smaller
    (e.g. FSDP2's groups for an int ``reshard_after_forward``) is ``"<S> (subgroup)"``;
    an empty group (a collective without one) is ``"none"``; a group of this rank alone
    ``"self"``; one without this rank ``"other"``.
    """
    members = frozenset(group)
    if not members:
        return "none"
    if rank not in members:
        return "other"
    names = [n for n in mesh.names if mesh.size(n) > 1]
    spans: list[tuple[tuple[str, ...], frozenset[int]]] = []
    for count in range(1, len(names) + 1):
        for dims in itertools.combinations(names, count):
            spans.append((dims, _span(mesh, rank, dims)))
    for dims, ranks in spans:
        if members == ranks:
            return "+".join(dims)
    if members == frozenset({rank}):
        return "self"
    for dims, ranks in spans:  # smallest first: combinations come in size order
        if members <= ranks:
            return "+".join(dims) + " (subgroup)"
    return "other"


def _span(mesh: MeshSpec, rank: int, dims: tuple[str, ...]) -> frozenset[int]:
    coord = mesh.coordinate(rank)
    ranges = [range(mesh.size(d)) for d in dims]
    out = set()
    for values in itertools.product(*ranges):
        out.add(mesh.rank_of({**coord, **dict(zip(dims, values, strict=True))}))
    return frozenset(out)
