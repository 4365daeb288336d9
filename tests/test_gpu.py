"""The gpu tier: the paths CPU runs never take. Skipped, with the reason, without CUDA;
``./dev gpu`` runs it on a machine with GPUs (with a selfcheck of the demo plan on every
visible GPU). NCCL ranks, one CUDA device each: as many as there are, at most 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ParityCase, parity_result
from tests import gpu_workers

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
GPUS = min(torch.cuda.device_count(), 2) if CUDA else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not CUDA, reason="needs CUDA: the gpu tier (./dev gpu) runs it on a "
                       "machine with GPUs"),
]
LLAMA = "tests.gpu_workers:llama"


def cuda_parity(cases: list[ParityCase], results: list[Any]) -> list[Any]:
    """Each case's parity result against its single-process reference run on CUDA (one
    rank), initialized as the ranks on CUDA are; ``results[r][i]`` is rank r's of case i."""
    [references] = run_ranks(gpu_workers.references_on_cuda, 1, args=(cases,), timeout=300)
    return [parity_result(case, [per_rank[i] for per_rank in results], reference=references[i])
            for i, case in enumerate(cases)]


def fsdp_plan(options: str = "", world: int = GPUS) -> str:
    return (f'[mesh]\ndp_shard = {world}\n[[plugins]]\nname = "fsdp2"\n{options}\n'
            '[[plugins]]\nname = "meta_init"\nseed = 7\n')


def test_fsdp2_bf16_mixed_precision_on_cuda() -> None:
    plan = fsdp_plan('mixed_precision = { param_dtype = "bfloat16", reduce_dtype = "float32" }')
    case = ParityCase(task=LLAMA, plan=plan, world_size=GPUS, optimizer="adamw", lr=0.01,
                      param_dtype="bfloat16", steps=5)
    results = run_ranks(gpu_workers.train_many_on_cuda, GPUS, args=([case],),
                        backend="nccl", timeout=300)
    [result] = cuda_parity([case], results)
    # bf16 compute against one process emulating it (a bf16 copy per micro-batch): the
    # bound is bf16's (8 bits of mantissa), not fp32's.
    result.assert_close(rtol=2e-2, atol=2e-2)
    assert result.losses[-1] < result.losses[0], result.losses


def test_fsdp2_offload_keeps_pinned_cpu_shards() -> None:
    plan = fsdp_plan('offload = "cpu"')
    [first, *_] = run_ranks(gpu_workers.offload_state, GPUS, args=(plan,), backend="nccl",
                            timeout=300)
    assert first["devices"] == ["cpu"] and first["pinned"], first
    [plain, *_] = run_ranks(gpu_workers.offload_state, GPUS, args=(fsdp_plan(),),
                            backend="nccl", timeout=300)
    assert plain["devices"] == [f"cuda:{0}"]
    # Offloaded parameters are initialized on the host, from the CPU's generator (the
    # plain run's on the GPU, from CUDA's): against the one-process reference on the CPU.
    from composer_par.testing.parity import train_reference

    reference, _ = train_reference(ParityCase(task=LLAMA, plan=plan, world_size=GPUS,
                                              steps=2, lr=0.05))
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(reference),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(CUDA and GPUS < 2, reason="HSDP's replicate dim needs 2 GPUs")
def test_nccl_comm_hook_of_the_compression_plugin() -> None:
    # Replicate only (HSDP alone, DDP-like): the comm hook runs on NCCL's all-reduce.
    plan = ('[mesh]\ndp_replicate = 2\n[[plugins]]\nname = "hsdp"\n[[plugins]]\n'
            'name = "compress"\nmethod = "bf16"\n'
            'min_compress_numel = 0\n[[plugins]]\nname = "meta_init"\nseed = 7\n')
    case = ParityCase(task=LLAMA, plan=plan, world_size=2, steps=5)
    results = run_ranks(gpu_workers.train_many_on_cuda, 2, args=([case],), backend="nccl",
                        timeout=300)
    [result] = cuda_parity([case], results)
    # bf16 compression of the replicate all-reduce: bf16's bound.
    result.assert_close(rtol=2e-2, atol=2e-2)


def _cp_plan(mode: str, dims: str = "cp = 2") -> str:
    return (f'[mesh]\n{dims}\n' + ('[[plugins]]\nname = "fsdp2"\n' if "dp_shard" in dims
                                   else "")
            + f'[[plugins]]\nname = "cp"\nmode = "{mode}"\n[[plugins]]\nname = "meta_init"\n')


def _cp_ranks(world: int) -> tuple[str, int]:
    """NCCL with a device per rank; else gloo ranks sharing the devices (CUDA tensors
    through gloo; CP's ring rotates K/V by all-to-all there)."""
    return ("nccl", world) if torch.cuda.device_count() >= world else ("gloo", world)


@pytest.mark.parametrize(("plan", "world", "modes", "tasks"), [
    (_cp_plan("{mode}"), 2, ("ring", "allgather", "alltoall"), ["cp_ring_llama"]),
    (_cp_plan("{mode}"), 2, ("allgather", "alltoall"), ["cp_hf_llama", "cp_hf_qwen3"]),
    pytest.param(_cp_plan("{mode}", "dp_shard = 2\ncp = 2"), 4, ("ring", "allgather"),
                 ["cp_ring_llama_kv4"], marks=pytest.mark.skipif(
                     CUDA and torch.cuda.device_count() < 4,
                     reason="needs 4 GPUs: gloo ranks sharing fewer crash in the "
                     "asynchronous all-gather of CUDA tensors that FSDP2's full_tensor runs")),
], ids=["cp2", "cp2_hf", "fsdp2_cp2"])
def test_context_parallel_modes_at_parity_on_cuda(plan: str, world: int, modes: tuple[str, ...],
                                                  tasks: list[str]) -> None:
    """CP modes on CUDA, torch's ring attention among them (the mode CPU runs cannot
    take), against one process: losses and every rank's parameters."""
    cases = [ParityCase(task=f"tests.gpu_workers:{task}", plan=plan.format(mode=mode),
                        world_size=world, steps=4)
             for task in tasks for mode in modes]
    backend, ranks = _cp_ranks(world)
    results = run_ranks(gpu_workers.train_many_on_cuda, ranks, args=(cases,),
                        backend=backend, timeout=400)
    for case, result in zip(cases, cuda_parity(cases, results), strict=True):
        try:
            # CUDA's fused attention and matmul kernels against the CPU's: fp32 sums in
            # another order, so a bound above the CPU tests' 1e-5.
            result.assert_close(rtol=1e-4, atol=1e-4)
        except AssertionError as exc:
            raise AssertionError(f"{case.task} {case.plan!r}: {exc}") from None


def test_cuda_peak_memory_against_the_estimate() -> None:
    [first, *_] = run_ranks(gpu_workers.peak_against_estimate, GPUS,
                            args=(fsdp_plan(), 512, 4 * GPUS), backend="nccl", timeout=300)
    ratio = first["peak"] / first["estimate"]
    print(f"CUDA peak {first['peak'] / 2**20:.0f} MiB, estimate "
          f"{first['estimate'] / 2**20:.0f} MiB, ratio {ratio:.2f}")
    # The estimate is analytic (no allocator slack, no temporaries beyond its model):
    # a ratio far from 1 means it misses a term.
    assert 0.5 < ratio < 2.0, first


def test_load_safetensors_into_cuda_memory(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from composer_par import MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.parity import full_parameters
    from composer_par.testing.tasks import LlamaTask

    with torch.device("meta"):
        model = LlamaTask().build()
    model = ParallelPlan(MeshSpec()).use(MetaInit(seed=3, device="cpu")).apply(model)
    expected = full_parameters(model)
    save_file({k: v.contiguous() for k, v in expected.items()}, tmp_path / "model.safetensors")
    plan = (f'[mesh]\ndp_shard = {GPUS}\n[[plugins]]\nname = "fsdp2"\n[[plugins]]\n'
            f'name = "load_safetensors"\npath = "{tmp_path / "model.safetensors"}"\n')
    for result in run_ranks(gpu_workers.load_safetensors_on_cuda, GPUS, args=(plan,),
                            backend="nccl", timeout=300):
        assert all(d.startswith("cuda") for d in result["devices"]), result["devices"]
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=0, atol=0)


def test_selfcheck_of_the_demo_plan_on_cuda(tmp_path: Path) -> None:
    from composer_par.tools.demo import DEFAULT_PLAN

    plan = tmp_path / "demo.toml"
    plan.write_text(DEFAULT_PLAN)
    ranks = ",".join(str(n) for n in (1, 2, 4) if n <= torch.cuda.device_count())
    done = subprocess.run([sys.executable, "-m", "composer_par.cli", "selfcheck", str(plan),
                           "--model", "composer_par.tools.demo:demo_model", "--ranks", ranks,
                           "--json"], capture_output=True, text=True, timeout=540,
                          cwd=tmp_path)
    doc = json.loads(done.stdout)
    assert done.returncode == 0, done.stderr[-4000:]
    assert all(r["device"].startswith("cuda") for r in doc["rungs"])
    assert {r["backend"] for r in doc["rungs"]} == {"nccl"}
