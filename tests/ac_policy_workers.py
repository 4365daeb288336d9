"""Rank-side functions of tests/test_ac_policies.py and benchmarks/bench_ac_policies.py:
each checkpointing policy trained one step on the project's Llama under TP (and FSDP2),
with the collectives its backward issues counted, its gradients compared with the same
step without checkpointing, and the user op policies the tests load by dotted path."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

# The policies measured, as ActivationCheckpoint options (None: no checkpointing).
VARIANTS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "full": {"mode": "full"},
    "full, early_stop off": {"mode": "full", "early_stop": False},
    "selective (matmul + collectives)": {"mode": "selective"},
    "selective (matmul only)": {"mode": "selective", "save": ["matmul"]},
    "selective, 1 in 2 matmuls": {"mode": "selective", "matmul_every": 2},
    "policy: save nothing": {"mode": "selective",
                             "policy": "tests.ac_policy_workers:save_nothing"},
}


def save_nothing(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A user op policy that recomputes every op: full recomputation by another road."""
    return CheckpointPolicy.PREFER_RECOMPUTE


not_callable = 42


class CountOps(TorchDispatchMode):
    """Counts the aten ops that run, by name (an op on DTensors once, as DTensor's op)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _build(mesh: dict[str, int], options: dict[str, Any] | None, n_layers: int,
           task_options: dict[str, Any] | None = None, sequence_parallel: bool = False
           ) -> Any:
    import torch

    from composer_par import FSDP2, TP, ActivationCheckpoint, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.tasks import LlamaTask

    task = LlamaTask(**{"n_layers": n_layers, **(task_options or {})})
    plan = ParallelPlan(MeshSpec(**mesh)).use(TP(sequence_parallel=sequence_parallel))
    if mesh.get("dp_shard", 1) > 1:
        plan.use(FSDP2())
    if options is not None:
        plan.use(ActivationCheckpoint(**options))
    plan.use(MetaInit(seed=7))
    with torch.device("meta"):
        model = task.build()
    return task, plan, plan.apply(model)


def structure(model: Any) -> dict[str, Any]:
    """What the counts follow from: per block, its Linear layers in the order the forward
    calls them and which of them TP split by rows (weight ``Shard(1)``: each rank holds
    part of the input features, so the forward all-reduces the output over tp)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    order: list[str] = []
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("layers.0."):
            hooks.append(module.register_forward_hook(
                lambda m, a, o, name=name: order.append(name.removeprefix("layers.0."))))
    rowwise = []
    for name, module in model.layers[0].named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and isinstance(weight, DTensor):
            tp = (weight.device_mesh.mesh_dim_names or ()).index("tp")
            if weight.placements[tp] == Shard(1):
                rowwise.append(name)
    return {"hooks": hooks, "call_order": order, "rowwise": rowwise,
            "blocks": len(model.layers)}


def one_step(mesh: dict[str, int], n_layers: int = 2,
             variants: tuple[str, ...] = tuple(VARIANTS),
             task_options: dict[str, Any] | None = None,
             sequence_parallel: bool = False) -> dict[str, Any]:
    """Per variant on this rank: the loss, the collectives of backward per mesh dim, the
    aten ops backward ran, whether every gradient equals the one without checkpointing
    (bitwise: recomputation runs the same CPU kernels on the same inputs), and, by torch's
    memory tracker, the activation bytes held when forward ends (what backward needs:
    saved tensors, a selective checkpoint's cache, the checkpoints' inputs, the loss) and
    their peak during forward; and the peak of activations and backward's temporaries over
    a whole step."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.distributed.tensor import DTensor

    from composer_par import MeshSpec
    from composer_par.testing.comm_count import CommCounter

    rank = torch.distributed.get_rank()
    spec = MeshSpec(**mesh)
    out: dict[str, Any] = {}
    reference: dict[str, torch.Tensor] = {}
    shape: dict[str, Any] = {}
    for label in variants:
        task, plan, model = _build(mesh, VARIANTS[label], n_layers, task_options,
                                   sequence_parallel)
        index, count = plan.data_shard()
        batch = task.batch(0).chunk(count)[index]
        if label == "none":
            shape = structure(model)
        # torch's memory tracker follows tensor storages through a dispatch mode (no
        # allocator statistics needed, so it measures on CPU) and tells activations from
        # parameters, buffers and gradients.
        tracker = MemTracker()
        tracker.track_external(model)
        with CommCounter() as forward_comm, tracker:
            loss = task.loss(model, batch)
            held = tracker.get_tracker_snapshot("current")
            peak = tracker.get_tracker_snapshot("peak")
        for hook in shape.pop("hooks", []):
            hook.remove()
        with CommCounter() as backward_comm, CountOps() as ops:
            loss.backward()
        grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in model.named_parameters()}
        if label == "none":
            reference = grads
        unequal = sorted(n for n, g in grads.items() if not torch.equal(g, reference[n]))
        # The step's peak, backward's recomputation included, in a second step of its own
        # (the tracker would count the modes above as part of the step).
        whole = MemTracker()
        whole.track_external(model)
        with whole:
            task.loss(model, batch).backward()
            step_peak = whole.get_tracker_snapshot("peak")
        out[label] = {
            "loss": float(loss.detach()),
            "forward": forward_comm.summary(spec, rank),
            "backward": backward_comm.summary(spec, rank),
            "ops": dict(ops.ops),
            "unequal_grads": unequal,
            "grads": len(grads),
            "activation_bytes": sum(int(d[_MemRefType.ACT]) for d in held.values()),
            "peak_activation_bytes": sum(int(d[_MemRefType.ACT]) for d in peak.values()),
            # Activations and backward's temporaries (recomputed tensors among them).
            "step_peak_bytes": sum(int(d[_MemRefType.ACT]) + int(d[_MemRefType.TEMP])
                                   for d in step_peak.values()),
        }
    out["structure"] = shape
    return out


def calls(summary: dict[str, dict[str, dict[str, int]]], dim: str) -> int:
    """All collective calls over mesh dim ``dim`` in a CommCounter summary."""
    return sum(kind["calls"] for kind in summary.get(dim, {}).values())
