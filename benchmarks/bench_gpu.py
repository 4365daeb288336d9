"""torchtitan's Llama3 on one GPU, trained by torchtitan's parallelize code and by a
composer_par plan, side by side: bf16, float8 rowwise and float8 tensorwise, with compile.

One model class on both sides: torchtitan's Llama3 of the chosen flavor (``1B`` by
default; ``3B``; ``debugmodel`` for a quick check), built from one config, every RoPE
cache cut to the sequence length. Both sides start from the same weights (torchtitan's
init, seeded, built once) and train on the same batches (seeded random tokens), with
torch's AdamW. torchtitan's side is what its trainer does: ``parallelize_llama`` (per-block
``torch.compile``, then FSDP2 through ``apply_fsdp_to_decoder`` with its bf16
``MixedPrecisionPolicy``; on one GPU a one-rank FSDP2, as torchtitan always applies it).
composer_par's side is a plan: FSDP2 with the same mixed precision, Compile, and for the
float8 modes the float8 plugin.

float8 on torchtitan's side: torchtitan 0.3.0's converter rewrites model configs and knows
the rowwise recipes alone, so its side converts the built model with torchao's
``convert_to_float8_training`` before ``parallelize_llama`` (what torchtitan's converter
did for modules before 0.3.0), over the layers composer_par converts by default: every
Linear of the blocks, the output head left in high precision. Tensorwise adds FSDP2's
float8 all-gather and, after every optimizer step, torchao's
``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan's trainer did; composer_par
does both itself (the float8 plugin and ``plan.training_step``).

Per mode it prints, for each side and as composer_par / torchtitan: tokens per second
(median of the timed steps, steps interleaved side by side after a warm-up that
compiles), MFU with torchtitan's own FLOP count (its ``get_nparams_and_flops``:
6 x the matmul parameters + 12 x layers x heads x head dim x sequence per token) over
989 TFLOP/s (H100 and H200, dense bf16), peak memory (``max_memory_allocated``), and the
largest difference of the two sides' losses. Targets: tokens/s ratio >= 1.00 in every
mode; float8 >= 1.2x bf16 on composer_par's side.

    ./dev gpu          # runs this after the GPU test tier, on a machine with a GPU
    .venv/bin/python benchmarks/bench_gpu.py [--flavor 1B] [--seq 2048] [--batch 2]
        [--modes bf16,rowwise,tensorwise] [--steps 10] [--warmup 3] [--json]
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --flavor debugmodel --layers 2 \\
        --seq 64 --batch 2 --steps 2 --warmup 1 --no-compile    # the set-up, on CPU

On CPU (the quick check of the set-up; no timing means anything there) torchao emulates
float8 and the FLOP peak is still an H100's. Needs torchtitan and torchao: ``./dev``
installs both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("bf16", "rowwise", "tensorwise")
FLAVORS = ("debugmodel", "1B", "3B", "8B")
#: Dense bf16 peak of an H100 SXM and of an H200, FLOP/s (torchtitan's figure).
PEAK_FLOPS = 989e12
TIME_TARGET = 1.00
FLOAT8_TARGET = 1.2


def flops_per_token(params: int, embedding: int, layers: int, heads: int, head_dim: int,
                    seq: int, tied: bool = False) -> int:
    """torchtitan's count: 6 x the parameters in matmuls (all but the embedding's, which
    a tied output head does use) + 12 x layers x heads x head dim x sequence (attention's
    two matmuls, forward and backward, no causal discount)."""
    matmul = params if tied else params - embedding
    return 6 * matmul + 12 * layers * heads * head_dim * seq


def _base() -> Any:
    """benchmarks/bench_vs_torchtitan.py (its CPU stand-ins for torchtitan)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import bench_vs_torchtitan

    return bench_vs_torchtitan


def _missing() -> str | None:
    import importlib.util

    absent = [n for n in ("torchtitan", "torchao") if importlib.util.find_spec(n) is None]
    if absent:
        return (f"{' and '.join(absent)} not installed: ./dev setup installs both (or pip "
                "install -e '.[bench,float8]')")
    return None


def model_config(flavor: str, layers: int | None, seq: int) -> Any:
    import dataclasses

    from torchtitan.models.llama3 import llama3_configs

    cfg = llama3_configs[flavor](attn_backend="flex")
    if layers is not None:
        cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq)
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    set_llama3_sharding_config(cfg, enable_sp=False)
    return cfg


def reference_weights(cfg: Any) -> dict[str, Any]:
    """torchtitan's init, seeded, on the CPU: both sides start from these."""
    import torch

    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _load(model: Any, weights: dict[str, Any]) -> None:
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            full = weights[name.replace("_checkpoint_wrapped_module.", "")
                           .replace("_orig_mod.", "")]
            if isinstance(param, DTensor):
                part = distribute_tensor(full.to(param.device), param.device_mesh,
                                         param.placements, src_data_rank=None)
                param.to_local().copy_(part.to_local())
            else:
                param.copy_(full)


def _keep(module: Any, path: str) -> bool:
    """composer_par's default choice of layers, for torchao's filter on torchtitan's side."""
    return (path.startswith("layers.") and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


def by_torchtitan(cfg: Any, mode: str, device: str, compile_: bool,
                  weights: dict[str, Any]) -> Any:
    import torch
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_utils
    from torchtitan.models.llama3 import parallelize_llama

    parallelism = ParallelismConfig(data_parallel_shard_degree=1,
                                    spmd_backend="partial_dtensor")
    tt_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, 1)
    dims.build_mesh()
    with torch.device("meta"):
        model = cfg.build()
    if mode != "bf16":
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(mode),
                                     emulate=device == "cpu",
                                     enable_fsdp_float8_all_gather=mode == "tensorwise")
        convert_to_float8_training(model, config=config, module_filter_fn=_keep)
    model = parallelize_llama(
        model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="bfloat16"),
        parallelism=parallelism, compile_config=CompileConfig(enable=compile_),
        ac_config=None, dump_folder="")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    _load(model, weights)
    model.train()
    return model


def by_plan(cfg: Any, mode: str, device: str, compile_: bool, weights: dict[str, Any]
            ) -> tuple[Any, Any]:
    import torch

    from composer_par import FSDP2, Compile, Float8, MeshSpec, MixedPrecision, ParallelPlan

    with torch.device(device):
        model = cfg.build()
    _load(model, weights)
    plan = ParallelPlan(MeshSpec(dp_shard=1)).use(FSDP2(
        mixed_precision=MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")))
    if compile_:
        plan.use(Compile())
    if mode != "bf16":
        plan.use(Float8(recipe=mode))
    model = plan.apply(model)
    model.train()
    return plan, model


def _loss(model: Any, tokens: Any) -> Any:
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


class Side:
    """One model, its optimizer and its step; torchtitan's precomputes float8 scales
    after each optimizer step as its trainer does, composer_par's steps through
    ``plan.training_step``."""

    def __init__(self, name: str, model: Any, plan: Any = None, precompute: bool = False
                 ) -> None:
        import torch

        self.name, self.model, self.precompute = name, model, precompute
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.step_fn = (plan.training_step(model, lambda out, t: _loss_of(out, t))
                        if plan is not None else None)
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self, tokens: Any) -> None:
        if self.step_fn is not None:
            loss = self.step_fn.step(tokens[:, :-1], tokens[:, 1:])
        else:
            loss = _loss(self.model, tokens)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.precompute:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)
        self.losses.append(float(loss.detach()))


def _loss_of(logits: Any, labels: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_mode(mode: str, cfg: Any, weights: dict[str, Any], args: argparse.Namespace,
             batches: list[Any]) -> dict[str, Any]:
    """Both sides of one mode: tokens/s, MFU, peak memory, losses."""
    import torch

    device = args.device
    sides: dict[str, Side] = {}
    memory: dict[str, int] = {}
    flops = 0
    for name in ("torchtitan", "composer_par"):
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if name == "torchtitan":
            model = by_torchtitan(cfg, mode, device, args.compile, weights)
            side = Side(name, model, precompute=mode == "tensorwise")
        else:
            plan, model = by_plan(cfg, mode, device, args.compile, weights)
            side = Side(name, model, plan=plan)
        sides[name] = side
        _, flops = cfg.get_nparams_and_flops(model, args.seq)
    tokens = args.batch * args.seq
    for i in range(args.warmup + args.steps):
        batch = batches[i % len(batches)].to(device)
        # Interleaved, alternating which side goes first.
        order = list(sides.values()) if i % 2 == 0 else list(sides.values())[::-1]
        for side in order:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _sync(device)
            start = time.perf_counter()
            side.step(batch)
            _sync(device)
            if i >= args.warmup:
                side.times.append(time.perf_counter() - start)
                if device == "cuda":
                    memory[side.name] = max(memory.get(side.name, 0),
                                            torch.cuda.max_memory_allocated())
    out: dict[str, Any] = {"flops_per_token": flops, "sides": {}}
    for name, side in sides.items():
        median = statistics.median(side.times)
        per_second = tokens / median
        out["sides"][name] = {
            "tokens_per_s": per_second, "mfu": per_second * flops / PEAK_FLOPS,
            "peak_memory_gib": memory.get(name, 0) / 2**30, "losses": side.losses}
    a, b = out["sides"]["composer_par"], out["sides"]["torchtitan"]
    out["ratio"] = {"tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
                    "peak_memory": (a["peak_memory_gib"] / b["peak_memory_gib"]
                                    if b["peak_memory_gib"] else None)}
    out["loss_difference"] = max(abs(x - y) for x, y in zip(a["losses"], b["losses"],
                                                            strict=True))
    del sides
    return out


def _init_process_group(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0,
                            world_size=1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    import structlog
    import torch

    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    if args.device == "cpu":
        _base()._standins()
    _init_process_group(args.device)
    cfg = model_config(args.flavor, args.layers, args.seq)
    weights = reference_weights(cfg)
    gen = torch.Generator().manual_seed(1)
    vocab = cfg.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
               for _ in range(4)]
    report: dict[str, Any] = {
        "flavor": args.flavor, "seq": args.seq, "batch": args.batch, "device": (
            torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
        "peak_flops": PEAK_FLOPS, "modes": {}}
    for mode in args.modes:
        report["modes"][mode] = run_mode(mode, cfg, weights, args, batches)
    bf16 = report["modes"].get("bf16")
    if bf16 is not None:
        base = bf16["sides"]["composer_par"]["tokens_per_s"]
        for result in report["modes"].values():
            result["over_bf16"] = result["sides"]["composer_par"]["tokens_per_s"] / base
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"torchtitan Llama3 {report['flavor']}, seq {report['seq']}, batch "
             f"{report['batch']} on {report['device']} (MFU over "
             f"{report['peak_flops'] / 1e12:.0f} TFLOP/s)",
             f"{'mode':<11}{'side':<14}{'tokens/s':>10}{'MFU':>8}{'peak GiB':>10}"
             f"{'ratio tok/s':>13}{'ratio mem':>11}{'vs bf16':>9}{'max dloss':>11}"]
    for mode, result in report["modes"].items():
        for name in ("torchtitan", "composer_par"):
            side = result["sides"][name]
            ratio = result["ratio"] if name == "composer_par" else None
            mem = "" if ratio is None or ratio["peak_memory"] is None else \
                f"{ratio['peak_memory']:.2f}"
            lines.append(
                f"{mode:<11}{name:<14}{side['tokens_per_s']:>10.0f}{side['mfu']:>8.1%}"
                f"{side['peak_memory_gib']:>10.2f}"
                f"{'' if ratio is None else format(ratio['tokens_per_s'], '.3f'):>13}"
                f"{mem:>11}"
                f"{'' if ratio is None or 'over_bf16' not in result else format(result['over_bf16'], '.2f'):>9}"  # noqa: E501
                f"{'' if ratio is None else format(result['loss_difference'], '.1e'):>11}")
    lines.append(f"targets: composer_par / torchtitan tokens/s >= {TIME_TARGET:.2f} in every "
                 f"mode; float8 >= {FLOAT8_TARGET}x bf16")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--flavor", default="1B", choices=FLAVORS)
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the first N blocks (default: all of the flavor's)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first (compilation)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    missing = _missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench_gpu: no CUDA device visible to torch {torch.__version__}; "
              "--device cpu runs the set-up on the CPU", file=sys.stderr)
        return 2
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
