"""Rank functions and tasks of the gpu tier (tests/test_gpu.py): NCCL ranks, one CUDA
device each, or gloo ranks sharing the devices there are (CUDA tensors through gloo) where
a test needs more ranks than devices."""

from __future__ import annotations

import os
from typing import Any

from tests.cp_workers import ContextLlama


def _device() -> Any:
    import torch

    # Set before the DeviceMesh is built, which then keeps it: with more ranks than
    # devices (gloo), ranks share them.
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


class OnDevice:
    """A parity task (``"module:name"``) whose batches go to the device of the model's
    parameters, with that device the default for what the loss makes (positions): the
    same task runs the CUDA ranks and the CPU reference."""

    def __init__(self, spec: str) -> None:
        self.spec = spec

    @property
    def task(self) -> Any:
        import importlib

        module, _, name = self.spec.partition(":")
        return getattr(importlib.import_module(module), name)

    def build(self) -> Any:
        return self.task.build()

    def batch(self, step: int) -> Any:
        return self.task.batch(step)

    def loss(self, model: Any, batch: Any) -> Any:
        import torch

        device = next(model.parameters()).device
        with torch.device(device):
            return self.task.loss(model, batch.to(device))


llama = OnDevice("composer_par.testing.tasks:llama")
# torch's ring in fp32 (the memory-efficient kernel) takes chunks of 32 tokens or more.
ring_llama = ContextLlama(seq_len=128)
ring_llama_kv4 = ContextLlama(seq_len=128, n_kv_heads=4)
cp_ring_llama = OnDevice("tests.gpu_workers:ring_llama")
cp_ring_llama_kv4 = OnDevice("tests.gpu_workers:ring_llama_kv4")
cp_llama = OnDevice("tests.cp_workers:llama")
cp_llama_kv4 = OnDevice("tests.cp_workers:llama_kv4")
cp_hf_llama = OnDevice("tests.cp_workers:hf_llama")
cp_hf_qwen3 = OnDevice("tests.cp_workers:hf_qwen3")


def train_on_cuda(case: Any) -> tuple[list[float], dict[str, Any]]:
    """:func:`composer_par.testing.parity.train_case` on this rank's CUDA device, the
    parameters brought back to the CPU for the comparison."""
    from composer_par.testing.parity import train_case

    _device()
    losses, params = train_case(case)
    return losses, {k: v.cpu() for k, v in params.items()}


def references_on_cuda(cases: list[Any]) -> list[tuple[list[float], dict[str, Any]]]:
    """Each case's single-process reference on this CUDA device: initialized from CUDA's
    generator, as the ranks on CUDA are (the CPU's draws other numbers)."""
    from composer_par.testing.parity import train_reference

    device = _device()
    out = []
    for case in cases:
        losses, params = train_reference(case, device=str(device))
        out.append((losses, {k: v.cpu() for k, v in params.items()}))
    return out


def train_many_on_cuda(cases: list[Any]) -> list[tuple[list[float], dict[str, Any]]]:
    """:func:`train_on_cuda` for several cases in one run of the ranks."""
    return [train_on_cuda(case) for case in cases]


def offload_state(plan_text: str) -> dict[str, Any]:
    """Apply a plan with ``offload = "cpu"``, train two steps on CUDA: where the
    parameters live (device, pinned) and the losses."""
    import torch
    from torch.distributed.tensor import DTensor

    from composer_par import ParallelPlan
    from composer_par.testing.tasks import LlamaTask

    _device()
    task = LlamaTask()
    plan = ParallelPlan.from_toml(plan_text)
    with torch.device("meta"):
        model = task.build()
    model = plan.apply(model)
    index, count = plan.data_shard()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(2):
        batch = task.batch(step).chunk(count)[index].cuda()
        loss = task.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # the global batch's mean, as the reference's
        losses.append(float(total) / torch.distributed.get_world_size())
    return {"devices": sorted({str(t.device) for t in local}),
            "pinned": all(t.is_pinned() for t in local), "losses": losses}


def peak_against_estimate(plan_text: str, seq: int, batch: int) -> dict[str, Any]:
    """One training step of a mid-sized Llama on CUDA: ``max_memory_allocated`` and the
    estimate's per-rank total for the same layout and workload (AdamW, fp32)."""
    import torch

    from composer_par import ParallelPlan
    from composer_par.estimate import ModelShape, Workload, estimate_plan
    from composer_par.testing.tasks import LlamaTask

    device = _device()
    task = LlamaTask(n_layers=4, dim=1024, n_heads=16, n_kv_heads=8, vocab_size=32000,
                     seq_len=seq, global_batch=batch)
    plan = ParallelPlan.from_toml(plan_text)
    with torch.device("meta"):
        model = task.build()
    shape = ModelShape.from_module(model, plan.block_spec())
    world = torch.distributed.get_world_size()
    _, count = plan.data_shard(0, world)
    est = estimate_plan(plan, shape, Workload(seq=seq, micro_batch=batch // count,
                                              optimizer="adamw"), world_size=world)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model = plan.apply(model)
    index, _ = plan.data_shard()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(2):
        loss = task.loss(model, task.batch(step).chunk(count)[index].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peak = torch.cuda.max_memory_allocated(device) - before
    return {"peak": int(peak), "estimate": int(est.memory.total)}


def load_safetensors_on_cuda(plan_text: str) -> dict[str, Any]:
    """Apply a plan whose loader reads safetensors into CUDA memory: each full parameter
    (on the CPU) and the devices of the local shards."""
    import torch
    from torch.distributed.tensor import DTensor

    from composer_par import ParallelPlan
    from composer_par.testing.parity import full_parameters
    from composer_par.testing.tasks import LlamaTask

    _device()
    plan = ParallelPlan.from_toml(plan_text)
    with torch.device("meta"):
        model = LlamaTask().build()
    model = plan.apply(model)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {"devices": sorted({str(t.device) for t in local}),
            "params": {k: v.cpu() for k, v in full_parameters(model).items()}}
