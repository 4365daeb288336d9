"""``plan="auto"``: a Hugging Face model's own tp plan translated to our styles, else a
plan from recognized module names (Llama in torchtitan or Hugging Face naming, GPT)."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import clean_name

from .patterns import generalize, matches
from .styles import HF_STYLES, StyleSpec

if TYPE_CHECKING:
    import torch.nn as nn


# Llama in torchtitan / Meta naming; Hugging Face Llama (Mistral, Qwen2, ...) naming.
LLAMA_LEAVES = {
    "wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise",
    "w1": "colwise", "w3": "colwise", "w2": "rowwise",
}
HF_LLAMA_LEAVES = {
    "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
    "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise",
}
EMBEDDING_NAMES = ("tok_embeddings", "embed_tokens")
OUTPUT_NAMES = ("output", "lm_head")
# GPT (nanoGPT / GPT-2) MLP; its attention's c_attn fuses q, k and v into one Linear, and
# splitting that column-wise would hand rank 0 all of q: attention stays replicated.
GPT_LEAVES = {("mlp", "c_fc"): "colwise", ("mlp", "c_proj"): "rowwise"}


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """A Hugging Face model's tp plan with keys relative to ``model``: the config's
    ``base_model_tp_plan`` (under ``base_model_prefix`` for a model with a head) and
    every module's ``_tp_plan`` (under that module's path)."""
    import torch.nn as nn

    plan: dict[str, str] = {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    # A model with a head (LlamaForCausalLM) holds its base model under the prefix.
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or getattr(
        model, "base_model_tp_plan", None)
    if isinstance(base, Mapping):
        for key, style in base.items():
            plan[f"{prefix}.{key}" if has_base else key] = style
    for path, module in model.named_modules():
        own = getattr(module, "_tp_plan", None)
        if isinstance(own, Mapping):
            for key, style in own.items():
                full = f"{clean_name(path)}.{key}" if path else key
                plan.setdefault(full, style)
    return plan


def _translate_hf(plan: Mapping[str, Any], modules: Mapping[str, Any]) -> tuple[
    list[tuple[str, StyleSpec]], list[str]
]:
    """Hugging Face entries as ours; entries matching nothing are dropped (a class-level
    plan may name modules this instance lacks). Returns the entries and unsupported styles."""
    import torch.nn as nn

    out, unsupported = [], []
    for pattern, style in plan.items():
        hits = [m for n, m in modules.items() if n and matches(pattern, n)]
        if not hits:
            continue
        table = HF_STYLES.get(style) if isinstance(style, str) else None
        if table is None:
            unsupported.append(f"{pattern} = {style!r}")
            continue
        table = dict(table)
        if all(isinstance(m, nn.Embedding) for m in hits) and table["style"] in (
            "colwise", "rowwise", "colwise_gather"
        ):
            # HF's rowwise(_rep) on an embedding: vocab split, output replicated.
            kind = "colwise" if table["style"].startswith("colwise") else "rowwise"
            table = {"style": f"embedding_{kind}"}
        out.append((pattern, StyleSpec.parse(table)))
    return out, unsupported


def auto_plan(
    model: nn.Module, modules: Mapping[str, Any], sequence_parallel: bool, loss_parallel: bool
) -> tuple[list[tuple[str, StyleSpec]], str, str | None]:
    """``(entries, source, problem)`` for ``plan="auto"``; ``problem`` is a CP408 message."""
    hf = hf_tp_plan(model)
    family = _family(modules)
    if hf and not (sequence_parallel and family in ("llama", "hf_llama")):
        entries, unsupported = _translate_hf(hf, modules)
        if unsupported:
            return [], "Hugging Face tp plan", (
                f"the model's Hugging Face tp plan uses styles composer_par's TP does not "
                f"support: {', '.join(unsupported)} (supported: {sorted(HF_STYLES)})")
        problem = None
        if sequence_parallel:
            problem = ("sequence_parallel = true with the model's Hugging Face tp plan: that "
                       "plan has no sequence-parallel layouts and the model's names are not "
                       "Llama-style")
        elif not entries:
            problem = "the model's Hugging Face tp plan matches none of its modules"
        elif loss_parallel and not any(s.style == "colwise_gather" for _, s in entries):
            problem = ("loss_parallel = true, but the model's Hugging Face tp plan has no "
                       "gathered output head (colwise_rep) to keep sharded")
        return entries, "Hugging Face tp plan", problem
    if family in ("llama", "hf_llama"):
        return _llama_plan(model, modules, family, sequence_parallel), (
            "Llama names" if family == "llama" else "Hugging Face Llama names"), None
    if family == "gpt":
        entries = _gpt_plan(modules)
        problem = None
        if sequence_parallel:
            problem = ("sequence_parallel = true: the auto plan recognized GPT names, whose "
                       "fused attention and position embeddings it leaves replicated, so it "
                       "has no sequence-parallel plan for this model")
        elif loss_parallel:
            problem = ("loss_parallel = true: the auto plan leaves a GPT model's output head "
                       "replicated (it is usually tied to the token embedding)")
        return entries, "GPT names", problem
    return [], "auto", (
        f"plan = \"auto\" found no Hugging Face tp plan on {type(model).__name__} and "
        "recognized none of its module names (Llama: wq/wk/wv/wo/w1/w2/w3 or "
        "q_proj/.../down_proj; GPT: mlp.c_fc/mlp.c_proj)")


def _family(modules: Mapping[str, Any]) -> str | None:
    import torch.nn as nn

    leaves = Counter(n.rsplit(".", 1)[-1] for n, m in modules.items()
                     if n and isinstance(m, nn.Linear))
    if all(leaves[k] for k in ("wq", "wo")) or all(leaves[k] for k in ("w1", "w2", "w3")):
        return "llama"
    if all(leaves[k] for k in ("q_proj", "o_proj")) or all(
        leaves[k] for k in ("gate_proj", "down_proj")
    ):
        return "hf_llama"
    if any(_gpt_style(n) for n, m in modules.items() if isinstance(m, nn.Linear)):
        return "gpt"
    return None


def _gpt_style(name: str) -> str | None:
    parts = name.split(".")
    return GPT_LEAVES.get(tuple(parts[-2:])) if len(parts) >= 2 else None  # type: ignore[arg-type]


def _gpt_plan(modules: Mapping[str, Any]) -> list[tuple[str, StyleSpec]]:
    import torch.nn as nn

    patterns: dict[str, str] = {}
    for name, module in modules.items():
        style = _gpt_style(name)
        if style and isinstance(module, nn.Linear):
            patterns.setdefault(generalize(name), style)
    return [(p, StyleSpec(s)) for p, s in patterns.items()]


def _is_norm(module: Any) -> bool:
    name = type(module).__name__
    return name.endswith("Norm") or name in ("LayerNorm", "RMSNorm")


def _llama_plan(
    model: nn.Module, modules: Mapping[str, Any], family: str, sequence_parallel: bool
) -> list[tuple[str, StyleSpec]]:
    """torchtitan's Llama plan: q/k/v and w1/w3 colwise, o and w2 rowwise, the token
    embedding rowwise, the output head colwise with gathered (or, with loss parallel,
    sharded) logits; with sequence parallel the norms shard the sequence and attention and
    feed-forward gather their input once (prepare_input)."""
    import torch.nn as nn

    leaves = LLAMA_LEAVES if family == "llama" else HF_LLAMA_LEAVES
    patterns: dict[str, StyleSpec] = {}
    parents: dict[str, str] = {}
    for name, module in modules.items():
        if not name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in leaves:
            patterns.setdefault(generalize(name), StyleSpec(leaves[leaf]))
            if leaves[leaf] == "colwise" and "." in name:
                parents.setdefault(generalize(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[0])
        elif isinstance(module, nn.Embedding) and leaf in EMBEDDING_NAMES:
            patterns.setdefault(generalize(name), StyleSpec("embedding_rowwise"))
        elif isinstance(module, nn.Linear) and leaf in OUTPUT_NAMES and name.count(".") <= 1:
            patterns.setdefault(generalize(name), StyleSpec("colwise_gather"))
        elif sequence_parallel and _is_norm(module):
            patterns.setdefault(generalize(name), StyleSpec("sequence_parallel"))
    if not sequence_parallel or family != "llama":
        # Hugging Face attention is called with keyword arguments: each colwise layer
        # gathers its own sequence-sharded input instead (the same values, more gathers).
        return list(patterns.items())
    # torchtitan: gather the sequence once per attention / feed-forward, not per Linear.
    out: dict[str, StyleSpec] = {}
    for pattern, spec in patterns.items():
        parent = pattern.rsplit(".", 1)[0] if "." in pattern else None
        if parent in parents and spec.style == "colwise":
            if parent not in out:
                n_args = _positional_args(modules[parents[parent]])
                out[parent] = StyleSpec(
                    "prepare_input",
                    input_layouts=("shard(1)",) + (None,) * (n_args - 1),
                    desired_input_layouts=("replicate",) + (None,) * (n_args - 1),
                )
            out[pattern] = attrs.evolve(spec, input_layouts=("replicate",))
        else:
            out[pattern] = spec
    return list(out.items())


def _positional_args(module: Any) -> int:
    params = list(inspect.signature(module.forward).parameters.values())
    return max(1, sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params))
