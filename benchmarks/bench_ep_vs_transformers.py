"""transformers' own expert parallelism against composer_par's EP plan on the same
Qwen3-MoE and weights, side by side.

transformers' side is what its docs show: ``from_pretrained(path,
distributed_config=DistributedConfig(fsdp_size=4, ep_size=N))`` (5.24 spells expert
parallelism ``ep_size``; the older ``enable_expert_parallel`` flag is deprecated and means
``ep_size=tp_size``): the model's ``base_model_ep_plan`` (experts ``Shard(0)`` over ``ep``,
``ep_dispatch_experts`` with its all-to-all implementation) and FSDP2 over its dense mesh
``fsdp`` and expert mesh ``efsdp x ep`` after its own FSDP plan. composer_par's side is
``Qwen3MoeForCausalLM`` with the same weights under ``FSDP2() + EP()`` on
``MeshSpec(dp_shard=4 / N, ep=N)``, FSDP2's units its default ones, which follow the
model's own FSDP plan as transformers does (the embedding alone, the final norm with the
head kept unsharded to backward).
Every rank builds the same weights (transformers' init, seeded; rank 0 saves them for
``from_pretrained``); both sides see the same batches (each rank its data shard), take
the mean loss of their shard, average gradients over data parallelism and step torch's
AdamW.

Layouts on 4 gloo ranks: ``ep2`` (fsdp 4, ep 2: efsdp 2) and ``ep4`` (fsdp 4, ep 4:
efsdp 1). Per layout it prints the losses of every step on both sides and their largest
difference, the parameters' largest difference after the last step, collectives and
payload bytes per training step by kind (``composer_par.testing.comm_count``, the rank
with the most), the step time (median of the slowest rank over interleaved repeats) and
the ratios composer_par / transformers. Nothing stands in for anything: transformers'
expert parallelism runs on CPU and gloo as it is.

    .venv/bin/python benchmarks/bench_ep_vs_transformers.py [--layouts ep2,ep4]
        [--steps 3] [--repeats 10] [--layers 2] [--dim 64] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

RANKS = 4
SIDES = ("transformers", "composer_par")

# name -> (composer_par mesh, outermost first; transformers' ep_size over fsdp_size 4).
# transformers' expert mesh is (efsdp, ep), ep innermost, as composer_par's here.
LAYOUTS: dict[str, tuple[dict[str, int], int]] = {
    "ep2": ({"dp_shard": 2, "ep": 2}, 2),
    "ep4": ({"dp_shard": 1, "ep": 4}, 4),
}


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


def _shared() -> Any:
    """bench_ep_vs_torchtitan: the composer_par side, the step, counting and the summary
    (none of which imports torchtitan)."""
    return _sibling("bench_ep_vs_torchtitan")


def hf_config(layers: int, dim: int, experts: int, top_k: int, seq: int, vocab: int) -> Any:
    from transformers import Qwen3MoeConfig

    head_dim = 16
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers,
        num_attention_heads=dim // head_dim, num_key_value_heads=dim // head_dim // 2,
        head_dim=head_dim, intermediate_size=4 * dim, moe_intermediate_size=dim,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        tie_word_embeddings=False, max_position_embeddings=seq, decoder_sparse_step=1,
        mlp_only_layers=[], output_router_logits=False)
    config._attn_implementation = "sdpa"
    return config


def _reference(config: Any) -> dict[str, Any]:
    """The starting weights, the same on every rank: transformers' init, seeded."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _saved(config: Any, weights: dict[str, Any]) -> str:
    """A folder every rank reads, with the weights saved by rank 0 (transformers saves on
    the main process only under torch.distributed)."""
    import tempfile

    import torch
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM

    box: list[Any] = [tempfile.mkdtemp(prefix="bench_ep_hf_") if dist.get_rank() == 0
                      else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() == 0:
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(weights[name])
        model.save_pretrained(box[0])
    dist.barrier()
    return str(box[0])


def by_transformers(path: str, ep: int, world: int) -> tuple[Any, tuple[int, int]]:
    """The saved model loaded by transformers with its own FSDP and expert parallelism."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    model = Qwen3MoeForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa",
        distributed_config=DistributedConfig(fsdp_size=world, ep_size=ep))
    model.train()
    # Its dense mesh is fsdp alone: each rank reads the shard of its rank.
    return model, (dist.get_rank(), world)


def _rank_main(layouts: list[str], layers: int, dim: int, experts: int, top_k: int,
               seq: int, batch: int, steps: int, repeats: int, warmup: int
               ) -> dict[str, Any]:
    import shutil

    import structlog
    import torch
    import torch.distributed as dist

    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    shared = _shared()
    world = dist.get_world_size()
    vocab = 256
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=gen)
               for _ in range(max(steps, 1))]
    config = hf_config(layers, dim, experts, top_k, seq, vocab)
    weights = _reference(config)
    path = _saved(config, weights)
    out: dict[str, Any] = {}
    try:
        for layout in layouts:
            mesh, ep = LAYOUTS[layout]
            hf_model, hf_shard = by_transformers(path, ep, world)
            cp_model, cp_shard = shared.by_plan(config, mesh, weights)
            if tuple(hf_shard) != tuple(cp_shard):
                raise AssertionError(f"{layout}: transformers reads data shard {hf_shard}, "
                                     f"composer_par {cp_shard}")
            sides = {"transformers": shared._Side(hf_model, hf_shard, summed=False),
                     "composer_par": shared._Side(cp_model, cp_shard, summed=False)}
            out[layout] = shared.side_by_side(sides, batches, weights, steps=steps,
                                              warmup=warmup, repeats=repeats)
            del sides, hf_model, cp_model
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
    return out


def _print(report: dict[str, Any], args: argparse.Namespace,
           load: tuple[float, float]) -> None:
    print(f"Qwen3-MoE ({args.layers} blocks, dim {args.dim}, {args.experts} experts top-"
          f"{args.top_k}), the same weights: transformers' FSDP + expert parallelism "
          f"(DistributedConfig fsdp_size, ep_size) vs composer_par's FSDP2 + EP, {RANKS} "
          f"gloo ranks, seq {args.seq}, global batch {args.batch}, {args.steps} compared "
          f"steps, {args.repeats} interleaved timed repeats ({os.cpu_count()} cores; load "
          f"average {load[0]:.1f} before, {load[1]:.1f} after). Times: the slowest rank's "
          "step. No stand-ins.")
    for layout, e in report.items():
        mesh, ep = LAYOUTS[layout]
        print(f"  {layout}: transformers fsdp_size {RANKS}, ep_size {ep}; composer_par "
              + " x ".join(f"{k} {v}" for k, v in mesh.items()))
        _shared().print_layout(e, "transformers")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    shared = _shared()
    shared.add_model_arguments(parser, LAYOUTS)
    args = parser.parse_args(argv)
    layouts = shared.checked_layouts(parser, args, LAYOUTS)

    from composer_par.testing.distributed import run_ranks

    load_before = os.getloadavg()
    results = run_ranks("bench_ep_vs_transformers:_rank_main", RANKS,
                        args=(layouts, args.layers, args.dim, args.experts, args.top_k,
                              args.seq, args.batch, args.steps, args.repeats, args.warmup),
                        timeout=3600)
    load = (load_before[0], os.getloadavg()[0])
    report = shared.summarize(results, args.repeats, SIDES)
    if args.json:
        print(json.dumps({"ranks": RANKS, "layouts": report, "load_average": list(load)},
                         indent=2))
    else:
        _print(report, args, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
