"""``plan="auto"``: a Hugging Face model's own tp plan translated to our styles, else a
plan from recognized module names (Llama in torchtitan or Hugging Face naming, GPT)."""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import clean_name, expert_parallel_plan

from .patterns import generalize, matches
from .styles import HF_STYLES, HF_UNSUPPORTED, StyleSpec

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
    """A Hugging Face model's tp plan with keys relative to ``model``, as transformers
    itself reads it: the instance's ``_tp_plan`` (transformers 5 composes the whole plan
    there, with prefixes such as ``model.layers.*``), then the config's
    ``base_model_tp_plan`` (placed under ``base_model_prefix`` for a model with a head:
    older versions keep the base plan there only), then every sub-module's own
    ``_tp_plan`` under its path. The first entry for a key wins."""
    import torch.nn as nn

    plan: dict[str, str] = {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    # A model with a head (LlamaForCausalLM) holds its base model under the prefix.
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping):
        plan.update({str(k): v for k, v in own.items()})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or getattr(
        model, "base_model_tp_plan", None)
    if isinstance(base, Mapping):
        for key, style in base.items():
            plan.setdefault(f"{prefix}.{key}" if has_base else key, style)
    for path, module in model.named_modules():
        if not path:
            continue
        sub = getattr(module, "_tp_plan", None)
        if isinstance(sub, Mapping):
            for key, style in sub.items():
                plan.setdefault(f"{clean_name(path)}.{key}", style)
    for key, style in fused_expert_entries(model, plan).items():
        plan.setdefault(key, style)
    return plan


def fused_expert_entries(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, str]:
    """The tp plan entries transformers up to 5.24 gave fused experts (a ``gate_up_proj``
    and a ``down_proj`` per experts module), for the experts modules of the model's
    ``_ep_plan`` that ``plan`` says nothing of. transformers 5.25 dropped them from its
    models' tp plans (its answer for experts is expert parallelism); without them, TP
    would replicate every expert on every tp rank, where the same plan on 5.24 splits
    them. A plan with EP keeps EP's placement: TP leaves distributed modules alone."""
    ep_plan = expert_parallel_plan(model)
    entries: dict[str, str] = {}
    for key, style in ep_plan.items():
        if style != "ep_dispatch_experts" or any(
                k == key or k.startswith(f"{key}.") for k in plan):
            continue
        weights = {k.removeprefix(f"{key}.") for k, s in ep_plan.items()
                   if s == "grouped_gemm" and k.startswith(f"{key}.")}
        if weights == {"gate_up_proj", "down_proj"}:
            entries.update({f"{key}.gate_up_proj": "packed_colwise",
                            f"{key}.down_proj": "rowwise", key: "moe_tp_experts"})
    return entries


@attrs.frozen
class Fallback:
    """A Hugging Face plan entry TP does not honour: the modules it names stay whole."""

    pattern: str
    style: str
    why: str
    modules: tuple[str, ...]  # the module paths left whole (with everything below them)


def translate_hf(plan: Mapping[str, Any], modules: Mapping[str, Any],
                 parameters: Mapping[str, tuple[Any, str]],
                 refused: list[Fallback] | None = None) -> tuple[
    list[tuple[str, StyleSpec]], list[Fallback]
]:
    """Hugging Face entries as ours. An entry may name modules or parameters (MoE expert
    weights); entries matching nothing are dropped (a class-level plan may name modules
    this instance lacks). A style TP does not honour (:data:`HF_UNSUPPORTED`: the
    expert-parallel ones) is a :class:`Fallback`: the modules it names (a parameter's
    owner) keep their weights whole, and so does everything below them, the other entries
    there included. A style TP does not know is appended to ``refused``: nothing says
    whether its module left whole would train right beside what the plan splits."""
    import torch.nn as nn

    out: list[tuple[str, StyleSpec]] = []
    fallbacks: list[Fallback] = []
    for pattern, style in plan.items():
        hits = [(n, m) for n, m in modules.items() if n and matches(pattern, n)]
        param_hits = [(n, owner) for n, (owner, _) in parameters.items() if matches(pattern, n)]
        if not hits and not param_hits:
            continue
        table = HF_STYLES.get(style) if isinstance(style, str) else None
        if table is None:
            owners = [n for n, _ in hits] + [n.rsplit(".", 1)[0] for n, _ in param_hits]
            if isinstance(style, str) and style in HF_UNSUPPORTED:
                fallbacks.append(Fallback(pattern, style, HF_UNSUPPORTED[style],
                                          tuple(dict.fromkeys(owners))))
            elif refused is not None:
                refused.append(Fallback(pattern, str(style), "composer_par's TP has no such "
                                        "style" if isinstance(style, str) else
                                        f"{style!r} is not a style name",
                                        tuple(dict.fromkeys(owners))))
            continue
        table = dict(table)
        if hits and all(isinstance(m, nn.Embedding) for _, m in hits) and table["style"] in (
            "colwise", "rowwise", "colwise_gather"
        ):
            # HF's rowwise(_rep) on an embedding: vocab split, output replicated.
            kind = "colwise" if table["style"].startswith("colwise") else "rowwise"
            table = {"style": f"embedding_{kind}"}
        out.append((pattern, StyleSpec.parse(table)))
    if fallbacks:
        whole = [m for f in fallbacks for m in f.modules]
        out = [(p, s) for p, s in out
               if not any(_under(p, w) for w in whole)]
    return out, fallbacks


def _under(pattern: str, module: str) -> bool:
    """Whether a plan pattern names ``module`` or something below it."""
    parts = pattern.split(".")
    depth = module.count(".") + 1
    return len(parts) >= depth and matches(".".join(parts[:depth]), module)


@attrs.frozen
class AutoPlan:
    """``plan="auto"`` for one model: entries (patterns over module and parameter paths),
    where they come from, a CP408 problem, and the entries held back (CP420)."""

    entries: list[tuple[str, StyleSpec]]
    source: str
    problem: str | None = None
    fallbacks: tuple[Fallback, ...] = ()
    # Entries of the model's own plan whose style TP does not know (CP433).
    refused: tuple[Fallback, ...] = ()


HF_SOURCE = "Hugging Face tp plan"
#: The sources of a plan built from recognized module names.
NAME_SOURCES = ("Llama names", "Hugging Face Llama names", "GPT names")
#: The sources of a plan for a Hugging Face model's forward, and what to call each.
HF_FORWARD_SOURCES = {HF_SOURCE: "the model's Hugging Face tp plan",
                      NAME_SOURCES[1]: "the auto plan from its Llama names"}


def auto_plan(
    model: nn.Module, modules: Mapping[str, Any], parameters: Mapping[str, tuple[Any, str]],
    sequence_parallel: bool, loss_parallel: bool, *, starts: bool = True, ends: bool = True,
) -> AutoPlan:
    """The auto plan: the model's own Hugging Face tp plan, else recognized names.

    ``starts``/``ends``: ``model`` begins / ends the whole model. A pipeline stage after
    the first lacks the token embedding, one before the last the norm and output head;
    with sequence parallel such a stage takes / hands on the residual stream as it is
    between blocks (each tp rank's sequence shard), so only the stage that starts the
    model needs the embedding that shards the stream and only the one that ends it the
    head that gathers it.
    """
    hf = hf_tp_plan(model)
    family = _family(modules)
    if family is None and not (starts and ends) and _ends_only(modules):
        # A pipeline stage holding only the embedding, or only the norm and head: their
        # styles are the same under either Llama naming.
        family = "llama"
    if hf:
        refused: list[Fallback] = []
        entries, fallbacks = translate_hf(hf, modules, parameters, refused)
        entries = [(p, with_rope_dim(spec, model)) for p, spec in entries]
        problem = None
        if not entries:
            problem = "the model's Hugging Face tp plan matches none of its modules"
        elif loss_parallel and ends and not any(s.style == "colwise_gather"
                                                for _, s in entries):
            problem = ("loss_parallel = true, but the model's Hugging Face tp plan has no "
                       "gathered output head (colwise_gather_output) to keep sharded")
        return AutoPlan(entries, HF_SOURCE, problem, tuple(fallbacks), tuple(refused))
    if family in ("llama", "hf_llama"):
        entries, fallbacks = _llama_plan(model, modules, family, sequence_parallel)
        problem = None
        styles = {s.style for _, s in entries}
        if sequence_parallel and not ((styles & {"embedding_rowwise"} or not starts) and
                                      (styles & {"colwise_gather"} or not ends)):
            # A vision model (ViT: a patch convolution, a classifier) has neither.
            problem = ("sequence_parallel = true, but the auto plan found no token embedding "
                       f"({'/'.join(EMBEDDING_NAMES)}) or no output head "
                       f"({'/'.join(OUTPUT_NAMES)}) in {type(model).__name__}: the residual "
                       "stream would start or end replicated, with nothing to shard it onto "
                       "the sequence or gather it back")
        elif sequence_parallel and fallbacks:
            # A whole attention would compute on the gathered sequence and hand every rank
            # the full output, whose gradient is then partial on each rank.
            left = dict.fromkeys(generalize(m) for f in fallbacks for m in f.modules)
            problem = ("sequence_parallel = true, but the auto plan leaves "
                       f"{', '.join(left)} whole (a fused q/k/v projection): a module "
                       "left whole between sequence-sharded norms has no sequence-parallel "
                       "layout")
        elif loss_parallel and ends and "colwise_gather" not in styles:
            problem = ("loss_parallel = true, but the auto plan found no output head "
                       f"({'/'.join(OUTPUT_NAMES)}) in {type(model).__name__} to keep "
                       "sharded on the vocabulary")
        return AutoPlan(entries, NAME_SOURCES[0] if family == "llama" else
                        NAME_SOURCES[1], problem, tuple(fallbacks))
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
        return AutoPlan(entries, NAME_SOURCES[2], problem)
    return AutoPlan([], "auto", (
        f"plan = \"auto\" found no Hugging Face tp plan on {type(model).__name__} and "
        "recognized none of its module names (Llama: wq/wk/wv/wo/w1/w2/w3 or "
        "q_proj/.../down_proj; GPT: mlp.c_fc/mlp.c_proj as nn.Linear)"))


def rope_dim_of(model: Any) -> int | None:
    """The width of a latent attention's rotary part from a Hugging Face model's (text)
    config: ``qk_rope_head_dim``, which transformers' own style reads; None without one."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    if callable(text):
        # A config class whose text part needs arguments keeps its own fields.
        with contextlib.suppress(TypeError, ValueError):
            config = text()
    value = getattr(config, "qk_rope_head_dim", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def with_rope_dim(spec: StyleSpec, model: Any) -> StyleSpec:
    """An ``mla_kv_a_proj`` entry with its rotary width from the model's config, where
    the entry gave none (validation refuses it still missing: CP432)."""
    if spec.style != "mla_kv_a_proj" or spec.rope_dim is not None:
        return spec
    width = rope_dim_of(model)
    return attrs.evolve(spec, rope_dim=width) if width is not None else spec


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


def _ends_only(modules: Mapping[str, Any]) -> bool:
    """Whether the only Linears and embeddings are a Llama's ends: the token embedding
    and the output head, by name (what a pipeline stage without blocks holds)."""
    import torch.nn as nn

    found = False
    for name, module in modules.items():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding):
            if leaf not in EMBEDDING_NAMES:
                return False
            found = True
        elif isinstance(module, nn.Linear):
            if leaf not in OUTPUT_NAMES or name.count(".") > 1:
                return False
            found = True
    return found


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


# Fused projections: q, k and v in one Linear (sizes differ under grouped-query attention,
# and the forward splits the output by the full sizes), gate and up in one (two equal
# halves, split as packed_colwise).
FUSED_QKV = ("wqkv", "qkv_proj", "qkv", "c_attn", "query_key_value", "in_proj", "Wqkv")
FUSED_GATE_UP = ("w13", "gate_up_proj")


def _llama_plan(
    model: nn.Module, modules: Mapping[str, Any], family: str, sequence_parallel: bool
) -> tuple[list[tuple[str, StyleSpec]], list[Fallback]]:
    """torchtitan's Llama plan: q/k/v and w1/w3 colwise, o and w2 rowwise, the token
    embedding rowwise, the output head colwise with gathered (or, with loss parallel,
    sharded) logits; with sequence parallel the norms shard the sequence and attention and
    feed-forward gather their input once (prepare_input). A fused gate/up projection is
    packed_colwise; an attention whose q, k and v are one fused Linear stays whole (its
    output projection is not split either): a Fallback says so."""
    import torch.nn as nn

    leaves = LLAMA_LEAVES if family == "llama" else HF_LLAMA_LEAVES
    patterns: dict[str, StyleSpec] = {}
    parents: dict[str, str] = {}
    fused: dict[str, list[str]] = {}  # pattern of a fused qkv Linear -> its attentions
    for name, module in modules.items():
        leaf = name.rsplit(".", 1)[-1]
        if name and "." in name and leaf in FUSED_QKV and isinstance(module, nn.Linear):
            fused.setdefault(generalize(name), []).append(name.rsplit(".", 1)[0])
    whole = [owner for owners in fused.values() for owner in owners]
    fallbacks = [Fallback(
        pattern, "fused qkv", f"{pattern.rsplit('.', 1)[-1]} holds q, k and v in one Linear "
        "(their sizes differ under grouped-query attention and the forward splits its "
        "output by the full sizes), so splitting it column-wise would hand each rank parts "
        "of q, k and v that do not belong together; attention is left whole",
        tuple(owners)) for pattern, owners in fused.items()]
    for name, module in modules.items():
        if not name or any(name == w or name.startswith(w + ".") for w in whole):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in leaves:
            patterns.setdefault(generalize(name), StyleSpec(leaves[leaf]))
            if leaves[leaf] == "colwise" and "." in name:
                parents.setdefault(generalize(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[0])
        elif isinstance(module, nn.Linear) and leaf in FUSED_GATE_UP:
            patterns.setdefault(generalize(name), StyleSpec("packed_colwise", split_factor=2))
        elif isinstance(module, nn.Embedding) and leaf in EMBEDDING_NAMES:
            patterns.setdefault(generalize(name), StyleSpec("embedding_rowwise"))
        elif isinstance(module, nn.Linear) and leaf in OUTPUT_NAMES and name.count(".") <= 1:
            patterns.setdefault(generalize(name), StyleSpec("colwise_gather"))
        elif sequence_parallel and family == "llama" and _is_norm(module):
            patterns.setdefault(generalize(name), StyleSpec("sequence_parallel"))
    if not sequence_parallel or family != "llama":
        # A Hugging Face model computes its positions from the stream's shape: resolution
        # gives its names the layout of a Hugging Face plan (sequence.py), norms included.
        return list(patterns.items()), fallbacks
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
    return list(out.items()), fallbacks


def _positional_args(module: Any) -> int:
    params = list(inspect.signature(module.forward).parameters.values())
    return max(1, sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params))
