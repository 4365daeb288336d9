"""Activation checkpointing policies side by side: collectives re-issued and memory held.

On 2 gloo ranks, the project's Llama under TP 2 (no sequence parallelism) trains one
step with each policy of ``ActivationCheckpoint`` and once without checkpointing, from
the same weights, in one run. Per policy it prints:

* the tp collectives the step's backward issues beyond the backward without
  checkpointing (calls and payload bytes, counted by ``CommCounter``): what a
  recomputation issues again;
* the matmuls backward runs again (aten ``mm`` calls beyond no checkpointing);
* the activation memory by torch's memory tracker (``MemTracker``, which follows tensor
  storages and works on CPU): the activation bytes held when forward ends (what the step
  keeps for backward: saved tensors, a selective checkpoint's cache, the checkpoints'
  inputs, the loss), their peak during forward, and the peak of activations and
  backward's temporaries (recomputed tensors among them) over a whole step, each with
  its ratio to no checkpointing (the larger rank's);
* whether every rank's gradients equal those without checkpointing (bitwise).

    .venv/bin/python benchmarks/bench_ac_policies.py [--layers 4] [--dim 128] [--seq 64]
        [--batch 8] [--sequence-parallel] [--json]

The policies and the measurement are those of tests/test_ac_policies.py
(tests/ac_policy_workers.py), so the table and the tests count the same things.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

SAVES = {
    "none": "everything autograd saves (no checkpointing)",
    "full": "block inputs only; recomputation stops once backward has what it needs",
    "full, early_stop off": "block inputs only; the whole block recomputed",
    "selective (matmul + collectives)": "matmul and collective outputs",
    "selective (matmul only)": "matmul outputs",
    "selective, 1 in 2 matmuls": "the 1st, 3rd, ... matmul outputs and collective outputs",
    "policy: save nothing": "what a user policy says (here: nothing)",
}


def rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from tests.ac_policy_workers import calls

    out = []
    for label in SAVES:
        per_rank = [r[label] for r in results]
        ref = [r["none"] for r in results]
        first, base = per_rank[0], ref[0]
        tp_bytes = sum(k["bytes"] for k in first["backward"].get("tp", {}).values())
        base_bytes = sum(k["bytes"] for k in base["backward"].get("tp", {}).values())
        held = max(r["activation_bytes"] for r in per_rank)
        base_held = max(r["activation_bytes"] for r in ref)
        peak = max(r["peak_activation_bytes"] for r in per_rank)
        base_peak = max(r["peak_activation_bytes"] for r in ref)
        step = max(r["step_peak_bytes"] for r in per_rank)
        base_step = max(r["step_peak_bytes"] for r in ref)
        out.append({
            "policy": label,
            "saves": SAVES[label],
            "reissued_tp_calls": calls(first["backward"], "tp") - calls(base["backward"], "tp"),
            "reissued_tp_bytes": tp_bytes - base_bytes,
            "recomputed_mm": first["ops"].get("mm", 0) - base["ops"].get("mm", 0),
            "activation_bytes": held,
            "activation_ratio": held / base_held,
            "peak_activation_bytes": peak,
            "peak_activation_ratio": peak / base_peak,
            "step_peak_bytes": step,
            "step_peak_ratio": step / base_step,
            "grads_equal_on_every_rank": all(not r["unequal_grads"] for r in per_rank),
            "loss": first["loss"],
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks (default 4)")
    parser.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="TP with sequence parallelism (all-gathers and reduce-scatters "
                        "inside each block instead of all-reduces)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from composer_par.testing.distributed import run_ranks

    task = {"dim": args.dim, "seq_len": args.seq, "global_batch": args.batch,
            "n_heads": 8, "n_kv_heads": 4, "vocab_size": 1024}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    results = run_ranks("tests.ac_policy_workers:one_step", 2,
                        args=({"tp": 2}, args.layers),
                        kwargs={"task_options": task,
                                "sequence_parallel": args.sequence_parallel},
                        timeout=600, env={"PYTHONPATH": path})
    table = rows(results)
    if args.json:
        print(json.dumps({"model": {"layers": args.layers, **task}, "mesh": {"tp": 2},
                          "sequence_parallel": args.sequence_parallel,
                          "rows": table}, indent=2))
        return
    print(f"Llama: {args.layers} blocks, dim {args.dim}, seq {args.seq}, global batch "
          f"{args.batch}, vocab 1024; TP 2{' with sequence parallelism' * args.sequence_parallel}"
          " on 2 gloo ranks (one step, backward counted)\n")
    head = ("| policy | saves | tp collectives re-issued | re-issued bytes | matmuls "
            "recomputed | activations held after forward | vs no AC | peak in forward | "
            "vs no AC | step peak | vs no AC | grads equal |")
    print(head)
    print("|" + "---|" * 12)
    for row in table:
        print(f"| {row['policy']} | {row['saves']} | {row['reissued_tp_calls']} | "
              f"{row['reissued_tp_bytes'] / 1024:.0f} KiB | {row['recomputed_mm']} | "
              f"{row['activation_bytes'] / 2**20:.2f} MiB | {row['activation_ratio']:.2f} | "
              f"{row['peak_activation_bytes'] / 2**20:.2f} MiB | "
              f"{row['peak_activation_ratio']:.2f} | "
              f"{row['step_peak_bytes'] / 2**20:.2f} MiB | {row['step_peak_ratio']:.2f} | "
              f"{'yes' if row['grads_equal_on_every_rank'] else 'NO'} |")


if __name__ == "__main__":
    main()
