"""The gpu tier: the paths CPU runs never take. Skipped, with the reason, without CUDA;
``./dev gpu`` runs it on a machine with GPUs (with a selfcheck of the demo plan on every
visible GPU). NCCL ranks, one CUDA device each: as many as there are, at most 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
LLAMA = "composer_par.testing.tasks:llama"


def fsdp_plan(options: str = "", world: int = GPUS) -> str:
    return (f'[mesh]\ndp_shard = {world}\n[[plugins]]\nname = "fsdp2"\n{options}\n'
            '[[plugins]]\nname = "meta_init"\nseed = 7\n')


def test_fsdp2_bf16_mixed_precision_on_cuda() -> None:
    plan = fsdp_plan('mixed_precision = { param_dtype = "bfloat16", reduce_dtype = "float32" }')
    case = ParityCase(task=LLAMA, plan=plan, world_size=GPUS, optimizer="adamw", lr=0.01,
                      param_dtype="bfloat16", steps=5)
    results = run_ranks(gpu_workers.train_on_cuda, GPUS, args=(case,), backend="nccl",
                        timeout=300)
    result = parity_result(case, results)
    # bf16 on CUDA against bf16 emulated on the CPU: the kernels differ, so the bound is
    # bf16's (8 bits of mantissa), not fp32's.
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
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(plain["losses"]),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(CUDA and GPUS < 2, reason="HSDP's replicate dim needs 2 GPUs")
def test_nccl_comm_hook_of_the_compression_plugin() -> None:
    # Replicate only (HSDP alone, DDP-like): the comm hook runs on NCCL's all-reduce.
    plan = ('[mesh]\ndp_replicate = 2\n[[plugins]]\nname = "hsdp"\n[[plugins]]\n'
            'name = "compress"\nmethod = "bf16"\n'
            'min_compress_numel = 0\n[[plugins]]\nname = "meta_init"\nseed = 7\n')
    case = ParityCase(task=LLAMA, plan=plan, world_size=2, steps=5)
    results = run_ranks(gpu_workers.train_on_cuda, 2, args=(case,), backend="nccl",
                        timeout=300)
    result = parity_result(case, results)
    # bf16 compression of the replicate all-reduce: bf16's bound.
    result.assert_close(rtol=2e-2, atol=2e-2)


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
