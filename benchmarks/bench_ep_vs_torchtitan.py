"""torchtitan's Qwen3-MoE under torchtitan's own expert parallelism, against the same
weights as transformers' Qwen3-MoE under composer_par's EP plan, side by side.

torchtitan's side is what its trainer does for its ``qwen3`` MoE models: the model built
from a config (``_build_qwen3_moe_layers``, shrunk: 8 experts top-2, dim 64 by default),
its sharding configs set for expert parallelism (``set_qwen3_sharding_config``),
``ParallelDims.build_mesh``, ``parallelize_qwen3`` (experts ``Shard(0)`` over ``ep``, its
``AllToAllTokenDispatcher``, FSDP2 through ``apply_fsdp_to_decoder`` with the experts over
``efsdp``), in float32. composer_par's side is transformers' ``Qwen3MoeForCausalLM`` built
from the equivalent config with the same weights copied in (composer_par's EP drives
experts modules of transformers' layout; torchtitan's keep their weights on a child the
dispatcher calls with token counts), under ``FSDP2() + EP()``. Every rank builds the same
reference weights (torchtitan's init, seeded); both sides see the same batches (each rank
its data shard) and step torch's AdamW. torchtitan takes the loss summed over tokens
divided by the global token count and sums gradients over data parallelism; composer_par
takes the mean loss of its shard and averages (its FSDP2 refuses a gradient divide factor
beside EP's experts), the same gradient; its loss is shown divided by the data shards.
composer_par's FSDP2 units are torchtitan's (embedding; final norm with the head, kept
unsharded to backward), given as ``units``/``reshard_units``; its default for this model
(the model's own FSDP plan, the final norm joined with the head) makes the same units.

Layouts on 4 gloo ranks: ``ep2`` (torchtitan dp_shard 4, ep 2, efsdp 2; composer_par
``MeshSpec(dp_shard=2, ep=2)``: dense over 4, experts over ep then dp_shard) and ``ep4``
(dp_shard 4, ep 4, efsdp 1; ``MeshSpec(dp_shard=1, ep=4)``). Per layout it prints the
losses of every step on both sides and their largest difference, the parameters' largest
difference after the last step, collectives and payload bytes per training step by kind
(``composer_par.testing.comm_count.CommCounter``, the rank with the most), the step time
(median of the slowest rank over interleaved repeats) and the ratios composer_par /
torchtitan. Targets: losses equal within float32 rounding (the two model codes round
differently: grouped-mm over sorted pairs and a scatter-add against per-expert matmuls
and an index-add, summed against averaged gradients), collectives and bytes no more than
torchtitan's, step time ratio <= 1.00.

A CPU run needs stand-ins for torchtitan's accelerator-only pieces; they live in this
file and ``bench_vs_torchtitan._standins`` alone, each with its reason, printed with the
figures (``STANDINS``). Nothing in torchtitan's expert path itself needs CUDA: torch's
``_grouped_mm`` has a CPU kernel (forward and backward, float32 and bfloat16), the
dispatcher's ``_permute`` is plain torch ops, its count and token exchanges are
functional ``all_to_all_single`` (gloo runs them), and its deterministic scatter-add is
``scatter_add`` on CPU. Only its bfloat16 casts are replaced, so that the losses compare;
``--bf16-experts`` keeps them (torchtitan's experts exactly as shipped).

    .venv/bin/python benchmarks/bench_ep_vs_torchtitan.py [--layouts ep2,ep4] [--steps 3]
        [--repeats 10] [--layers 2] [--dim 64] [--bf16-experts] [--json]

Needs torchtitan (``./dev`` installs it) and transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

RANKS = 4
# composer_par's FSDP2 units beside the blocks as torchtitan's apply_fsdp_to_decoder makes
# them: the embedding alone, the final norm with the head (kept unsharded from forward to
# backward, which starts there). composer_par's default for a Hugging Face model (its own
# FSDP plan, the final norm joined with the head) makes the same units; given here so that
# the comparison does not rest on that default.
UNITS: tuple[Any, ...] = ("model.embed_tokens", ("model.norm", "lm_head"))

# name -> (composer_par mesh, outermost first; torchtitan dp_shard, ep). Both put ep
# innermost: torchtitan's sparse mesh is (efsdp, ep), so ep groups and data shards match.
LAYOUTS: dict[str, tuple[dict[str, int], tuple[int, int]]] = {
    "ep2": ({"dp_shard": 2, "ep": 2}, (4, 2)),
    "ep4": ({"dp_shard": 1, "ep": 4}, (4, 4)),
}

# What stands in for torchtitan's accelerator-only pieces on CPU, and why. The first
# three are bench_vs_torchtitan's (its _standins), the last this file's.
STANDINS = (
    ("torchtitan.tools.utils device type",
     "it picks 'cuda' at import on a machine without an accelerator; that import sees "
     "'cpu'"),
    ("torchtitan.distributed.minimal_async_ep.kernels",
     "Triton kernels (CUDA-only, not installed) imported at module level by the token "
     "dispatcher module; the standard all-to-all dispatcher used here never calls them"),
    ("FlexAttention.forward",
     "inductor-compiled for GPUs, no eager backward on CPU; every sequence is one "
     "document, so causal scaled_dot_product_attention is the same attention (as "
     "transformers' sdpa on the other side)"),
    ("GroupedExperts.forward in float32",
     "it casts activations and expert weights to bfloat16 for its grouped GEMM (GPU "
     "tensor cores) whatever the parameter dtype; the same torch._grouped_mm calls in "
     "float32, the dtype both sides train in here, so that losses compare"),
)


def _sibling(name: str) -> Any:
    """A module of benchmarks/ (no package) by name, loaded by path when not on sys.path."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _dense_bench() -> Any:
    return _sibling("bench_vs_torchtitan")


_EXPERTS_STANDIN_DONE = False


def _standins(float32_experts: bool = True) -> None:
    """bench_vs_torchtitan's stand-ins, and float32 experts unless told otherwise (see
    STANDINS)."""
    global _EXPERTS_STANDIN_DONE
    _dense_bench()._standins()
    if _EXPERTS_STANDIN_DONE or not float32_experts:
        return
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    def experts_forward(self: Any, x_RD: Any, num_tokens_per_expert_E: Any) -> Any:
        # torchtitan's forward less its .bfloat16() casts (it has no spmd_types checks
        # on the partial_dtensor backend used here).
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offsets))
        h = h * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offsets)
        return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offsets).type_as(x_RD)

    GroupedExperts.forward = experts_forward  # type: ignore[method-assign]
    _EXPERTS_STANDIN_DONE = True


def _tt_config(layers: int, dim: int, experts: int, top_k: int, seq: int, vocab: int) -> Any:
    """torchtitan's Qwen3-MoE config at benchmark size: its own layer builder (q/k norms,
    softmax router with normalized top-k, SwiGLU experts), separate q/k/v projections (its
    ``debugmodel_non_fused_qkv`` choice, so that weights map onto transformers' one to
    one), aux-loss-free balancing off (transformers' Qwen3-MoE has no expert bias), and
    its sharding configs for expert parallelism."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    head_dim = 16
    cfg = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=False, n_layers=layers, dim=dim, n_heads=dim // head_dim,
            n_kv_heads=dim // head_dim // 2, head_dim=head_dim, moe_hidden_dim=dim,
            num_experts=experts, top_k=top_k, attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=1e6)))
    for layer in cfg.layers:
        layer.moe.load_balance_coeff = None
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)
    return cfg


def _hf_config(cfg: Any) -> Any:
    """transformers' Qwen3-MoE config equal to torchtitan's ``cfg``."""
    from transformers import Qwen3MoeConfig

    attention = cfg.layers[0].attention
    moe = cfg.layers[0].moe
    hf = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=len(cfg.layers),
        num_attention_heads=attention.n_heads, num_key_value_heads=attention.n_kv_heads,
        head_dim=attention.head_dim, intermediate_size=4 * cfg.dim,
        moe_intermediate_size=moe.routed_experts.inner_experts.hidden_dim,
        num_experts=moe.num_experts, num_experts_per_tok=moe.router.top_k,
        norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=attention.rope.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": attention.rope.theta},
        decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    hf._attn_implementation = "sdpa"
    return hf


def to_hf(weights: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's Qwen3-MoE parameters under transformers' names and layout."""
    import torch

    out: dict[str, Any] = {}
    for name, value in weights.items():
        parts = name.split(".")
        if parts[0] == "layers":
            i, rest = parts[1], ".".join(parts[2:])
            prefix = f"model.layers.{i}."
            if rest == "moe.routed_experts.inner_experts.w1_EFD":
                w3 = weights[f"layers.{i}.moe.routed_experts.inner_experts.w3_EFD"]
                out[prefix + "mlp.experts.gate_up_proj"] = torch.cat([value, w3], dim=1)
            elif rest != "moe.routed_experts.inner_experts.w3_EFD":
                out[prefix + _LAYER_NAMES[rest]] = value
        else:
            out[_TOP_NAMES[name]] = value
    return out


_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
    "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
    "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.routed_experts.inner_experts.w2_EDF": "mlp.experts.down_proj",
}


def _reference(cfg: Any) -> dict[str, Any]:
    """The starting weights, the same on every rank: torchtitan's init, seeded."""
    import torch

    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def by_torchtitan(cfg: Any, world: int, degrees: tuple[int, int],
                  weights: dict[str, Any]) -> tuple[Any, tuple[int, int]]:
    """torchtitan's model under ``parallelize_qwen3`` with expert parallelism."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_utils
    from torchtitan.models.qwen3 import parallelize_qwen3

    shard, ep = degrees
    parallelism = ParallelismConfig(data_parallel_shard_degree=shard,
                                    expert_parallel_degree=ep,
                                    spmd_backend="partial_dtensor")
    tt_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = cfg.build()
    model = parallelize_qwen3(
        model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
        dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, param in model.named_parameters():
            full = weights[name]
            if isinstance(param, DTensor):
                part = distribute_tensor(full, param.device_mesh, param.placements,
                                         src_data_rank=None)
                param.to_local().copy_(part.to_local())
            else:
                param.copy_(full)
    # torchtitan sets gradient divide factor 1 (its loss is divided by the global token
    # count), which FSDP2 issues as PREMUL_SUM(1.0), an NCCL op gloo refuses; plain SUM
    # reductions are the same sums on gloo.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.train()
    batch = dims.get_mesh("batch")
    return model, (batch.get_local_rank(), batch.size())


def by_plan(hf_config: Any, mesh: dict[str, int], hf_weights: dict[str, Any],
            units: tuple[Any, ...] = ()) -> tuple[Any, tuple[int, int]]:
    """transformers' Qwen3-MoE from ``hf_config`` with ``hf_weights`` under composer_par's
    FSDP2 + EP on ``mesh``; ``units``: FSDP2's units beside the blocks, the one holding
    ``lm_head`` kept unsharded from forward to backward, or () for the model's own FSDP
    plan (transformers')."""
    from transformers import Qwen3MoeForCausalLM

    from composer_par import EP, FSDP2, MeshSpec, ParallelPlan

    model = Qwen3MoeForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict(hf_weights, strict=False)
    if unexpected or [m for m in missing if not m.endswith("inv_freq")]:
        raise AssertionError(f"weights do not map: missing {missing}, unexpected "
                             f"{unexpected}")
    # FSDP2's default: gradients averaged over the data shards (a gradient divide factor
    # is refused beside EP's experts, which FSDP2 shards apart with their own divisor).
    fsdp = (FSDP2(units=units, reshard_units={"lm_head": False}) if units else FSDP2())
    plan = ParallelPlan(MeshSpec(**mesh)).use(fsdp).use(EP())
    model = plan.apply(model)
    model.train()
    return model, plan.data_shard()


class _Side:
    """One parallelized model, its optimizer and its data shard. ``summed``: gradients
    summed over data shards (torchtitan), else averaged (composer_par's FSDP2)."""

    def __init__(self, model: Any, shard: tuple[int, int], summed: bool) -> None:
        import torch

        self.model = model
        self.shard = shard
        self.summed = summed
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.losses: list[float] = []

    def step(self, batch: Any, between: Any = None) -> None:
        """One training step on this rank's shard of ``batch``; ``between`` runs after
        forward. Summed: the loss summed over its tokens divided by the global token
        count; averaged: the mean over its tokens, recorded divided by the data shards
        (a power of two here, so the recorded value is exactly the summed side's one
        when the logits are equal; and so are the gradients after averaging)."""
        import torch.nn.functional as F

        index, count = self.shard
        tokens = batch.chunk(count)[index]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        out = self.model(inputs)
        logits = getattr(out, "logits", out)
        if self.summed:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                   reduction="sum") / batch[:, 1:].numel()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        if between is not None:
            between()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.append(float(loss.detach()) / (1 if self.summed else count))


def _counted_step(side: _Side, batch: Any, mesh: Any = None) -> dict[str, Any]:
    """One training step's collectives by kind (calls, payload bytes), forward and
    backward apart; with ``mesh`` (a MeshSpec laying ranks out as both sides do) also per
    mesh dim (``dims``: CommCounter's summary)."""
    import torch.distributed as dist

    from composer_par.testing.comm_count import CommCounter

    counter = CommCounter()
    marks: list[int] = []
    with counter:
        side.step(batch, between=lambda: marks.append(len(counter.calls)))
    kinds: dict[str, dict[str, int]] = {}
    for call in counter.calls:
        entry = kinds.setdefault(call.kind, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += call.payload_bytes
    out = {"calls": len(counter.calls),
           "bytes": sum(c.payload_bytes for c in counter.calls),
           "forward_calls": marks[0], "backward_calls": len(counter.calls) - marks[0],
           "kinds": kinds}
    if mesh is not None:
        out["dims"] = counter.summary(mesh.resolve(dist.get_world_size()), dist.get_rank())
    return out


def side_by_side(sides: dict[str, _Side], batches: list[Any], weights: dict[str, Any], *,
                 steps: int, warmup: int, repeats: int, hf_names: tuple[bool, bool] = (
                     False, False), mesh: Any = None) -> dict[str, Any]:
    """Two sides (the other first, composer_par second) trained the same ``steps`` from
    the same ``weights``: their losses, the largest difference of their parameters and of
    the other side's from where it started, one step's collectives each (per mesh dim
    with ``mesh``), then ``repeats`` timed steps each after ``warmup``, alternating which
    side goes first. ``hf_names``: whether each side's parameters carry Hugging Face
    names (turned into torchtitan's to compare)."""
    for step in range(steps):
        for side in sides.values():
            side.step(batches[step])
    record: dict[str, Any] = {"losses": {n: list(s.losses) for n, s in sides.items()}}
    other, ours = sides.values()
    theirs = _full_params(other.model, hf_names=hf_names[0])
    mine = _full_params(ours.model, hf_names=hf_names[1])
    if sorted(theirs) != sorted(mine):
        raise AssertionError(f"parameters differ in name: {sorted(theirs)} vs {sorted(mine)}")
    record["param_diff"] = max(float((mine[n] - theirs[n]).abs().max()) for n in theirs)
    record["changed"] = max(float((theirs[n] - weights[n]).abs().max()) for n in theirs)
    record["counts"] = {n: _counted_step(s, batches[0], mesh=mesh) for n, s in sides.items()}
    record["times"] = {n: [] for n in sides}
    for _ in range(warmup):
        for side in sides.values():
            side.step(batches[0])
    timed = _dense_bench()._timed_step
    for repeat in range(repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            record["times"][name].append(timed(sides[name], batches[repeat % len(batches)]))
    return record


def _full_params(model: Any, hf_names: bool) -> dict[str, Any]:
    """Every full parameter (gathered) under torchtitan's names."""
    import torch
    from torch.distributed.tensor import DTensor

    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in model.named_parameters()}
    if not hf_names:
        return full
    back = {v: k for k, v in _TOP_NAMES.items()}
    out = {}
    for name, value in full.items():
        if name in back:
            out[back[name]] = value
            continue
        i = name.split(".")[2]
        rest = name.split(".", 3)[3]
        if rest == "mlp.experts.gate_up_proj":
            w1, w3 = torch.chunk(value, 2, dim=1)
            out[f"layers.{i}.moe.routed_experts.inner_experts.w1_EFD"] = w1
            out[f"layers.{i}.moe.routed_experts.inner_experts.w3_EFD"] = w3
        else:
            tt = {v: k for k, v in _LAYER_NAMES.items()}[rest]
            out[f"layers.{i}.{tt}"] = value
    return out


def _rank_main(layouts: list[str], layers: int, dim: int, experts: int, top_k: int,
               seq: int, batch: int, steps: int, repeats: int, warmup: int,
               float32_experts: bool = True) -> dict[str, Any]:
    import logging

    import structlog
    import torch
    import torch.distributed as dist

    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    _standins(float32_experts)
    world = dist.get_world_size()
    vocab = 256
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=gen)
               for _ in range(max(steps, 1))]
    cfg = _tt_config(layers, dim, experts, top_k, seq, vocab)
    weights = _reference(cfg)
    out: dict[str, Any] = {}
    for layout in layouts:
        mesh, degrees = LAYOUTS[layout]
        tt_model, tt_shard = by_torchtitan(cfg, world, degrees, weights)
        cp_model, cp_shard = by_plan(_hf_config(cfg), mesh, to_hf(weights), UNITS)
        if tuple(tt_shard) != tuple(cp_shard):
            raise AssertionError(f"{layout}: torchtitan reads data shard {tt_shard}, "
                                 f"composer_par {cp_shard}")
        sides = {"torchtitan": _Side(tt_model, tt_shard, summed=True),
                 "composer_par": _Side(cp_model, cp_shard, summed=False)}
        out[layout] = side_by_side(sides, batches, weights, steps=steps, warmup=warmup,
                                   repeats=repeats, hf_names=(False, True))
        del sides, tt_model, cp_model
    return out


def summarize(results: list[dict[str, Any]], repeats: int,
              sides: tuple[str, str] = ("torchtitan", "composer_par")) -> dict[str, Any]:
    """Per layout: each side's slowest-rank step times, the largest rank's collective
    counts by kind, the losses' and parameters' largest differences, the ratios."""
    report: dict[str, Any] = {}
    for layout in results[0]:
        rows = [r[layout] for r in results]
        entry: dict[str, Any] = {"sides": {}}
        for side in sides:
            worst = [max(r["times"][side][i] for r in rows) for i in range(repeats)]
            counts = [r["counts"][side] for r in rows]
            kinds = {}
            for kind in sorted({k for c in counts for k in c["kinds"]}):
                kinds[kind] = {f: max(c["kinds"].get(kind, {}).get(f, 0) for c in counts)
                               for f in ("calls", "bytes")}
            entry["sides"][side] = {
                "median_ms": statistics.median(worst) * 1e3 if worst else None,
                "min_ms": min(worst) * 1e3 if worst else None,
                "calls": max(c["calls"] for c in counts),
                "bytes": max(c["bytes"] for c in counts),
                "forward_calls": max(c["forward_calls"] for c in counts),
                "backward_calls": max(c["backward_calls"] for c in counts),
                "kinds": kinds,
                "losses": rows[0]["losses"][side],
            }
        theirs, ours = entry["sides"][sides[0]], entry["sides"][sides[1]]
        if repeats:
            entry["ratio_median"] = ours["median_ms"] / theirs["median_ms"]
            entry["ratio_min"] = ours["min_ms"] / theirs["min_ms"]
        entry["ratio_calls"] = ours["calls"] / theirs["calls"]
        entry["ratio_bytes"] = ours["bytes"] / theirs["bytes"]
        entry["loss_max_diff"] = max(
            abs(a - b) for r in rows
            for a, b in zip(r["losses"][sides[0]], r["losses"][sides[1]], strict=True))
        entry["loss_max_rel_diff"] = max(
            abs(a - b) / abs(a) for r in rows
            for a, b in zip(r["losses"][sides[0]], r["losses"][sides[1]], strict=True))
        entry["param_max_diff"] = max(r["param_diff"] for r in rows)
        entry["changed"] = min(r["changed"] for r in rows)
        report[layout] = entry
    return report


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _print(report: dict[str, Any], args: argparse.Namespace,
           load: tuple[float, float]) -> None:
    print(f"Qwen3-MoE ({args.layers} blocks, dim {args.dim}, {args.experts} experts top-"
          f"{args.top_k}): torchtitan's model and EP vs transformers' model with the same "
          f"weights under composer_par's FSDP2 + EP, {RANKS} gloo ranks, seq {args.seq}, "
          f"global batch {args.batch}, {args.steps} compared steps, {args.repeats} "
          f"interleaved timed repeats ({os.cpu_count()} cores; load average "
          f"{load[0]:.1f} before, {load[1]:.1f} after). Times: the slowest rank's step.")
    print("  stand-ins on torchtitan's side (CPU):")
    for what, why in STANDINS if not args.bf16_experts else STANDINS[:-1]:
        print(f"    {what}: {why}")
    for layout, e in report.items():
        mesh, (shard, ep) = LAYOUTS[layout]
        print(f"  {layout}: torchtitan dp_shard {shard} x ep {ep}; composer_par "
              + " x ".join(f"{k} {v}" for k, v in mesh.items()))
        print_layout(e, "torchtitan")


def print_layout(e: dict[str, Any], other: str) -> None:
    """One layout's report lines: each side's losses and how far apart they end, each
    side's collectives and bytes per step, and the step-time ratio when timed."""
    target = _dense_bench().TIME_TARGET
    them, cp = e["sides"][other], e["sides"]["composer_par"]
    for label, side in ((other, them), ("composer_par", cp)):
        print(f"    {label:12s} rank 0's losses " + ", ".join(f"{x:.7f}"
                                                        for x in side["losses"]))
    print(f"    losses differ by up to {e['loss_max_diff']:.2e} (relative "
          f"{e['loss_max_rel_diff']:.2e}); parameters after the last step by up to "
          f"{e['param_max_diff']:.2e} (training moved them by {e['changed']:.2e})")
    for label, side in ((other, them), ("composer_par", cp)):
        kinds = ", ".join(f"{k} {v['calls']} / {v['bytes'] / 1024:.1f} KiB"
                          for k, v in side["kinds"].items())
        print(f"    {label:12s} {side['calls']:4d} collectives ({side['forward_calls']} "
              f"forward, {side['backward_calls']} backward), "
              f"{side['bytes'] / 1024:9.1f} KiB per step: {kinds}")
    print(f"    collectives {_verdict(cp['calls'] <= them['calls'])} ratio "
          f"{e['ratio_calls']:.3f}, bytes {_verdict(cp['bytes'] <= them['bytes'])} ratio "
          f"{e['ratio_bytes']:.3f}")
    if "ratio_median" in e:
        print(f"    step   {other} median {them['median_ms']:7.1f} ms (min "
              f"{them['min_ms']:7.1f}), composer_par median {cp['median_ms']:7.1f} ms "
              f"(min {cp['min_ms']:7.1f}): ratio of medians {e['ratio_median']:.3f} "
              f"{_verdict(e['ratio_median'] <= target)} (<= {target:.2f}), of minima "
              f"{e['ratio_min']:.3f}")


def add_model_arguments(parser: argparse.ArgumentParser, layouts: Any) -> None:
    """The options both EP side-by-side benchmarks share: which of ``layouts`` to
    compare, the model's shape and the batch."""
    parser.add_argument("--layouts", default=",".join(layouts),
                        help=f"comma-separated, of {', '.join(layouts)} (default: all)")
    parser.add_argument("--steps", type=int, default=3, help="compared steps (default 3)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed steps per side, interleaved (default 10)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64, help="a multiple of 32")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def checked_layouts(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    known: Any) -> list[str]:
    """The layouts asked for, after refusing (through ``parser.error``) any model
    option the ranks could not run."""
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in known]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(known)}")
    if args.dim % 32:
        parser.error(f"--dim {args.dim}: a multiple of 32 (heads of 16, half as many kv)")
    if args.experts % RANKS:
        parser.error(f"--experts {args.experts}: must divide over {RANKS} ep ranks")
    if args.batch % RANKS:
        parser.error(f"--batch {args.batch}: must divide over {RANKS} data shards")
    if args.layers < 2:
        parser.error("--layers: at least 2 (composer_par finds blocks as repeated layers)")
    return layouts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_model_arguments(parser, LAYOUTS)
    parser.add_argument("--bf16-experts", action="store_true",
                        help="torchtitan's experts as it ships them (bfloat16 grouped-mm on "
                        "CPU too): the losses then differ by bfloat16 rounding")
    args = parser.parse_args(argv)
    layouts = checked_layouts(parser, args, LAYOUTS)
    missing = _dense_bench()._missing_torchtitan()
    if missing:
        print(missing, file=sys.stderr)
        return 2

    from composer_par.testing.distributed import run_ranks

    load_before = os.getloadavg()
    results = run_ranks("bench_ep_vs_torchtitan:_rank_main", RANKS,
                        args=(layouts, args.layers, args.dim, args.experts, args.top_k,
                              args.seq, args.batch, args.steps, args.repeats, args.warmup,
                              not args.bf16_experts),
                        timeout=3600)
    load = (load_before[0], os.getloadavg()[0])
    report = summarize(results, args.repeats)
    if args.json:
        standins = STANDINS[:-1] if args.bf16_experts else STANDINS
        print(json.dumps({"ranks": RANKS, "standins": dict(standins), "layouts": report,
                          "load_average": list(load)}, indent=2))
    else:
        _print(report, args, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
