"""transformers' own FSDP2 and TP against a composer_par plan on the same Hugging Face
model, weights and batches, side by side.

transformers' side is what its docs show: ``from_pretrained(path,
distributed_config=DistributedConfig(fsdp_size=..., tp_size=..., dp_replicate_size=...))``,
which applies the model's TP plan (``base_model_tp_plan`` and its head's) over ``tp`` and
``fully_shard`` after its FSDP plan (``_fsdp_plan``: each layer and the embedding
resharded after forward, the final norm with the head kept whole) over ``fsdp`` (and
``dp_replicate``). composer_par's side is the same model class with the same weights
under ``FSDP2()``, with ``TP()`` (its auto plan, which all-reduces the gradient of the
input attention's q/k/v and the MLP's gate/up share once, where transformers does it per
projection) over ``tp`` and ``HSDP()`` over ``dp_replicate``, FSDP2's units its default
ones for the model (its own FSDP plan, a unit of small parameters joined with its
neighbour, the last block kept gathered for its backward, which transformers reshards and
gathers again). Every rank builds the same weights (transformers' init, seeded; rank 0
saves them for ``from_pretrained``); both sides see the same batches (each rank its data
shard), take the mean loss of their shard, average gradients over data parallelism and
step torch's AdamW.

Models: a Llama and a Qwen3 (per-head q/k norms), ``--layers`` blocks of hidden size
``--dim``. Modes on 4 gloo ranks: ``fsdp`` (fsdp 4), ``fsdp_tp`` (fsdp 2 x tp 2) and
``hsdp`` (dp_replicate 2 x fsdp 2). Expert parallelism, which transformers offers for its
mixture-of-experts models, has its own side by side: bench_ep_vs_transformers.py. Per
model and mode it prints:

* the losses of every compared step on both sides, their largest difference, and the
  parameters' largest difference after them;
* collectives and payload bytes per training step, by kind and per mesh dim
  (``composer_par.testing.comm_count.CommCounter``, the rank with the most);
* the peak memory of one training step per rank (torch's ``MemTracker``, which follows
  tensor storages on CPU: parameters, gathered weights, gradients, optimizer states,
  activations, temporaries), the fullest rank on each side. It counts storages, not the
  views into them: transformers 5.24's ``from_pretrained`` leaves each rank's parameter
  shards as views of full-size storages (every rank keeps the whole model's bytes), which
  shows on its side;
* the step time: the slowest rank's step, steps paired and interleaved (alternating which
  side goes first), the ratio of medians and of minima, and the median of the ratios
  within each pair (both sides of a pair see the same load on the machine).

Targets (composer_par / transformers): collectives and bytes <= 1 in every mode, step
time <= 1.00 (medians, paired), peak memory <= 1.00. Nothing stands in for anything:
transformers' FSDP2 and TP run on CPU and gloo as they are.

    .venv/bin/python benchmarks/bench_vs_transformers.py [--models llama,qwen3]
        [--modes fsdp,fsdp_tp,hsdp] [--steps 3] [--repeats 10] [--layers 4] [--dim 256]
        [--json]
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
SIDES = ("transformers", "composer_par")
MEMORY_TARGET = 1.00

# name -> (config class, model class) in transformers
MODELS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
# name -> (composer_par mesh, outermost first; transformers' DistributedConfig sizes). Both
# lay ranks out the same way: transformers' dense mesh is (pp, dp_replicate, fsdp, tp).
MODES: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "fsdp": ({"dp_shard": 4}, {"fsdp_size": 4}),
    "fsdp_tp": ({"dp_shard": 2, "tp": 2}, {"fsdp_size": 2, "tp_size": 2}),
    "hsdp": ({"dp_replicate": 2, "dp_shard": 2}, {"dp_replicate_size": 2, "fsdp_size": 2}),
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
    """bench_ep_vs_torchtitan: the step, counting, the summary and its printer (none of
    which imports torchtitan)."""
    return _sibling("bench_ep_vs_torchtitan")


def hf_config(model: str, layers: int, dim: int, seq: int, vocab: int) -> Any:
    import transformers

    head_dim = 32
    config = getattr(transformers, MODELS[model][0])(
        vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim,
        num_hidden_layers=layers, num_attention_heads=dim // head_dim,
        num_key_value_heads=dim // head_dim // 2, head_dim=head_dim,
        max_position_embeddings=seq, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def _model_class(model: str) -> Any:
    import transformers

    return getattr(transformers, MODELS[model][1])


def _reference(model: str, config: Any) -> dict[str, Any]:
    """The starting weights, the same on every rank: transformers' init, seeded."""
    import torch

    torch.manual_seed(0)
    built = _model_class(model)(config)
    return {n: p.detach().clone() for n, p in built.named_parameters()}


def _saved(model: str, config: Any, weights: dict[str, Any]) -> str:
    """A folder every rank reads, with the weights saved by rank 0."""
    import tempfile

    import torch
    import torch.distributed as dist

    box: list[Any] = [tempfile.mkdtemp(prefix="bench_hf_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() == 0:
        built = _model_class(model)(config)
        with torch.no_grad():
            for name, param in built.named_parameters():
                param.copy_(weights[name])
        built.save_pretrained(box[0])
    dist.barrier()
    return str(box[0])


def _data_shard(sizes: dict[str, Any]) -> tuple[int, int]:
    """This rank's data shard under transformers' dense mesh (pp, dp_replicate, fsdp,
    tp): ranks of one tp group share a batch."""
    import torch.distributed as dist

    tp = sizes.get("tp_size", 1)
    count = sizes.get("dp_replicate_size", 1) * sizes.get("fsdp_size", 1)
    return dist.get_rank() // tp, count


def by_transformers(model: str, path: str, sizes: dict[str, Any]) -> tuple[Any, tuple[int, int]]:
    """The saved model loaded by transformers with its own FSDP2 (and TP, HSDP)."""
    import torch
    from transformers.distributed import DistributedConfig

    loaded = _model_class(model).from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa",
        distributed_config=DistributedConfig(**sizes))
    loaded.train()
    return loaded, _data_shard(sizes)


def by_plan(model: str, config: Any, mesh: dict[str, int], weights: dict[str, Any]
            ) -> tuple[Any, tuple[int, int]]:
    """The same model class and weights under composer_par's FSDP2 (with TP, HSDP)."""
    from composer_par import FSDP2, HSDP, TP, MeshSpec, ParallelPlan

    built = _model_class(model)(config)
    missing, unexpected = built.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if not m.endswith("inv_freq")]:
        raise AssertionError(f"weights do not map: missing {missing}, unexpected "
                             f"{unexpected}")
    plan = ParallelPlan(MeshSpec(**mesh)).use(FSDP2())
    if "dp_replicate" in mesh:
        plan.use(HSDP())
    if "tp" in mesh:
        plan.use(TP())
    built = plan.apply(built)
    built.train()
    return built, plan.data_shard()


def _peak_bytes(side: Any, batch: Any) -> int:
    """The peak bytes of one training step on this rank, by torch's MemTracker: every
    tensor storage the step holds (parameters, gathered weights, gradients, optimizer
    states, activations, temporaries)."""
    from composer_par.plugin import torch_private

    tracker = torch_private.mem_tracker()[0]()
    tracker.track_external(side.model, side.optimizer)
    with tracker:
        side.step(batch)
        peak = tracker.get_tracker_snapshot("peak")
    return int(sum(device["Total"] for device in peak.values()))


def _rank_main(models: list[str], modes: list[str], layers: int, dim: int, seq: int,
               batch: int, steps: int, repeats: int, warmup: int) -> dict[str, Any]:
    import shutil

    import structlog
    import torch
    import torch.distributed as dist

    from composer_par import MeshSpec

    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    shared = _shared()
    vocab = 1024
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=gen)
               for _ in range(max(steps, 1))]
    out: dict[str, Any] = {}
    for name in models:
        config = hf_config(name, layers, dim, seq, vocab)
        weights = _reference(name, config)
        path = _saved(name, config, weights)
        try:
            for mode in modes:
                mesh, sizes = MODES[mode]
                hf_model, hf_shard = by_transformers(name, path, sizes)
                cp_model, cp_shard = by_plan(name, config, mesh, weights)
                if tuple(hf_shard) != tuple(cp_shard):
                    raise AssertionError(f"{name}/{mode}: transformers reads data shard "
                                         f"{hf_shard}, composer_par {cp_shard}")
                sides = {"transformers": shared._Side(hf_model, hf_shard, summed=False),
                         "composer_par": shared._Side(cp_model, cp_shard, summed=False)}
                record = shared.side_by_side(sides, batches, weights, steps=steps,
                                             warmup=warmup, repeats=repeats,
                                             mesh=MeshSpec(**mesh))
                record["peak_bytes"] = {n: _peak_bytes(s, batches[0])
                                        for n, s in sides.items()}
                out[f"{name}/{mode}"] = record
                del sides, hf_model, cp_model
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
    return out


def summarize(results: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """bench_ep_vs_torchtitan's summary per model and mode, with each side's collectives
    per mesh dim and peak memory (the rank with the most of each) and their ratios."""
    report = _shared().summarize(results, repeats, SIDES)
    for key, entry in report.items():
        rows = [r[key] for r in results]
        for side in SIDES:
            dims: dict[str, dict[str, dict[str, int]]] = {}
            for row in rows:
                for dim, kinds in row["counts"][side]["dims"].items():
                    for kind, totals in kinds.items():
                        slot = dims.setdefault(dim, {}).setdefault(kind,
                                                                   {"calls": 0, "bytes": 0})
                        for field in ("calls", "bytes"):
                            slot[field] = max(slot[field], totals[field])
            entry["sides"][side]["dims"] = dims
            entry["sides"][side]["peak_bytes"] = max(r["peak_bytes"][side] for r in rows)
        entry["ratio_peak_bytes"] = (entry["sides"]["composer_par"]["peak_bytes"]
                                     / entry["sides"]["transformers"]["peak_bytes"])
        if repeats:
            # Each repeat times both sides back to back: the ratio within a pair sees the
            # same load on the machine, which drifts between pairs.
            pairs = [max(r["times"]["composer_par"][i] for r in rows)
                     / max(r["times"]["transformers"][i] for r in rows) for i in range(repeats)]
            entry["ratio_paired_median"] = statistics.median(pairs)
    return report


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _print(report: dict[str, Any], args: argparse.Namespace,
           load: tuple[float, float]) -> None:
    print(f"Hugging Face models ({args.layers} blocks, hidden {args.dim}), the same weights "
          f"and batches: transformers' own FSDP2 / TP (DistributedConfig) vs composer_par's "
          f"plan, {RANKS} gloo ranks, seq {args.seq}, global batch {args.batch}, "
          f"{args.steps} compared steps, {args.repeats} interleaved timed repeats "
          f"({os.cpu_count()} cores; load average {load[0]:.1f} before, {load[1]:.1f} "
          "after). Times: the slowest rank's step. No stand-ins.")
    for key, e in report.items():
        mesh, sizes = MODES[key.split("/")[1]]
        print(f"  {key}: transformers " + ", ".join(f"{k} {v}" for k, v in sizes.items())
              + "; composer_par " + " x ".join(f"{k} {v}" for k, v in mesh.items()))
        _shared().print_layout(e, "transformers")
        for label in SIDES:
            side = e["sides"][label]
            per_dim = "; ".join(
                f"{dim}: " + ", ".join(f"{kind} {v['calls']} / {v['bytes'] / 1024:.1f} KiB"
                                       for kind, v in sorted(kinds.items()))
                for dim, kinds in sorted(side["dims"].items()))
            print(f"    {label:12s} per mesh dim: {per_dim}")
        if "ratio_paired_median" in e:
            print(f"    step   median of the {args.repeats} paired ratios "
                  f"{e['ratio_paired_median']:.3f}")
        theirs, ours = e["sides"]["transformers"], e["sides"]["composer_par"]
        print(f"    memory transformers peak {theirs['peak_bytes'] / 2**20:7.2f} MiB, "
              f"composer_par {ours['peak_bytes'] / 2**20:7.2f} MiB per rank (the fullest): "
              f"ratio {e['ratio_peak_bytes']:.3f} "
              f"{_verdict(e['ratio_peak_bytes'] <= MEMORY_TARGET)} (<= {MEMORY_TARGET:.2f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    parser.add_argument("--steps", type=int, default=3, help="compared steps (default 3)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed steps per side, interleaved (default 10)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256, help="a multiple of 128")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    chosen = {}
    for option, known in (("models", MODELS), ("modes", MODES)):
        given = [x for x in getattr(args, option).split(",") if x]
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            parser.error(f"--{option}: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}")
        chosen[option] = given
    if args.dim % 128:
        # heads of 32 with half as many kv heads, split over tp 2
        parser.error(f"--dim {args.dim}: a multiple of 128")
    if args.batch % RANKS:
        parser.error(f"--batch {args.batch}: must divide over {RANKS} data shards")
    if args.layers < 2:
        parser.error("--layers: at least 2 (composer_par finds blocks as repeated layers)")
    if args.steps < 1 or args.repeats < 0 or args.warmup < 0:
        parser.error("--steps at least 1, --repeats and --warmup at least 0")

    from composer_par.testing.distributed import run_ranks

    load_before = os.getloadavg()
    results = run_ranks("bench_vs_transformers:_rank_main", RANKS,
                        args=(chosen["models"], chosen["modes"], args.layers, args.dim,
                              args.seq, args.batch, args.steps, args.repeats, args.warmup),
                        timeout=3600)
    load = (load_before[0], os.getloadavg()[0])
    report = summarize(results, args.repeats)
    if args.json:
        print(json.dumps({"ranks": RANKS, "memory_target": MEMORY_TARGET,
                          "time_target": _shared()._dense_bench().TIME_TARGET,
                          "modes": report, "load_average": list(load)}, indent=2))
    else:
        _print(report, args, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
