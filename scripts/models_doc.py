"""Write docs/models.md, the family x plan matrix of real Hugging Face models, from the
results of the tests' own matrix (tests/hf_workers.py, the cases tests/test_hf_models.py
runs and checks): each case trains on real gloo ranks against one process, and its cell
says what it gave. tests/test_hf_models.py fails when the page says otherwise.

    python scripts/models_doc.py            # runs the matrix (a few minutes), writes the page
    python scripts/models_doc.py --check    # runs it and exits 1 if the page differs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "models.md"
sys.path.insert(0, str(ROOT))

from composer_par.testing.distributed import run_ranks  # noqa: E402
from tests import hf_workers  # noqa: E402

# What a refusal means for these models, and what to do instead, by (code, family).
MEANING = {
    "CP408": "TP(plan=\"auto\") has nothing to work from: the model has no tp plan of its "
    "own and its module names are not Llama's (GPT-2's layers are Conv1D; BERT calls them "
    "query/key/value/dense); for sequence or loss parallel, the plan splits no token "
    "embedding or has no output head (ViT: a patch convolution and a classifier)",
}
FIX = {
    "CP408": "give TP an explicit plan (docs/tp.md) for GPT-2 (nn.Linear layers only) or "
    "BERT; train ViT with TP without sequence or loss parallel, or with FSDP2",
}


def render(two: list[list[dict[str, Any]]], four: list[list[dict[str, Any]]],
           problems: list[str]) -> str:
    import torch
    import transformers

    cells = {**hf_workers.cells(two), **hf_workers.cells(four)}
    refusals = {**hf_workers.refusals(two), **hf_workers.refusals(four)}
    plans = list(hf_workers.PLAN_TITLES)
    lines = [
        "# Hugging Face models",
        "",
        "<!-- Written by scripts/models_doc.py from the results of the tests' own matrix;",
        "     tests/test_hf_models.py fails when this page says otherwise. -->",
        "",
        f"Real transformers {transformers.__version__} models under every plan, on torch "
        f"{torch.__version__.split('+')[0]}, as tests/test_hf_models.py runs them: each "
        "family built on meta from a tiny config (hidden size 64, 2 layers, a 128-token "
        "vocabulary; nothing downloaded) with its default settings (the generation cache "
        "on, the model's own tp plan; dropout off, since its draws differ between "
        "layouts), initialized by MetaInit, trained 3 SGD steps with `labels=` on real "
        "gloo ranks (2 ranks; the `x` plans on 2x2).",
        "",
        "**trains** means: on every rank, each parameter's local part equals the same part "
        "of a single-process reference with the same initial weights, bitwise before "
        "training and within 1e-6 after it; the global-batch losses agree within the fp32 "
        "tolerance (rtol 1.3e-6, atol 1e-5) and fall; tied weights stay one parameter. A "
        "code means the plan was refused before anything changed, with that finding "
        "([rules.md](rules.md)); its meaning and fix are below. **fails** means neither "
        + ("(none does)." if "fails" not in cells.values() else
           "(see the problems at the end)."),
        "",
        "| family | " + " | ".join(hf_workers.PLAN_TITLES[p] for p in plans) + " |",
        "|---|" + "---|" * len(plans),
    ]
    for family in hf_workers.FAMILIES:
        lines.append(f"| `{family}` | " + " | ".join(cells.get((family, p), "-")
                                                     for p in plans) + " |")
    lines += ["", "Model classes: " + ", ".join(
        f"`{f}` {cls}" for f, (_, cls, _) in hf_workers.FAMILIES.items()) + ".", ""]
    lines += ["## What the refusals mean", ""]
    by_code: dict[str, list[tuple[str, str, str]]] = {}
    for (family, plan), found in sorted(refusals.items()):
        for code, message, _fix in found:
            by_code.setdefault(code, []).append((family, plan, message))
    for code, rows in by_code.items():
        lines += [f"### {code}", "", MEANING.get(code, ""), "",
                  f"Fix: {FIX.get(code, 'see rules.md')}.", "", "What it said:", ""]
        seen: set[tuple[str, str]] = set()
        for family, _, message in rows:
            if (family, message) in seen:
                continue
            seen.add((family, message))
            under = ", ".join(hf_workers.PLAN_TITLES[p] for f, p, m in rows
                              if f == family and m == message)
            lines.append(f"- `{family}` under {under}: {message}")
        lines.append("")
    lines += [
        "## What else the runs show",
        "",
        "- **The models' own tp plans** are used as they are (`colwise`, `rowwise`, "
        "`colwise_gather_output`, `rowwise_split_input`, `embedding_rowwise`, "
        "`replicated_with_grad_allreduce`, `packed_colwise` and `rowwise` on expert "
        "parameters, `moe_tp_experts`): see [tp.md](tp.md).",
        "- **Per-head norms** (Qwen3, Qwen3-MoE, Gemma3 `q_norm`/`k_norm`) see their rank's "
        "heads only; their gradients are summed over tp and every rank's copy matches the "
        "reference. With a plan written by hand that leaves them out, TP finds them beside "
        "the split projections (CP421) and does the same: "
        + ", ".join(f"`{f}` {cells.get((f, 'tp_handwritten'), '-')}"
                    for f in ("qwen3", "gemma3")) + ".",
        "- **Activation checkpointing** with the default `use_cache = true`: training "
        "forwards run without the generation cache (CP422, info), as transformers' own "
        "gradient checkpointing does.",
        "- **Tied embeddings** (Gemma, Gemma3 under TP: the embedding and the head both "
        "split the vocabulary) stay one parameter; BERT's `BertEmbeddings`, which holds the "
        "word embedding tied to the MLM decoder, is not made an FSDP unit.",
        "- **Weights** (tests/test_hf_weights.py): each family's `save_pretrained` loads "
        "with LoadSafetensors into FSDP2, TP and FSDP2 x TP (every family TP supports; "
        "GPT-2 and BERT refused under TP, CP408) with the plain model's logits, each rank "
        "reading exactly the bytes of its own part. The file's keys are converted as "
        "transformers converts them when it loads: GPT-NeoX's and ViT's older names "
        "renamed, Mixtral's and Qwen3-MoE's per-expert tensors merged into the fused "
        "experts (stacked, gate and up concatenated; each rank reads only its experts' or "
        "its slices' bytes). Every export reads back with `from_pretrained` to the same "
        "state dict. DCP checkpoints of TP's packed weights (Phi3's `gate_up_proj` as "
        "packed halves, Mixtral's packed experts) load into FSDP2, TP and one process "
        "bitwise ([checkpoints.md](checkpoints.md)).",
        "- **The models' own FSDP and expert-parallel plans** (transformers' `_fsdp_plan`, "
        "`_ep_plan`): FSDP2 shards the FSDP plan's units beside the blocks (embedding, "
        "final norm, head; those it keeps whole stay unsharded from forward to backward; "
        "a tied embedding and head stay in the root's unit), CP425; explicit `blocks=` "
        "replace it, CP426. No plugin applies the expert-parallel plan (no expert "
        "parallelism: each rank computes every expert), CP427.",
        "- **Mixture of experts** (Mixtral, Qwen3-MoE) run with transformers' default "
        "experts implementation; the dry run cannot step them on fake tensors (their router "
        "picks tokens with data-dependent ops) and says so ([estimate.md](estimate.md)).",
        "",
    ]
    if problems:
        lines += ["## Problems in this run", ""] + [f"- {p.splitlines()[0]}" for p in problems]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/models.md differs from what the run gives")
    args = parser.parse_args()
    two = run_ranks(hf_workers.train_cases, 2, args=(hf_workers.TWO_RANK_CASES,),
                    timeout=1800)
    four = run_ranks(hf_workers.train_cases, 4, args=(hf_workers.FOUR_RANK_CASES,),
                     timeout=1800)
    problems = (hf_workers.problems(two, hf_workers.TWO_RANK_CASES)
                + hf_workers.problems(four, hf_workers.FOUR_RANK_CASES))
    text = render(two, four, problems)
    if args.check:
        same = DOC.exists() and DOC.read_text(encoding="utf-8") == text
        print("docs/models.md is " + ("up to date" if same else "stale"))
        return 0 if same else 1
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}" + (f"; {len(problems)} problem(s)" if problems
                                              else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
