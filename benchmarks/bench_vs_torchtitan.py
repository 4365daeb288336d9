"""torchtitan's own Llama3, parallelized by torchtitan and by composer_par, side by side.

One model class on both sides: torchtitan's Llama3 (its ``debugmodel`` flavor: 6 blocks,
dim 256, 16 heads, fused q/k/v, vocabulary 2048), built from one config. Every rank builds
the same reference weights once (seeded) and both sides start from them; every step both
sides see the same batch (each rank its data-parallel shard). torchtitan's side is what its
trainer does: ``ParallelDims.build_mesh``, ``parallelize_llama`` (TP through its sharding
configs, its ``FullAC`` / ``SelectiveAC``, FSDP2 through ``apply_fsdp_to_decoder``),
``to_empty``, ``init_weights``, in float32 (``mixed_precision_param="float32"``, as
composer_par trains without a mixed-precision policy), on its ``partial_dtensor`` backend
(DTensor for tensor parallelism, as composer_par uses). composer_par's side is a
ParallelPlan with FSDP2, HSDP, TP and ActivationCheckpoint. The step is the same on both:
forward, cross-entropy (under torch's ``loss_parallel`` when the head's logits are
vocabulary-sharded), backward, torch's AdamW step, zero_grad.

Modes on 4 gloo ranks: FSDP 4, HSDP 2 x 2, FSDP 2 x TP 2, each with activation
checkpointing none, full or selective. TP runs without sequence parallelism on both sides
(torchtitan's default has it on; this benchmark has no sequence-parallel composer_par plan
for torchtitan's modules yet, see ``TP_PLAN``). Per mode it prints:

* the step-time ratio composer_par / torchtitan: the slowest rank's step, steps
  interleaved (alternating which side goes first), ratio of medians and of minima;
* collectives and payload bytes per step on each side, counted by
  ``composer_par.testing.comm_count.CommCounter`` (the rank with the most), with torch's
  ``CommDebugMode`` call count next to it as a cross-check;
* collectives re-issued in backward under checkpointing: backward's collectives with
  checkpointing minus backward's without, same side and mesh (when both were run);
* whether the losses of every step are equal (bitwise, else the largest difference) and
  the largest difference of the parameters after the last step.

Targets: step-time ratio <= 1.00; composer_par's collectives and bytes no more than
torchtitan's. A CPU run needs stand-ins for torchtitan's accelerator-only pieces; they live
in this file alone, each with its reason: ``_standins`` (device type, Triton kernels,
FlexAttention), SUM reductions for torchtitan's FSDP modules on gloo (``by_torchtitan``),
and its model config's runtime settings applied without importing its trainer
(``_config``).

    .venv/bin/python benchmarks/bench_vs_torchtitan.py [--modes fsdp,hsdp] [--ac none,full]
        [--steps 2] [--repeats 10] [--layers 6] [--json]

Needs torchtitan: ``./dev`` installs it (its model and parallelize code, without its
trainer's requirements), or ``pip install -e .[bench]`` with everything it declares.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

TIME_TARGET = 1.00
RANKS = 4
VOCAB = 2048

# name -> (composer_par mesh, outermost first; torchtitan degrees: replicate, shard, tp)
MODES: dict[str, tuple[dict[str, int], tuple[int, int, int]]] = {
    "fsdp": ({"dp_shard": 4}, (1, 4, 1)),
    "hsdp": ({"dp_replicate": 2, "dp_shard": 2}, (2, 2, 1)),
    "fsdp_tp": ({"dp_shard": 2, "tp": 2}, (1, 2, 2)),
}
ACS = ("none", "full", "selective")

# composer_par's TP plan for torchtitan's module names. The fused q/k/v Linear stacks
# per kv-head groups (q heads, k, v) on its output features, so a plain column split
# keeps whole groups on each rank, as torchtitan's own sharding does. The token embedding
# stays whole over tp (FSDP still shards it over dp_shard): torchtitan's Embedding.forward
# takes its weight's local tensor and, without the tp group only torchtitan's parallelize
# gives it, embeds into that alone, so torch's DTensor embedding styles (a DTensor input
# beside a local weight) cannot drive it. That costs memory and saves a forward all-reduce.
TP_PLAN = {
    "layers.*.attention.qkv_linear.wqkv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "lm_head": "colwise_gather",
}


def _missing_torchtitan() -> str | None:
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        return ("torchtitan is not installed: pip install -e '.[bench]' (or "
                "pip install torchtitan==0.3.0 --no-deps and its bench extra's packages)")
    return None


_STANDINS_DONE = False


def _standins() -> None:
    """Make torchtitan's Llama3 importable and trainable on CPU ranks. Each patch is the
    smallest that works and touches torchtitan alone, never composer_par."""
    global _STANDINS_DONE
    if _STANDINS_DONE:
        return
    import types

    import torch
    import torch._utils as torch_utils
    import torch.nn.functional as F

    # 1. torchtitan.tools.utils picks its device at import with
    #    ``_get_available_device_type() or "cuda"``: on a machine without an accelerator
    #    that is "cuda", and its meshes would be CUDA meshes. Let that one import see "cpu".
    original = torch_utils._get_available_device_type
    torch_utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils  # noqa: F401
    finally:
        torch_utils._get_available_device_type = original

    # 2. The model package imports the MoE token dispatcher, which imports Triton kernels
    #    for expert parallelism at module level (Triton is CUDA-only and not installed
    #    here). A dense Llama never calls them: an empty module stands in, and any use of
    #    one of its names says why it failed.
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name not in sys.modules:
        kernels = types.ModuleType(name)

        def kernel(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)

            def unavailable(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(f"{name}.{attr} needs Triton (CUDA); the CPU benchmark "
                                   "stands in an empty module for it")
            return unavailable

        kernels.__getattr__ = kernel  # type: ignore[method-assign]
        sys.modules[name] = kernels

    # 3. torchtitan's language models attend with FlexAttention, compiled by inductor for
    #    GPUs; on CPU, eager flex_attention has no backward. Every sequence here is one
    #    document, so the block-causal mask is the causal mask: the same attention through
    #    scaled_dot_product_attention. The same module runs on both sides.
    from torchtitan.models.common.attention import FlexAttention

    def causal_attention(self: Any, q_BLNH: Any, k_BLNH: Any, v_BLNH: Any, *,
                         attention_masks: Any = None, score_mod: Any = None,
                         scale: float | None = None, enable_gqa: bool = False,
                         out_transform: Any = None, **kwargs: Any) -> Any:
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("the CPU stand-in for FlexAttention is causal "
                                      "attention only (no score_mod, no out_transform)")
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    FlexAttention.forward = causal_attention  # type: ignore[method-assign]
    del torch
    _STANDINS_DONE = True


def _config(layers: int, seq: int, tp: int, sequence_parallel: bool) -> Any:
    """torchtitan's debugmodel config, its RoPE cache cut to ``seq`` and its sharding
    configs set for the parallelism: what its trainer's ``update_from_config`` does for
    this model, called piece by piece because that method imports the whole trainer
    (datasets, tensorboard, wandb), which building and parallelizing the model never use."""
    import dataclasses

    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    cfg.layers = cfg.layers[:layers]
    heads = cfg.layers[0].attention.n_heads
    if heads % tp:
        raise ValueError(f"tp {tp} must divide the {heads} attention heads")
    for layer in cfg.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq)
    set_llama3_sharding_config(cfg, enable_sp=sequence_parallel)
    return cfg


def _reference(cfg: Any) -> dict[str, Any]:
    """The starting weights, the same on every rank: torchtitan's init, seeded."""
    import torch

    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def by_torchtitan(cfg: Any, world: int, degrees: tuple[int, int, int], ac: str,
                  sequence_parallel: bool, weights: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama

    replicate, shard, tp = degrees
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=replicate, data_parallel_shard_degree=shard,
        tensor_parallel_degree=tp, enable_sequence_parallel=sequence_parallel,
        spmd_backend="partial_dtensor")
    tt_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    ac_config = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[ac]
    with torch.device("meta"):
        model = cfg.build()
    model = parallelize_llama(
        model, parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism, compile_config=CompileConfig(), ac_config=ac_config,
        dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, param in model.named_parameters():
            full = weights[_clean(name)]
            if isinstance(param, DTensor):
                part = distribute_tensor(full, param.device_mesh, param.placements,
                                         src_data_rank=None)
                param.to_local().copy_(part.to_local())
            else:
                param.copy_(full)
    # torchtitan sums gradients over data parallelism (divide factor 1: its loss is
    # divided by the global token count), which FSDP2 issues as PREMUL_SUM(1.0), an NCCL
    # op gloo refuses; plain SUM reductions are the same sums on gloo.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.train()
    if dims.dp_enabled:
        batch = dims.get_mesh("batch")
        shard_of = (batch.get_local_rank(), batch.size())
    else:
        shard_of = (0, 1)
    return model, shard_of


def by_plan(cfg: Any, mesh: dict[str, int], ac: str, sequence_parallel: bool,
            weights: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    from composer_par import FSDP2, HSDP, TP, ActivationCheckpoint, MeshSpec, ParallelPlan

    model = cfg.build()
    with torch.no_grad():
        model.init_states()
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    plan = ParallelPlan(MeshSpec(**mesh)).use(
        FSDP2(gradient_divide_factor=1.0) if sum_gradients() else FSDP2())
    if "dp_replicate" in mesh:
        plan.use(HSDP())
    if "tp" in mesh:
        # replicate_rest off: its replicate style hands modules DTensor inputs, and
        # torchtitan's Embedding runs on its weight's local tensor (see TP_PLAN). The
        # parameters then sit on two meshes, as on torchtitan's side; AdamW's foreach path
        # takes that, and no clip_grad_norm_ runs here.
        plan.use(TP(plan=TP_PLAN, sequence_parallel=sequence_parallel, loss_parallel=True,
                    replicate_rest=False))
    if ac != "none":
        plan.use(ActivationCheckpoint(mode=ac))
    model = plan.apply(model)
    model.train()
    return model, plan.data_shard()


def sum_gradients() -> bool:
    """Whether composer_par's FSDP2 takes a gradient divide factor: then both sides train
    as torchtitan does (loss summed over tokens divided by the global token count,
    gradients summed over data parallelism); else composer_par takes the mean loss of its
    batch and averages the gradients (the same mean gradient, other roundings)."""
    import attrs

    from composer_par import FSDP2

    return "gradient_divide_factor" in attrs.fields_dict(FSDP2)


class _Side:
    """One parallelized model, its optimizer and its data shard."""

    def __init__(self, model: Any, shard: tuple[int, int], sum_gradients: bool) -> None:
        import torch

        self.model = model
        self.shard = shard
        self.sum_gradients = sum_gradients
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.losses: list[float] = []

    def step(self, batch: Any, between: Any = None) -> None:
        """One training step on this rank's shard of ``batch``; ``between`` is called
        after forward and before backward (to split collective counts). Records the
        loss backward starts from."""
        import torch.nn.functional as F
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        index, count = self.shard
        tokens = batch.chunk(count)[index]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        # torch's loss_parallel changes nothing without vocabulary-sharded logits.
        with loss_parallel():
            logits = self.model(inputs)
            if self.sum_gradients:
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                       reduction="sum") / batch[:, 1:].numel()
            else:
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            if between is not None:
                between()
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        value = loss.to_local() if isinstance(loss, DTensor) else loss
        self.losses.append(float(value.detach()))


def _timed_step(side: _Side, batch: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    side.step(batch)
    return time.perf_counter() - start


def _counted_step(side: _Side, batch: Any) -> dict[str, Any]:
    """Collectives of one step: CommCounter (forward and backward apart) on one step and
    CommDebugMode on the next, so that neither mode sees the other."""
    from torch.distributed.tensor.debug import CommDebugMode

    from composer_par.testing.comm_count import CommCounter

    counter = CommCounter()
    marks: list[int] = []
    with counter:
        side.step(batch, between=lambda: marks.append(len(counter.calls)))
    forward = counter.calls[:marks[0]]
    backward = counter.calls[marks[0]:]
    debug = CommDebugMode()
    with debug:
        side.step(batch)
    kinds: dict[str, int] = {}
    for call in counter.calls:
        kinds[call.kind] = kinds.get(call.kind, 0) + 1
    return {"calls": len(counter.calls),
            "bytes": sum(c.payload_bytes for c in counter.calls),
            "forward_calls": len(forward), "backward_calls": len(backward),
            "kinds": kinds, "comm_debug_calls": int(debug.get_total_counts())}


def _param_diff(a: Any, b: Any) -> float:
    """Largest difference of the two sides' full parameters (gathered; same on every
    rank)."""
    import torch
    from torch.distributed.tensor import DTensor

    other = {_clean(n): p for n, p in b.named_parameters()}
    worst = 0.0
    with torch.no_grad():
        for name, param in a.named_parameters():
            mine = param.full_tensor() if isinstance(param, DTensor) else param
            theirs = other[_clean(name)]
            theirs = theirs.full_tensor() if isinstance(theirs, DTensor) else theirs
            worst = max(worst, float((mine - theirs).abs().max()))
    return worst


def _rank_main(modes: list[str], acs: list[str], layers: int, seq: int, batch: int,
               steps: int, repeats: int, warmup: int, sequence_parallel: bool,
               ) -> dict[str, Any]:
    import logging

    import structlog
    import torch
    import torch.distributed as dist

    # The plan logs one line per transform at apply, torchtitan one per stage: keep the
    # terminal for the table.
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    _standins()
    world = dist.get_world_size()
    summed = sum_gradients()
    gen = torch.Generator().manual_seed(1)
    # seq + 1 tokens: inputs and next-token labels of seq tokens each.
    batches = [torch.randint(0, VOCAB, (batch, seq + 1), generator=gen)
               for _ in range(max(steps, 1))]
    out: dict[str, Any] = {}
    for mode in modes:
        mesh, degrees = MODES[mode]
        if world != RANKS:  # the quick check runs FSDP over however many ranks it has
            mesh, degrees = {"dp_shard": world}, (1, world, 1)
        tp = degrees[2]
        cfg = _config(layers, seq, tp, sequence_parallel)
        weights = _reference(cfg)
        for ac in acs:
            tt_model, tt_shard = by_torchtitan(cfg, world, degrees, ac, sequence_parallel,
                                               weights)
            cp_model, cp_shard = by_plan(cfg, mesh, ac, sequence_parallel, weights)
            if tuple(tt_shard) != tuple(cp_shard):
                raise AssertionError(f"{mode}: torchtitan reads data shard {tt_shard}, "
                                     f"composer_par {cp_shard}")
            sides = {"torchtitan": _Side(tt_model, tt_shard, True),
                     "composer_par": _Side(cp_model, cp_shard, summed)}
            record: dict[str, Any] = {"counts": {}, "times": {n: [] for n in sides}}
            step = 0
            for _ in range(steps):
                for side in sides.values():
                    side.step(batches[step % len(batches)])
                step += 1
            for name, side in sides.items():
                record["counts"][name] = _counted_step(side, batches[step % len(batches)])
            step += 2
            for _ in range(warmup):
                for side in sides.values():
                    side.step(batches[step % len(batches)])
                step += 1
            for repeat in range(repeats):
                order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
                for name in order:
                    record["times"][name].append(
                        _timed_step(sides[name], batches[step % len(batches)]))
                step += 1
            record["losses"] = {n: s.losses for n, s in sides.items()}
            record["param_diff"] = _param_diff(cp_model, tt_model)
            record["summed"] = summed
            out[f"{mode}/{ac}"] = record
            del sides, tt_model, cp_model
    return out


def _summarize(results: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for key in results[0]:
        rows = [r[key] for r in results]
        entry: dict[str, Any] = {"sides": {}}
        for side in ("torchtitan", "composer_par"):
            worst = [max(r["times"][side][i] for r in rows) for i in range(repeats)]
            counts = [r["counts"][side] for r in rows]
            entry["sides"][side] = {
                "median_ms": statistics.median(worst) * 1e3 if worst else None,
                "min_ms": min(worst) * 1e3 if worst else None,
                # The largest rank's counts: ranks of one mesh issue the same collectives,
                # except where a shard's size differs.
                "calls": max(c["calls"] for c in counts),
                "bytes": max(c["bytes"] for c in counts),
                "forward_calls": max(c["forward_calls"] for c in counts),
                "backward_calls": max(c["backward_calls"] for c in counts),
                "kinds": counts[0]["kinds"],
                "comm_debug_calls": max(c["comm_debug_calls"] for c in counts),
            }
        theirs, ours = entry["sides"]["torchtitan"], entry["sides"]["composer_par"]
        if repeats:
            entry["ratio_median"] = ours["median_ms"] / theirs["median_ms"]
            entry["ratio_min"] = ours["min_ms"] / theirs["min_ms"]
        diffs = [max((abs(a - b) for a, b in zip(r["losses"]["torchtitan"],
                                                  r["losses"]["composer_par"], strict=True)),
                     default=0.0) for r in rows]
        entry["losses_bitwise"] = all(r["losses"]["torchtitan"] == r["losses"]["composer_par"]
                                      for r in rows)
        entry["loss_max_diff"] = max(diffs)
        entry["param_max_diff"] = max(r["param_diff"] for r in rows)
        entry["summed"] = rows[0]["summed"]
        report[key] = entry
    for key, entry in report.items():
        mode, ac = key.split("/")
        base = report.get(f"{mode}/none")
        for side, numbers in entry["sides"].items():
            numbers["reissued_in_backward"] = (
                None if ac == "none" or base is None
                else numbers["backward_calls"] - base["sides"][side]["backward_calls"])
    return report


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _print(report: dict[str, Any], args: argparse.Namespace, load: tuple[float, float]
           ) -> None:
    print(f"torchtitan's Llama3 debugmodel ({args.layers} blocks, dim 256), torchtitan "
          f"vs composer_par, {RANKS} gloo ranks, seq {args.seq}, global batch {args.batch}, "
          f"{args.steps} untimed steps, {args.repeats} interleaved timed repeats "
          f"({os.cpu_count()} cores; load average {load[0]:.1f} before, {load[1]:.1f} "
          f"after). Times: the slowest rank's step. Gradients "
          + ("summed over data parallelism on both sides (torchtitan's convention)."
             if report and next(iter(report.values()))["summed"] else
             "summed by torchtitan, averaged by composer_par (its FSDP2 has no divide "
             "factor): losses compared as each side computes them."))
    for key, e in report.items():
        tt, cp = e["sides"]["torchtitan"], e["sides"]["composer_par"]
        print(f"  {key}")
        if "ratio_median" in e:
            print(f"    step   torchtitan median {tt['median_ms']:7.1f} ms (min "
                  f"{tt['min_ms']:7.1f}), composer_par median {cp['median_ms']:7.1f} ms "
                  f"(min {cp['min_ms']:7.1f}): ratio of medians {e['ratio_median']:.3f} "
                  f"{_verdict(e['ratio_median'] <= TIME_TARGET)} (<= {TIME_TARGET:.2f}), "
                  f"of minima {e['ratio_min']:.3f}")
        for label, side in (("torchtitan", tt), ("composer_par", cp)):
            reissued = side["reissued_in_backward"]
            agree = "agrees" if side["comm_debug_calls"] == side["calls"] else "DIFFERS"
            print(f"    {label:12s} {side['calls']:4d} collectives ({side['forward_calls']} "
                  f"forward, {side['backward_calls']} backward; CommDebugMode "
                  f"{side['comm_debug_calls']}: {agree}), {side['bytes'] / 1024:9.1f} KiB"
                  + ("" if reissued is None else f", re-issued in backward {reissued}"))
        print(f"    collectives {_verdict(cp['calls'] <= tt['calls'])} ({cp['calls']} <= "
              f"{tt['calls']}), bytes {_verdict(cp['bytes'] <= tt['bytes'])}; losses "
              + ("bitwise equal" if e["losses_bitwise"]
                 else f"differ by up to {e['loss_max_diff']:.2e}")
              + f"; parameters after the last step differ by up to {e['param_max_diff']:.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    parser.add_argument("--ac", default=",".join(ACS),
                        help=f"activation checkpointing, comma-separated, of {', '.join(ACS)}"
                        " (default: all)")
    parser.add_argument("--steps", type=int, default=2,
                        help="untimed training steps before counting (default 2)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed steps per side, interleaved (default 10)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=6,
                        help="blocks of the debugmodel kept (default 6: all)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    acs = [a for a in args.ac.split(",") if a]
    for given, known, what in ((modes, MODES, "--modes"), (acs, ACS, "--ac")):
        unknown = [g for g in given if g not in known]
        if unknown:
            parser.error(f"{what}: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(known)}")
    if not 2 <= args.layers <= 6:
        # composer_par finds a model's blocks as the same-class children of its largest
        # container: one block alone is not recognized as a repeated layer (CP401).
        parser.error(f"--layers {args.layers}: between 2 and 6 (the debugmodel's blocks)")
    if args.batch % 4:
        parser.error(f"--batch {args.batch}: must divide over 4 data-parallel ranks")
    missing = _missing_torchtitan()
    if missing:
        print(missing, file=sys.stderr)
        return 2

    from composer_par.testing.distributed import run_ranks

    load_before = os.getloadavg()
    # By name: rank processes import this file as a module (its folder is on sys.path).
    results = run_ranks("bench_vs_torchtitan:_rank_main", RANKS,
                        args=(modes, acs, args.layers, args.seq, args.batch, args.steps,
                              args.repeats, args.warmup, False),
                        timeout=3600)
    load = (load_before[0], os.getloadavg()[0])
    report = _summarize(results, args.repeats)
    if args.json:
        print(json.dumps({"time_target": TIME_TARGET, "ranks": RANKS, "modes": report,
                          "load_average": list(load)}, indent=2))
    else:
        _print(report, args, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
