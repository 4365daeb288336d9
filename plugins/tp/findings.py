"""What can be wrong with a TP plan: the plugin's rule catalog (:data:`RULES`), the
options against the explicit plan (CP214, static), and the resolved plan against the
model (CP406, CP407, CP409)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from composer_par.plugin import Finding, Rule, Severity

from .patterns import generalize
from .styles import (
    EMBEDDING_STYLES,
    LINEAR_STYLES,
    PARAM_STYLES,
    StyleSpec,
)

if TYPE_CHECKING:
    import torch.nn as nn

_TP_PLAN = '[mesh]\ntp = 2\n\n[[plugins]]\nname = "tp"\n'

# TP's rule codes: static ones on the plan alone (CP21x), model-aware ones (CP40x).
RULES = (
    Rule("CP212", Severity.ERROR, "a TP plan entry names an unknown style",
         "use one of TP's styles (docs/tp.md lists them)",
         _TP_PLAN + '\n[plugins.plan]\n"layers.*.attention.wo" = "rowwse"\n'),
    Rule("CP213", Severity.ERROR, "a TP plan entry has invalid style arguments",
         "give the arguments the style takes (docs/tp.md lists them per style)",
         _TP_PLAN + '\n[plugins.plan."layers.*.attention"]\nstyle = "prepare_input"\n'
         'input_layouts = ["shard(1)", "none"]\n'),
    Rule("CP214", Severity.ERROR, "TP options contradict the TP plan",
         'map the norms to "sequence_parallel" (and the output head to "colwise_gather" for '
         "loss parallel), or turn the option off",
         '[mesh]\ntp = 2\n\n[[plugins]]\nname = "tp"\nsequence_parallel = true\n\n'
         '[plugins.plan]\n"layers.*.attention.wq" = "colwise"\n'
         '"layers.*.attention.wo" = "rowwise"\n'),
    Rule("CP406", Severity.ERROR, "the TP size does not divide a feature size it splits",
         "use a tp size that divides every feature the plan splits, or change the model's "
         "widths",
         "ParallelPlan(MeshSpec(tp=4)).use(TP()).use(MetaInit())"
         ".validate(llama_with_ffn_hidden_130)"),
    Rule("CP407", Severity.ERROR, "the TP size does not divide the attention head count",
         "use a tp size that divides the head and KV-head counts",
         "ParallelPlan(MeshSpec(tp=4)).use(TP()).use(MetaInit())"
         ".validate(llama_with_2_kv_heads)"),
    Rule("CP408", Severity.ERROR, "a TP plan pattern matches no module",
         "correct the pattern (the model's own module names, '*' one component), or give "
         "an explicit plan",
         "ParallelPlan(MeshSpec(tp=2)).use(TP(plan={\"layers.*.attention.wqq\": "
         "\"colwise\"})).use(MetaInit()).validate(llama)"),
    Rule("CP409", Severity.ERROR, "a TP plan entry does not fit the module it matches",
         "use the style the fix names, or map the module's children instead",
         "ParallelPlan(MeshSpec(tp=2)).use(TP(plan={\"tok_embeddings\": \"rowwise\"}))"
         ".use(MetaInit()).validate(llama)"),
)


def option_conflicts(
    parsed: list[tuple[str, StyleSpec]], sequence_parallel: bool, loss_parallel: bool
) -> list[Finding]:
    """CP214: the options ask for what the explicit plan does not do (or the reverse)."""
    found = []
    sp_entries = [p for p, s in parsed if s.style == "sequence_parallel"]
    if sequence_parallel and not sp_entries:
        found.append(Finding(
            "CP214",
            "sequence_parallel = true, but no plan entry has the 'sequence_parallel' style: "
            "the norms would see only their rank's part of the sequence and their weight "
            "gradients would miss the other ranks' tokens",
            fix="map the norms to \"sequence_parallel\" (e.g. \"layers.*.attention_norm\" = "
            "\"sequence_parallel\"), or set sequence_parallel = false",
        ))
    if sp_entries and not sequence_parallel:
        found.append(Finding(
            "CP214",
            f"plan[{sp_entries[0]!r}] uses the 'sequence_parallel' style but "
            "sequence_parallel = false: the residual stream stays replicated, so that "
            "module would take its full input for a sequence shard",
            fix="set sequence_parallel = true (rowwise outputs and colwise inputs are then "
            "sequence-sharded), or give those modules another style",
        ))
    if loss_parallel and not any(s.style == "colwise_gather" for _, s in parsed):
        found.append(Finding(
            "CP214",
            "loss_parallel = true, but no plan entry has the 'colwise_gather' style: loss "
            "parallel keeps the output head's logits sharded on the vocabulary, and the "
            "plan names no output head",
            fix="map the output projection to \"colwise_gather\" (e.g. output = "
            "\"colwise_gather\"), or set loss_parallel = false",
        ))
    return found


def fit_finding(message: str, fix: str) -> Finding:
    """A CP409 finding: the plan does not fit the model."""
    return Finding("CP409", message, fix=fix)


def _type_name(module: Any) -> str:
    return type(module).__name__


def fit_findings(entries: list[tuple[str, Any, StyleSpec]], tp_size: int) -> list[Finding]:
    """CP409 (a style on the wrong kind of module) and CP406 (features not divisible), one
    finding per kind of problem, naming the first module and how many more share it."""
    import torch.nn as nn

    misfit: dict[tuple[str, str], list[str]] = defaultdict(list)  # (message, fix) -> paths
    uneven: dict[tuple[str, str, int], list[str]] = defaultdict(list)
    names = {path for path, _, _ in entries}
    for path, module, spec in entries:
        kind = _type_name(module)
        if spec.style in LINEAR_STYLES:
            if isinstance(module, nn.Embedding):
                twin = "embedding_" + ("colwise" if spec.style.startswith("colwise") else "rowwise")
                misfit[(f"{{path}} is an Embedding; {spec.style!r} is for Linear layers",
                        f"use {twin!r} for embeddings")].append(path)
                continue
            if not isinstance(module, nn.Linear):
                misfit[(f"{{path}} ({kind}) cannot take {spec.style!r}: torch splits only "
                        "nn.Linear (and nn.Embedding) column/row-wise",
                        "map the Linear layers inside it instead, or use 'prepare_input'/"
                        "'sequence_parallel'/'replicate' for this module")].append(path)
                continue
            feature = LINEAR_STYLES[spec.style]
            if getattr(module, feature) % tp_size:
                uneven[(spec.style, feature, getattr(module, feature))].append(path)
        elif spec.style in EMBEDDING_STYLES:
            if not isinstance(module, nn.Embedding):
                misfit[(f"{{path}} ({kind}) is not an nn.Embedding; {spec.style!r} splits "
                        "embedding tables", "use 'colwise'/'rowwise' for Linear layers"
                        )].append(path)
                continue
            feature = EMBEDDING_STYLES[spec.style]
            if getattr(module, feature) % tp_size:
                uneven[(spec.style, feature, getattr(module, feature))].append(path)
        if spec.style in PARAM_STYLES and path:
            inner = sorted(n for n in names if n.startswith(path + "."))
            if inner:
                misfit[(f"{{path}} ({spec.style}) contains {generalize(inner[0])}, which the "
                        f"plan also maps: {spec.style!r} distributes every parameter below it",
                        "use 'prepare_input'/'prepare_output' for the outer module, or drop "
                        "the inner entry")].append(path)
    found = [fit_finding(message.format(path=paths[0]) + _more(paths), fix)
             for (message, fix), paths in misfit.items()]
    for (style, feature, size), paths in uneven.items():
        found.append(Finding(
            "CP406",
            f"{paths[0]}{_more(paths)}: {style!r} splits {feature}={size} over tp({tp_size}), "
            f"and {size} is not divisible by {tp_size}",
            fix=f"use a tp size that divides {size} (e.g. {_divisor_below(size, tp_size)}), "
            "or change the model's width",
        ))
    return found


def _more(paths: list[str]) -> str:
    return f" (and {len(paths) - 1} more like it)" if len(paths) > 1 else ""


def _divisor_below(size: int, tp: int) -> int:
    return next(d for d in range(min(tp, size), 0, -1) if size % d == 0)


# Attribute names that hold attention head counts, on modules or on their config.
HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "num_attention_heads")
KV_HEAD_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")
_ATTENTION_HINTS = ("attn", "attention")
_QKV_LEAVES = {"wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key",
               "value", "c_attn", "qkv", "in_proj"}


def head_findings(
    model: nn.Module, modules: Mapping[str, Any], entries: list[tuple[str, Any, StyleSpec]],
    tp_size: int,
) -> list[Finding]:
    """CP407: the tp size must divide the head and KV-head counts of the attention it
    splits; else each rank holds a fraction of a head and forward fails in a reshape."""
    attention = [
        path for path, _, spec in entries
        if spec.style in ("colwise", "colwise_gather")
        and (path.rsplit(".", 1)[-1] in _QKV_LEAVES
             or any(h in part for part in path.split(".")[:-1] for h in _ATTENTION_HINTS))
    ]
    if not attention:
        return []
    owners: list[str] = [""]  # the root (its config) always
    for path in attention:
        parts = path.split(".")
        owners += [".".join(parts[:i]) for i in range(1, len(parts))]
    found, seen = [], set()
    for owner in dict.fromkeys(owners):
        module = modules.get(owner)
        for where, obj in ((owner, module), (f"{owner}.config" if owner else "config",
                                             getattr(module, "config", None))):
            if obj is None:
                continue
            for attr in (*HEAD_ATTRS, *KV_HEAD_ATTRS):
                value = getattr(obj, attr, None)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    continue
                if value % tp_size == 0 or (attr, value) in seen:
                    continue
                seen.add((attr, value))
                kind = "KV-head" if attr in KV_HEAD_ATTRS else "attention head"
                holder = ".".join(x for x in (type(model).__name__, where) if x)
                found.append(Finding(
                    "CP407",
                    f"{holder}.{attr}={value}: the {kind} count is not "
                    f"divisible by tp({tp_size}), so each rank would hold {value}/{tp_size} "
                    "heads (torch fails later, inside forward, with a reshape error like "
                    "\"shape '[2, 8, -1, 8]' is invalid\")",
                    fix=f"use a tp size that divides {value} (e.g. "
                    f"{_divisor_below(value, tp_size)}), or a model with a multiple of "
                    f"{tp_size} {kind}s",
                ))
    return found


def rest_findings(modules: Mapping[str, Any], rest: list[tuple[str, Any]]) -> list[Finding]:
    """CP409: replicate_rest wraps a module's inputs and outputs; that is safe only for a
    module none of whose children own parameters (a norm, an embedding, a bias holder)."""
    found = []
    for name, module in rest:
        children = [n for n, m in module.named_modules() if n and any(
            True for _ in m.parameters(recurse=False))]
        if children:
            found.append(fit_finding(
                f"{name or '<root>'} ({_type_name(module)}) owns parameters that no style "
                f"makes DTensors and also has sub-modules with parameters ({children[0]}): "
                "replicate_rest cannot wrap it without changing what its children receive",
                f"map {name or 'that module'} to a style, or set replicate_rest = false (then "
                "use a for-loop optimizer: foreach/fused optimizers and clip_grad_norm_ fail "
                "on a mix of Tensor and DTensor parameters)"))
    return found


def tie_findings(modules: Mapping[str, Any], entries: list[tuple[str, Any, StyleSpec]]) -> list[
    Finding
]:
    """CP409: a style that distributes a parameter shared with another module (a token
    embedding tied to the output head) would replace it in one module only: the tie would
    break silently and the two copies train apart."""
    owners: dict[int, list[str]] = defaultdict(list)
    for name, module in modules.items():
        for param in module.parameters(recurse=False):
            owners[id(param)].append(name)
    found = []
    for path, module, spec in entries:
        if spec.style not in PARAM_STYLES:
            continue
        for pname, param in module.named_parameters(recurse=False):
            others = [o for o in owners[id(param)] if o != path]
            if others:
                found.append(fit_finding(
                    f"{path}.{pname} is tied to {others[0]} (one parameter in two modules); "
                    f"{spec.style!r} would replace it in {path} only and untie them",
                    f"leave {path} out of the plan (it is then replicated with its twin), or "
                    "untie the weights"))
    return found
