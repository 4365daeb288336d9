"""What can be wrong with a TP plan: the plugin's rule catalog (:data:`RULES`), the
options against the explicit plan (CP214, static), and the resolved plan against the
model (CP406, CP407, CP409)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from composer_par.plugin import Finding, Rule, Severity, tied_registrations

from .patterns import generalize
from .styles import (
    EMBEDDING_STYLES,
    LINEAR_STYLES,
    LOCAL_FORWARD_STYLES,
    PACKED_STYLES,
    PARAM_STYLES,
    PARAMETER_STYLES,
    SHARDED_OUTPUT_STYLES,
    StyleSpec,
)

if TYPE_CHECKING:
    import torch.nn as nn

    from .auto import Fallback

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
    Rule("CP420", Severity.WARNING, "the auto plan leaves some modules whole",
         "accept it (those weights are replicated on every tp rank), or give TP(plan={...}) "
         "explicitly for those modules",
         "ParallelPlan(MeshSpec(tp=2)).use(TP()).use(MetaInit())"
         ".validate(model_whose_tp_plan_has_mla_kv_a_proj)"),
    Rule("CP421", Severity.INFO, "a module runs on tp-sharded activations",
         "nothing to do; map it yourself (\"replicate\" or \"replicate_grad_allreduce\") "
         "to say otherwise",
         "ParallelPlan(MeshSpec(tp=2)).use(TP(plan=qwen3_plan_without_q_norm))"
         ".use(MetaInit()).validate(qwen3)"),
    Rule("CP432", Severity.ERROR,
         "a latent-attention projection without the width of its rotary part",
         "give the entry as {style = \"mla_kv_a_proj\", rope_dim = N} (N: the rotary key's "
         "width, a Hugging Face config's qk_rope_head_dim), on the projection itself",
         "ParallelPlan(MeshSpec(tp=2)).use(TP(plan={\"layers.*.attn.kv_a\": "
         "\"mla_kv_a_proj\"})).use(MetaInit()).validate(model_without_qk_rope_head_dim)"),
    Rule("CP433", Severity.ERROR, "the model's own tp plan has a style TP does not know",
         "give TP(plan={...}) explicitly with a style TP knows for those modules",
         "ParallelPlan(MeshSpec(tp=2)).use(TP()).use(MetaInit())"
         ".validate(model_whose_tp_plan_says_{'layers.*.mlp.up_proj': 'fancy_new_style'})"),
    Rule("CP431", Severity.ERROR,
         "the name fallback cannot give a split attention its local head counts",
         "give TP(plan={...}) explicitly with that attention left out, or use a model whose "
         "attention reshapes by -1 or by its own head-count attributes",
         "ParallelPlan(MeshSpec(tp=2)).use(TP()).use(MetaInit())"
         ".validate(stablelm_with_qk_layernorm)"),
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
            parts = (spec.split_factor or 2) if spec.style in PACKED_STYLES else 1
            if getattr(module, feature) % (tp_size * parts):
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
    tp_size: int, params: list[tuple[str, Any, str, StyleSpec]] | None = None,
) -> list[Finding]:
    """CP407: the tp size must divide the head and KV-head counts of the attention it
    splits; else each rank holds a fraction of a head and forward fails in a reshape.
    Only styles whose output stays split count: a gathered projection (Phi-3's fused
    qkv_proj, colwise_gather) hands every rank all heads."""
    attention = [
        path for path, _, spec in entries
        if spec.style in SHARDED_OUTPUT_STYLES
        and (path.rsplit(".", 1)[-1] in _QKV_LEAVES
             or any(h in part for part in path.split(".")[:-1] for h in _ATTENTION_HINTS))
    ]
    del params  # expert weights split features, not heads
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


def rest_findings(modules: Mapping[str, Any], rest: list[tuple[str, Any]],
                  entries: list[tuple[str, Any, StyleSpec]] | None = None) -> list[Finding]:
    """CP409: a module whose own parameters no style covers, with sub-modules owning
    parameters, and a column-split projection somewhere below it (its attention, say):
    its own parameters may act on activations sharded over tp, or on replicated ones, and
    nothing tells which. Without a split below, everything in it computes the same on
    every tp rank and replicate_rest replicates it (its forward runs on the local values
    of its own parameters; its children keep their own styles)."""
    split = [path for path, _, spec in entries or () if spec.style in SHARDED_OUTPUT_STYLES]
    found = []
    for name, module in rest:
        children = [n for n, m in module.named_modules() if n and any(
            True for _ in m.parameters(recurse=False))]
        below = [p for p in split if not name or p.startswith(name + ".")]
        if children and below:
            found.append(fit_finding(
                f"{name or '<root>'} ({_type_name(module)}) owns parameters that no style "
                f"makes DTensors and holds column-split projections ({below[0]}): its own "
                "parameters may act on activations sharded over tp (their gradient then "
                "needs a sum over tp) or on replicated ones, and TP cannot tell which",
                f"map {name or 'that module'} to a style ('replicate_grad_allreduce' if its "
                "parameters act on the split projections' outputs), or set replicate_rest = "
                "false (then use a for-loop optimizer: foreach/fused optimizers and "
                "clip_grad_norm_ fail on a mix of Tensor and DTensor parameters)"))
    return found


def placement_of(style: str | None, module: Any, attr: str, ndim: int,
                 split_factor: int | None = None) -> str:
    """How a style lays out one of the module's own parameters, as text ("shard(0)",
    "replicate", "strided(0,2)", "plain"): tied owners must agree on it."""
    import torch.nn as nn

    if style is None:
        return "plain"
    bias = attr == "bias" or ndim == 1
    if style in ("colwise", "colwise_gather", "local_colwise"):
        return "shard(0)"
    if style in ("rowwise", "local_rowwise"):
        return "replicate" if bias else "shard(1)"
    if style == "embedding_rowwise" or (style == "embedding_colwise" and not isinstance(
            module, nn.Embedding)):
        return "shard(0)"
    if style == "embedding_colwise":
        return "shard(1)"
    if style in PACKED_STYLES:
        factor = split_factor or 2
        if style == "packed_colwise":
            return f"strided(0,{factor})"
        return "replicate" if bias else f"strided(1,{factor})"
    if style in PARAM_STYLES or style in LOCAL_FORWARD_STYLES or style == "replicate":
        return "replicate"
    return "plain"


def _parameter_placement(style: str, ndim: int, split_factor: int | None) -> str:
    back = PARAMETER_STYLES.get(style)
    if back is None:
        return "replicate"
    if ndim == 1:
        return "replicate" if back == -1 else "shard(0)"
    dim = ndim + back
    if style in PACKED_STYLES:
        return f"strided({dim},{split_factor or 2})"
    return f"shard({dim})"


def tie_findings(
    model: nn.Module, entries: list[tuple[str, Any, StyleSpec]],
    params: list[tuple[str, Any, str, StyleSpec]], rest: list[tuple[str, Any]],
    replicate_rest: bool,
) -> tuple[list[Finding], list[list[tuple[Any, str]]]]:
    """CP409 for a parameter shared by several modules (a token embedding tied to the
    output head) that their styles would lay out differently: one tensor cannot be split
    two ways, and each style replacing it in its own module would untie them silently.
    Ties whose owners agree (Gemma's embedding_rowwise and colwise_gather both split the
    vocabulary, tensor dim 0) are returned, to be made one parameter again after apply."""
    by_module = {id(m): (path, spec) for path, m, spec in entries}
    by_param = {(id(owner), attr): spec for _, owner, attr, spec in params}
    rest_ids = {id(m) for _, m in rest}
    found, ties = [], []
    for group in tied_registrations(model):
        layouts = []
        for full, module, attr in group:
            name = full.rpartition(".")[0]  # the module's path, as TP's entries name it
            param: Any = module._parameters[attr]
            spec = by_param.get((id(module), attr))
            style: str | None
            if spec is not None:
                layout = _parameter_placement(spec.style, param.ndim, spec.split_factor)
                style = spec.style
            else:
                entry = by_module.get(id(module))
                style = entry[1].style if entry else None
                if entry is None and id(module) in rest_ids and replicate_rest:
                    style = "replicate"
                layout = placement_of(style, module, attr, param.ndim,
                                      entry[1].split_factor if entry else None)
            layouts.append((name, attr, style, layout))
        if len({layout for *_, layout in layouts}) == 1:
            if any(style is not None for _, _, style, _ in layouts):
                ties.append([(module, attr) for _, module, attr in group])
            continue
        (a, a_attr, a_style, a_layout), *others = layouts
        b, b_attr, b_style, b_layout = next(x for x in others if x[3] != a_layout)
        found.append(fit_finding(
            f"{a}.{a_attr} is tied to {b}.{b_attr} (one parameter in two modules); "
            f"{_style_text(a_style)} lays it out as {a_layout} in {a or '<root>'} and "
            f"{_style_text(b_style)} as {b_layout} in {b or '<root>'}: one tensor cannot be "
            "both, and each style replacing it in its own module would untie them",
            f"give both modules styles that split it the same way (a token embedding tied "
            f"to the output head: 'embedding_rowwise' and 'colwise_gather' both split the "
            f"vocabulary), or leave both {a} and {b} out of the plan (replicated, still "
            "one parameter), or untie the weights"))
    return found, ties


def _style_text(style: str | None) -> str:
    return "no style (a plain tensor)" if style is None else repr(style)


def fallback_findings(fallbacks: tuple[Fallback, ...], source: str) -> list[Finding]:
    """CP420: entries of the auto plan TP does not honour; the modules they name (with
    everything below them) keep their weights whole, and the rest of the plan applies."""
    found = []
    for fb in fallbacks:
        names = ", ".join(dict.fromkeys(generalize(m) for m in fb.modules))
        kind = (f"the model's {source} gives {fb.pattern!r} the style {fb.style!r}"
                if source == "Hugging Face tp plan" else f"{fb.pattern}")
        found.append(Finding(
            "CP420",
            f"{kind}, which TP does not honour: {fb.why}. TP falls back for {names}: "
            "its weights (and those of everything below it) stay whole, replicated on "
            "every tp rank, and the rest of the plan is applied",
            fix=f"accept it (more memory per rank for {names}), or give TP(plan={{...}}) "
            "explicitly with styles for those modules (docs/tp.md)"))
    return found


def refused_style_findings(refused: Any) -> list[Finding]:
    """CP433: entries of the model's own tp plan with a style TP does not know: left
    whole beside what the plan splits, their modules could train on partial gradients."""
    return [Finding(
        "CP433",
        f"the model's Hugging Face tp plan gives {fb.pattern!r} the style {fb.style!r}, "
        f"which TP does not know ({fb.why}): left whole beside what the plan splits, "
        f"{', '.join(dict.fromkeys(generalize(m) for m in fb.modules))} could compute on "
        "split heads and get only this rank's part of its gradient",
        fix="give TP(plan={...}) explicitly with a style TP knows for those modules "
        "(docs/tp.md), or upgrade composer_par")
        for fb in refused]


def latent_findings(entries: list[tuple[str, Any, StyleSpec]]) -> list[Finding]:
    """CP432: ``mla_kv_a_proj`` entries that do not say (and whose model's config does
    not say) how wide the rotary part of the projection's output is, or that name
    something other than a Linear wider than it."""
    import torch.nn as nn

    found = []
    seen: set[str] = set()
    for path, module, spec in entries:
        if spec.style != "mla_kv_a_proj" or generalize(path) in seen:
            continue
        seen.add(generalize(path))
        path = generalize(path)
        if spec.rope_dim is None:
            found.append(Finding(
                "CP432", f"{path} takes 'mla_kv_a_proj', which sums the gradient of the "
                "rotary part of its output over tp, and neither the entry (rope_dim) nor the "
                "model's config (qk_rope_head_dim) says how many output features that is",
                fix="give the entry as {style = \"mla_kv_a_proj\", rope_dim = N}, N the "
                "rotary key's width"))
        elif not isinstance(module, nn.Linear) or module.out_features <= spec.rope_dim:
            what = (f"an nn.Linear with {module.out_features} output features"
                    if isinstance(module, nn.Linear) else f"a {_type_name(module)}")
            found.append(Finding(
                "CP432", f"{path} takes 'mla_kv_a_proj' with rope_dim {spec.rope_dim}, and "
                f"it is {what}: the style splits a Linear's output into a latent and a "
                "rotary part",
                fix="map the latent-attention projection itself (kv_a_proj_with_mqa), with "
                "the rotary key's width as rope_dim"))
    return found


def sharded_neighbour_findings(moved: list[tuple[str, Any]]) -> list[Finding]:
    """CP421 (info): modules beside column-split projections that no entry names run on
    their rank's part of a sharded activation; their gradients are summed over tp."""
    if not moved:
        return []
    paths = [p for p, _ in moved]
    shown = list(dict.fromkeys(generalize(p) for p in paths))
    return [Finding(
        "CP421",
        f"{', '.join(shown)} ({_type_name(moved[0][1])}) sit beside column-split "
        "projections in the same module, so they run on their rank's part of a sharded "
        "activation (a per-head norm sees this rank's heads): their inputs differ across tp "
        "ranks, so their weights are replicated with gradients summed over tp "
        "('replicate_grad_allreduce'), not declared identical",
        fix="nothing to do if they run on the projections' output; if they run on the "
        "replicated input instead, map them to \"replicate\" yourself")]


def parameter_findings(params: list[tuple[str, Any, str, StyleSpec]],
                       entries: list[tuple[str, Any, StyleSpec]], tp_size: int
                       ) -> list[Finding]:
    """CP409 / CP406 for entries that name parameters (MoE expert weights): the style must
    split a parameter, its owner's forward must run on local parts ('experts' or 'local'
    on the owner), and the tp size must divide the split tensor dim."""
    styles = {id(m): spec.style for _, m, spec in entries}
    misfit: dict[tuple[str, str], list[str]] = defaultdict(list)
    uneven: dict[tuple[str, int, int], list[str]] = defaultdict(list)
    for path, owner, attr, spec in params:
        param = owner._parameters[attr]
        if spec.style not in PARAMETER_STYLES:
            misfit[(f"{{path}} is a parameter; {spec.style!r} acts on modules",
                    f"use one of {sorted(PARAMETER_STYLES)} for parameters")].append(path)
            continue
        own = styles.get(id(owner))
        if spec.style != "replicate" and own not in LOCAL_FORWARD_STYLES:
            misfit[(f"{{path}} ({spec.style}) splits a parameter of a module whose forward "
                    "would then mix it with whole tensors",
                    "map its module to 'experts' (a mixture-of-experts module) or 'local' "
                    "as well")].append(path)
            continue
        back = PARAMETER_STYLES[spec.style]
        if back is None or param.ndim < 2:
            continue
        dim = param.ndim + back
        parts = (spec.split_factor or 2) if spec.style in PACKED_STYLES else 1
        if param.shape[dim] % (tp_size * parts):
            uneven[(spec.style, dim, int(param.shape[dim]))].append(path)
    found = [fit_finding(message.format(path=paths[0]) + _more(paths), fix)
             for (message, fix), paths in misfit.items()]
    for (style, dim, size), paths in uneven.items():
        found.append(Finding(
            "CP406",
            f"{paths[0]}{_more(paths)}: {style!r} splits tensor dim {dim} (size {size}) over "
            f"tp({tp_size}), and {size} is not divisible by {tp_size}"
            + (" times the packed parts" if style in PACKED_STYLES else ""),
            fix=f"use a tp size that divides {size} (e.g. {_divisor_below(size, tp_size)}), "
            "or change the model's width"))
    return found
