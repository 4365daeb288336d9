"""The TP styles: what each does, the arguments each takes, and one plan entry parsed and
checked (:class:`StyleSpec`). Torch-free: the static checks (CP212, CP213) run on it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from composer_par.plugin import did_you_mean

#: Style name -> what it does (for docs, describe() and error messages).
STYLES: dict[str, str] = {
    "colwise": "Linear split on out_features; input replicated, output sharded on the "
    "last tensor dim (kept local)",
    "rowwise": "Linear split on in_features; input sharded on the last tensor dim, "
    "output all-reduced (replicated)",
    "colwise_gather": "colwise with the output gathered (replicated): an output head",
    "embedding_rowwise": "Embedding split on num_embeddings (the vocabulary); output "
    "all-reduced",
    "embedding_colwise": "Embedding split on embedding_dim; output gathered",
    "sequence_parallel": "a norm/dropout run on sequence-sharded input, parameters "
    "replicated",
    "prepare_input": "redistribute a module's inputs (input_layouts -> "
    "desired_input_layouts); parameters untouched",
    "prepare_output": "redistribute a module's outputs (output_layouts -> "
    "desired_output_layouts); parameters untouched",
    "replicate": "parameters replicated as DTensors over tp; inputs and outputs local",
    "packed_colwise": "a fused Linear (or a fused 3-D expert weight) stacking split_factor "
    "projections on its output features (gate and up): each projection split colwise, so "
    "each rank holds its slice of each; computed on local tensors, output local",
    "packed_rowwise": "a weight stacking split_factor parts on its input features: each "
    "split rowwise (on a parameter)",
    "replicate_grad_allreduce": "parameters replicated as DTensors; the module runs on its "
    "rank's part of a tp-sharded activation (a per-head norm between colwise and rowwise "
    "layers), so their gradients are summed over tp",
    "experts": "a mixture-of-experts module whose weights its parameter entries split: runs "
    "on the local parts; output summed over tp, input gradients summed over tp",
    "identity_expert": "input divided by the tp size (an identity expert whose output an "
    "'experts' sum would add tp times)",
    "local": "the module runs on the local parts of its parameters (split by parameter "
    "entries); inputs and outputs untouched",
    "all_reduce": "output summed over tp (a module whose children computed partial sums)",
    "local_colwise": "colwise weights, computed on local tensors: input gradients summed "
    "over tp, output this rank's columns (no DTensor)",
    "local_rowwise": "rowwise weights, computed on local tensors: output a partial sum that "
    "an enclosing 'all_reduce' sums",
    "local_packed_rowwise": "packed_rowwise weights, computed on local tensors: output a "
    "partial sum that an enclosing 'all_reduce' sums",
    "sequence_region": "a module on the sequence-sharded residual stream whose children the "
    "plan splits: its first input is gathered once (kept a DTensor, so its children do not "
    "gather again) and a plain first output is sharded back onto the sequence",
    "sequence_region_local": "sequence_region for a module that also computes on plain "
    "tensors (a mixture-of-experts block: its router, experts, shared expert): its first "
    "input is gathered once and handed on as a plain replicated tensor, its layers compute "
    "as without sequence parallel, and a plain first output is sharded back onto the "
    "sequence",
    "shared_input": "a module whose column-parallel children take the same replicated "
    "input: that input becomes one replicated DTensor, so their partial input gradients add "
    "up and are summed over tp once, not once per child",
    "mla_kv_a_proj": "a latent-attention projection (DeepSeek's kv_a_proj_with_mqa) beside "
    "split heads: weights replicated, computed on local tensors; its last rope_dim output "
    "features (the rotary key every head shares, which skips the split kv_b_proj) get their "
    "gradient summed over tp, since each rank's heads give only their part of it",
}

#: Styles that split a Linear / an Embedding, and which feature each splits.
LINEAR_STYLES = {"colwise": "out_features", "colwise_gather": "out_features",
                 "rowwise": "in_features", "packed_colwise": "out_features",
                 "local_colwise": "out_features", "local_rowwise": "in_features",
                 "local_packed_rowwise": "in_features"}
EMBEDDING_STYLES = {"embedding_rowwise": "num_embeddings", "embedding_colwise": "embedding_dim"}
#: Styles that turn every parameter of the module into a DTensor.
PARAM_STYLES = {*LINEAR_STYLES, *EMBEDDING_STYLES, "sequence_parallel", "replicate",
                "replicate_grad_allreduce", "mla_kv_a_proj"}
#: Styles a plan may give a parameter (``experts.gate_up_proj``), and the tensor dim each
#: splits, counted from the end (None: replicated).
PARAMETER_STYLES: dict[str, int | None] = {
    "colwise": -2, "local_colwise": -2, "packed_colwise": -2,
    "rowwise": -1, "local_rowwise": -1, "packed_rowwise": -1, "local_packed_rowwise": -1,
    "replicate": None,
}
#: Module styles whose forward runs on the local parts of the module's parameters: the
#: parameter entries under such a module split its weights.
LOCAL_FORWARD_STYLES = {"experts", "local"}
#: Styles whose output is this rank's columns, kept local: what a module beside them in
#: the same parent receives from them is sharded over tp (a per-head norm).
SHARDED_OUTPUT_STYLES = {"colwise", "packed_colwise", "local_colwise"}
#: Styles with a split_factor (projections packed in one weight).
PACKED_STYLES = {"packed_colwise", "packed_rowwise", "local_packed_rowwise"}

#: Hugging Face style names (``_tp_plan`` / ``base_model_tp_plan``) -> ours. Rowwise and
#: colwise entries on an ``nn.Embedding`` become the embedding styles.
HF_STYLES: dict[str, dict[str, Any]] = {
    "colwise": {"style": "colwise"},
    "rowwise": {"style": "rowwise"},
    "colwise_rep": {"style": "colwise_gather"},
    "colwise_gather_output": {"style": "colwise_gather"},
    # Rowwise with a replicated (not yet split) input: the module splits it itself.
    "rowwise_rep": {"style": "rowwise", "input_layouts": "replicate"},
    "rowwise_split_input": {"style": "rowwise", "input_layouts": "replicate"},
    "embedding_rowwise": {"style": "embedding_rowwise"},
    "embedding_colwise": {"style": "embedding_colwise"},
    "packed_colwise": {"style": "packed_colwise"},
    "packed_rowwise": {"style": "packed_rowwise"},
    "sequence_parallel": {"style": "sequence_parallel"},
    "replicate": {"style": "replicate"},
    "replicated_with_grad_allreduce": {"style": "replicate_grad_allreduce"},
    "moe_tp_experts": {"style": "experts"},
    "moe_identity_expert": {"style": "identity_expert"},
    "local_params": {"style": "local"},
    "local": {"style": "local"},
    "all_reduce": {"style": "all_reduce"},
    "gather": {"style": "all_reduce"},
    "local_colwise": {"style": "local_colwise"},
    "local_rowwise": {"style": "local_rowwise"},
    "local_packed_rowwise": {"style": "local_packed_rowwise"},
    # The rotary part's width is read from the model's config (qk_rope_head_dim).
    "mla_kv_a_proj": {"style": "mla_kv_a_proj"},
}

#: Hugging Face styles TP does not honour, and why: expert-parallel styles, whose modules
#: computed whole on every tp rank train as one process does; the plan falls back for the
#: modules they name (CP420). A style in neither table is refused (CP433).
HF_UNSUPPORTED: dict[str, str] = {
    "ep_router": "an expert-parallel style (the model's _ep_plan), not tensor parallel",
    "ep_dispatch_experts": "an expert-parallel style (the model's _ep_plan), not tensor "
    "parallel",
    "grouped_gemm": "an expert-parallel style (the model's _ep_plan), not tensor parallel",
}

#: Keys a table entry may give, per style (``style`` itself always).
_SINGLE = ("input_layouts", "output_layouts", "use_local_output")
STYLE_KEYS: dict[str, tuple[str, ...]] = {
    "colwise": _SINGLE, "rowwise": _SINGLE, "colwise_gather": _SINGLE,
    "embedding_rowwise": _SINGLE, "embedding_colwise": _SINGLE,
    "sequence_parallel": ("sequence_dim", "use_local_output"),
    "prepare_input": ("input_layouts", "desired_input_layouts", "input_kwarg_layouts",
                      "desired_input_kwarg_layouts", "use_local_output"),
    "prepare_output": ("output_layouts", "desired_output_layouts", "use_local_output"),
    "replicate": (),
    "packed_colwise": ("split_factor",),
    "packed_rowwise": ("split_factor",),
    "local_packed_rowwise": ("split_factor",),
    "replicate_grad_allreduce": (),
    "experts": (),
    "identity_expert": (),
    "local": (),
    "all_reduce": (),
    "local_colwise": (),
    "local_rowwise": (),
    "sequence_region": (),
    "sequence_region_local": (),
    "shared_input": (),
    "mla_kv_a_proj": ("rope_dim",),
}
ALL_KEYS = ("style", *sorted({k for keys in STYLE_KEYS.values() for k in keys}))

#: A shard layout, ``shard(N)``: group 1 is the tensor dim N.
SHARD_LAYOUT = re.compile(r"shard\((-?\d+)\)")


def parse_layout(text: Any, *, allow_none: bool = False) -> str | None:
    """``"replicate"`` / ``"shard(1)"`` (torch's ``Replicate()``/``Shard(1)`` spellings
    too) in canonical form; ``"none"`` (a non-tensor argument) where allowed."""
    if not isinstance(text, str):
        raise ValueError(f"a layout is a string like \"shard(1)\" or \"replicate\"; got {text!r}")
    word = text.strip().lower().replace(" ", "").replace("dim=", "")
    if word in ("replicate", "replicate()"):
        return "replicate"
    if word in ("none", "") and allow_none:
        return None
    match = SHARD_LAYOUT.fullmatch(word)
    if match:
        return f"shard({int(match.group(1))})"
    allowed = '"replicate", "shard(N)"' + (', "none"' if allow_none else "")
    raise ValueError(f"layout {text!r} is not one of {allowed}")


def _layouts(value: Any, *, many: bool) -> tuple[str | None, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"expected a layout or a list of layouts; got {value!r}")
    if not many and len(value) != 1:
        raise ValueError(f"this style takes one layout; got {list(value)}")
    return tuple(parse_layout(v, allow_none=many) for v in value)


@attrs.frozen
class StyleSpec:
    """One plan entry, parsed and checked. Layouts are canonical strings (None: a
    non-tensor argument); fields left None take the style's defaults at apply time."""

    style: str
    input_layouts: tuple[str | None, ...] | None = None
    output_layouts: tuple[str | None, ...] | None = None
    desired_input_layouts: tuple[str | None, ...] | None = None
    desired_output_layouts: tuple[str | None, ...] | None = None
    input_kwarg_layouts: tuple[tuple[str, str | None], ...] | None = None
    desired_input_kwarg_layouts: tuple[tuple[str, str | None], ...] | None = None
    use_local_output: bool | None = None
    sequence_dim: int | None = None
    split_factor: int | None = None
    rope_dim: int | None = None

    @classmethod
    def parse(cls, value: Any) -> StyleSpec:
        """From a plan value: a style name or a table ``{style = ..., <arguments>}``.
        Raises UnknownStyle (CP212) or ValueError (CP213) naming the problem."""
        table = {"style": value} if isinstance(value, str) else dict(value)
        style = table.get("style")
        if not isinstance(style, str):
            raise ValueError(f"a table entry needs style = \"<name>\"; got {value!r}")
        if style not in STYLES:
            raise UnknownStyle(style)
        allowed = STYLE_KEYS[style]
        problems = []
        for key in table:
            if key == "style" or key in allowed:
                continue
            if key in ALL_KEYS:
                problems.append(f"{style!r} takes no {key!r} (it takes {list(allowed) or 'none'})")
            else:
                problems.append(f"unknown key {key!r}{did_you_mean(key, ('style', *allowed))}")
        kwargs: dict[str, Any] = {}
        many = style in ("prepare_input", "prepare_output")
        for key in ("input_layouts", "output_layouts", "desired_input_layouts",
                    "desired_output_layouts"):
            if key in table and key in allowed:
                try:
                    kwargs[key] = _layouts(table[key], many=many)
                except ValueError as exc:
                    problems.append(f"{key}: {exc}")
        for key in ("input_kwarg_layouts", "desired_input_kwarg_layouts"):
            if key in table and key in allowed:
                raw = table[key]
                if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
                    problems.append(f"{key} must be a table of argument name = layout")
                    continue
                try:
                    kwargs[key] = tuple(
                        (k, parse_layout(v, allow_none=True)) for k, v in sorted(raw.items())
                    )
                except ValueError as exc:
                    problems.append(f"{key}: {exc}")
        if "use_local_output" in table and "use_local_output" in allowed:
            if not isinstance(table["use_local_output"], bool):
                problems.append(f"use_local_output must be true or false; got "
                                f"{table['use_local_output']!r}")
            else:
                kwargs["use_local_output"] = table["use_local_output"]
        if "sequence_dim" in table and "sequence_dim" in allowed:
            dim = table["sequence_dim"]
            if isinstance(dim, bool) or not isinstance(dim, int):
                problems.append(f"sequence_dim must be an int; got {dim!r}")
            else:
                kwargs["sequence_dim"] = dim
        if "split_factor" in table and "split_factor" in allowed:
            factor = table["split_factor"]
            if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
                problems.append(f"split_factor must be an int >= 2 (the number of "
                                f"projections packed in the weight); got {factor!r}")
            else:
                kwargs["split_factor"] = factor
        if "rope_dim" in table and "rope_dim" in allowed:
            width = table["rope_dim"]
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                problems.append(f"rope_dim must be a positive int (the output features of "
                                f"the rotary part); got {width!r}")
            else:
                kwargs["rope_dim"] = width
        problems += _pairing_problems(style, kwargs)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(style, **kwargs)

    def with_defaults(self, **defaults: Any) -> StyleSpec:
        """Fill the fields this entry left unset (explicit arguments always win)."""
        unset = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return attrs.evolve(self, **unset) if unset else self

    def describe(self) -> str:
        extra = [f"{f.name}={_show(getattr(self, f.name))}" for f in attrs.fields(StyleSpec)
                 if f.name != "style" and getattr(self, f.name) is not None]
        return self.style + (f"({', '.join(extra)})" if extra else "")


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return "none" if value is None else str(value)


def _pairing_problems(style: str, kwargs: dict[str, Any]) -> list[str]:
    problems = []
    for have, want in (("input_layouts", "desired_input_layouts"),
                       ("output_layouts", "desired_output_layouts"),
                       ("input_kwarg_layouts", "desired_input_kwarg_layouts")):
        if want not in STYLE_KEYS[style]:
            continue
        a, b = kwargs.get(have), kwargs.get(want)
        if (a is None) != (b is None):
            problems.append(f"{style!r} needs both {have} and {want}")
        elif a is not None and b is not None and len(a) != len(b):
            problems.append(f"{have} has {len(a)} layouts but {want} has {len(b)}")
        elif (have == "input_kwarg_layouts" and a is not None and b is not None
              and [k for k, _ in a] != [k for k, _ in b]):
            problems.append(f"{have} and {want} name different arguments")
    if style == "prepare_input" and kwargs.get("input_layouts") is None and kwargs.get(
        "input_kwarg_layouts"
    ) is None:
        problems.append("'prepare_input' needs input_layouts (one per positional argument, "
                        "\"none\" for non-tensors) and desired_input_layouts")
    if style == "prepare_output" and kwargs.get("output_layouts") is None:
        problems.append("'prepare_output' needs output_layouts and desired_output_layouts")
    return problems


class UnknownStyle(ValueError):
    def __init__(self, style: str, hf: bool = False) -> None:
        self.style = style
        names = list(STYLES) + (list(HF_STYLES) if hf else [])
        super().__init__(f"unknown TP style {style!r}{did_you_mean(style, names)}")
