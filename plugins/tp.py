"""TP: tensor (and sequence) parallelism with ``parallelize_module`` over the tp mesh dim.

The plan is a declarative map from module-path patterns to styles (torchtitan's habit):

    TP(plan={"layers.*.attention.wq": "colwise", "layers.*.attention.wo": "rowwise"})

Patterns are globs matched component by component against the model's own module names
(``*`` stands for one path component, as in ``parallelize_module``), so ``layers.*.wq``
matches ``layers.3.wq`` but not ``layers.3.attention.wq``. ``plan="auto"`` takes a
Hugging Face model's ``base_model_tp_plan`` / ``_tp_plan`` when it has one, and else
recognizes Llama (torchtitan and Hugging Face naming) and GPT naming.

Every check that can fail runs before the model is touched: the static ones
(CP212-CP214) on the plan alone, the model-aware ones (CP406-CP409) at ``validate(model)``
and at the start of ``apply``. After the plan's styles, the parameters that no style made
a DTensor (norms without sequence parallel) are replicated as DTensors over the tp mesh,
so that foreach/fused optimizers and ``clip_grad_norm_`` never see a mix of Tensor and
DTensor parameters (``replicate_rest``; see docs/tp.md, "Traps").

This module imports torch only inside functions: the static path must not.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par import blocks
from composer_par.blocks import clean_name
from composer_par.plugin import Claim, Plugin, Role, hookimpl, ordering_option
from composer_par.validate import Finding, did_you_mean

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from composer_par.apply_context import ApplyContext
    from composer_par.mesh import MeshSpec
    from composer_par.plan import ParallelPlan

# -- styles ------------------------------------------------------------------------------

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
}

#: Styles that split a Linear / an Embedding, and which feature each splits.
LINEAR_STYLES = {"colwise": "out_features", "colwise_gather": "out_features",
                 "rowwise": "in_features"}
EMBEDDING_STYLES = {"embedding_rowwise": "num_embeddings", "embedding_colwise": "embedding_dim"}
#: Styles that turn every parameter of the module into a DTensor.
PARAM_STYLES = {*LINEAR_STYLES, *EMBEDDING_STYLES, "sequence_parallel", "replicate"}

#: Hugging Face style names (``base_model_tp_plan`` / ``_tp_plan``) -> ours. Rowwise and
#: colwise entries on an ``nn.Embedding`` become the embedding styles.
HF_STYLES: dict[str, dict[str, Any]] = {
    "colwise": {"style": "colwise"},
    "rowwise": {"style": "rowwise"},
    "colwise_rep": {"style": "colwise_gather"},
    "colwise_gather_output": {"style": "colwise_gather"},
    # Rowwise with a replicated (not yet split) input: the module splits it itself.
    "rowwise_rep": {"style": "rowwise", "input_layouts": "replicate"},
    "rowwise_split_input": {"style": "rowwise", "input_layouts": "replicate"},
    "sequence_parallel": {"style": "sequence_parallel"},
    "replicate": {"style": "replicate"},
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
}
ALL_KEYS = ("style", *sorted({k for keys in STYLE_KEYS.values() for k in keys}))

_SHARD = re.compile(r"shard\((-?\d+)\)")


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
    match = _SHARD.fullmatch(word)
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


# -- the plan option -----------------------------------------------------------------------


class PlanMap(Mapping[str, Any]):
    """The ``plan`` option: pattern -> style name or table, as a plan file writes it.

    Immutable and hashable (the plugin is a frozen attrs object); equal to a dict with the
    same entries, so plan files round-trip.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(json.dumps(self._items, sort_keys=True, default=str))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"{self._items!r}"


def _plan(value: Any) -> str | PlanMap:
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        raise ValueError(
            f"plan must be \"auto\" or a table of module pattern = style; got {value!r}")
    if not isinstance(value, Mapping):
        raise TypeError(f"plan must be \"auto\" or a table of module pattern = style; got "
                        f"{type(value).__name__}")
    items: dict[str, Any] = {}
    for key, style in value.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"plan keys are module path patterns (strings); got {key!r}")
        if isinstance(style, Mapping):
            items[key] = {str(k): _plain_value(v) for k, v in style.items()}
        elif isinstance(style, str):
            items[key] = style
        else:
            raise TypeError(f"plan[{key!r}] must be a style name or a table with style = ...; "
                            f"got {style!r}")
    if not items:
        raise ValueError("plan is empty: give at least one pattern = style, or \"auto\"")
    return PlanMap(items)


def _plain_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain_value(v) for k, v in value.items()}
    return value


def _identifier(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"{attribute.name} must be a mesh dim name; got {value!r}")


def _bool(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be true or false; got {value!r}")


# -- the plugin ----------------------------------------------------------------------------


@attrs.frozen
class TP(Plugin):
    """Tensor parallelism over one mesh dim (``parallelize_module``).

    Options: ``dim`` (default ``tp``); ``plan`` (``"auto"`` or a table of module-path
    pattern -> style, see :data:`STYLES`); ``sequence_parallel`` (shard norms and the
    residual stream on the sequence tensor dim); ``loss_parallel`` (keep the output head's
    logits sharded on the vocabulary; compute the loss under :func:`loss_parallel`);
    ``replicate_rest`` (make the parameters no style touched replicated DTensors, so every
    parameter is a DTensor; default true); ``after`` / ``before``.
    """

    name: ClassVar[str] = "tp"

    dim: str = attrs.field(default="tp", validator=_identifier)
    plan: str | PlanMap = attrs.field(default="auto", converter=_plan)
    sequence_parallel: bool = attrs.field(default=False, validator=_bool)
    loss_parallel: bool = attrs.field(default=False, validator=_bool)
    replicate_rest: bool = attrs.field(default=True, validator=_bool)
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    def claims(self) -> tuple[Claim, ...]:
        return (Claim(self.dim, Role.MODEL_PARALLEL),)

    # -- static validation -----------------------------------------------------------

    def entries(self) -> tuple[list[tuple[str, StyleSpec]], list[Finding]]:
        """The explicit plan parsed: ``(pattern, spec)`` pairs, and CP212/CP213 findings."""
        if not isinstance(self.plan, PlanMap):
            return [], []
        parsed, found = [], []
        for pattern, value in self.plan.items():
            try:
                parsed.append((pattern, StyleSpec.parse(value)))
            except UnknownStyle as exc:
                found.append(Finding(
                    "CP212", f"plan[{pattern!r}]: {exc}",
                    fix=f"use one of {list(STYLES)}",
                ))
            except ValueError as exc:
                found.append(Finding(
                    "CP213", f"plan[{pattern!r}]: {exc}",
                    fix="see docs/tp.md for each style's arguments, e.g. "
                    "{style = \"prepare_input\", input_layouts = [\"shard(1)\", \"none\"], "
                    "desired_input_layouts = [\"replicate\", \"none\"]}",
                ))
        return parsed, found

    @hookimpl
    def composer_par_validate_plan(self) -> list[Finding]:
        parsed, found = self.entries()
        if not isinstance(self.plan, PlanMap) or len(parsed) != len(self.plan):
            return found
        found += option_conflicts(parsed, self.sequence_parallel, self.loss_parallel)
        return found

    @hookimpl
    def composer_par_describe(self, plan: ParallelPlan) -> list[tuple[str, str]]:
        size = plan.mesh.size(self.dim) if self.dim in plan.mesh else "?"
        if isinstance(self.plan, PlanMap):
            counts = Counter(
                v if isinstance(v, str) else str(v.get("style")) for v in self.plan.values()
            )
            what = "plan " + ", ".join(f"{n} {s}" for s, n in counts.items())
        else:
            what = "the auto plan (the model's Hugging Face tp plan, else Llama/GPT names)"
        extras = [w for w, on in (("sequence parallel", self.sequence_parallel),
                                  ("loss parallel", self.loss_parallel)) if on]
        text = f"parallelize_module over {self.dim}({size}) with {what}"
        if extras:
            text += "; " + " and ".join(extras)
        if self.replicate_rest:
            text += "; other parameters replicated as DTensors over " + self.dim
        return [("tensor_parallel", text)]

    # -- model-aware validation ------------------------------------------------------

    def resolve(self, model: nn.Module, tp_size: int) -> Resolution:
        """Which module gets which style (patterns expanded, defaults filled), with the
        model-aware findings. Mutates nothing."""
        return resolve(self, model, tp_size)

    @hookimpl
    def composer_par_validate_model(self, model: nn.Module, mesh: MeshSpec) -> list[Finding]:
        if self.dim not in mesh:
            return []  # CP203
        size = mesh.size(self.dim)
        if size < 1:
            return []  # not known without a world size
        return self.resolve(model, size).findings

    # -- apply -----------------------------------------------------------------------

    @hookimpl
    def composer_par_tensor_parallel(self, ctx: ApplyContext) -> str:
        size = ctx.mesh.size(self.dim)
        if size == 1:
            return f"{self.dim}(1): nothing to split"
        resolution = self.resolve(ctx.model, size)
        errors = [f for f in resolution.findings if f.severity.value == "error"]
        if errors:  # validate() ran already; the model changed since (a convert stage)
            raise RuntimeError("TP plan no longer fits the model:\n" +
                               "\n".join(f.format() for f in errors))
        mesh = ctx.submesh(self.dim)
        apply_resolution(resolution, mesh)
        replicated = replicate_rest(resolution, mesh) if self.replicate_rest else 0
        ctx.notes["tp_plan"] = [(path, spec.describe()) for path, _, spec in resolution.entries]
        counts = Counter(spec.style for _, _, spec in resolution.entries)
        text = (f"parallelize_module over {self.dim}({size}) ({resolution.source}): "
                + ", ".join(f"{n} {s}" for s, n in counts.items()))
        if self.sequence_parallel:
            text += "; sequence parallel"
        if self.loss_parallel:
            text += "; loss parallel (logits sharded on the vocabulary)"
        if replicated:
            text += f"; {replicated} other module(s) replicated over {self.dim}"
        return text


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


# -- resolution: patterns -> modules -------------------------------------------------------


@attrs.define
class Resolution:
    """A TP plan resolved against one model: what apply will do, and what is wrong."""

    entries: list[tuple[str, Any, StyleSpec]]  # (module path, module, spec) in model order
    findings: list[Finding]
    source: str  # "explicit plan", "Hugging Face tp plan", "Llama names", ...
    rest: list[tuple[str, Any]]  # modules owning parameters that no style makes DTensors


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module by clean name (the outer wrapper where wrappers share a name), root as ''."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        out.setdefault(clean_name(name), module)
    return out


def matches(pattern: str, name: str) -> bool:
    """Component-wise glob: ``layers.*.wq`` matches ``layers.0.wq`` only."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True)
    )


def resolve(tp: TP, model: nn.Module, tp_size: int) -> Resolution:
    modules = _modules(model)
    findings: list[Finding] = []
    if isinstance(tp.plan, PlanMap):
        parsed, _ = tp.entries()  # unparsable entries are CP212/CP213, static findings
        source = "explicit plan"
        for pattern, _ in parsed:
            if pattern in modules or any(matches(pattern, n) for n in modules if n):
                continue
            near = list(dict.fromkeys(_generalize(n) for n in names_near(model, modules, pattern)))
            findings.append(Finding(
                "CP408",
                f"plan pattern {pattern!r} matches no module of {type(model).__name__}"
                + (f"; nearest module names: {', '.join(near)}" if near else ""),
                fix="patterns match module paths component by component ('*' is one "
                "component, e.g. 'layers.*.attention.wq'); print [n for n, _ in "
                "model.named_modules()] to see them",
            ))
    else:
        parsed, source, problem = auto_plan(model, modules, tp.sequence_parallel,
                                            tp.loss_parallel)
        if problem:
            findings.append(Finding("CP408", problem, fix=(
                "give TP(plan={...}) explicitly: module-path patterns mapped to styles "
                "(docs/tp.md)")))
    # Expand: each module takes the first entry that matches it (plan order).
    chosen: dict[str, tuple[str, StyleSpec]] = {}
    for pattern, spec in parsed:
        for name in modules:
            if (name == pattern or (name and matches(pattern, name))):
                if name in chosen and chosen[name][1] != spec:
                    findings.append(_fit(
                        f"module {name} is matched by plan[{chosen[name][0]!r}] "
                        f"({chosen[name][1].style}) and plan[{pattern!r}] ({spec.style})",
                        "make the patterns disjoint: one style per module"))
                    continue
                chosen.setdefault(name, (pattern, spec))
    entries = []
    for name in modules:
        if name in chosen:
            pattern, spec = chosen[name]
            spec = _defaults(spec, tp.sequence_parallel, tp.loss_parallel)
            entries.append((name, modules[name], spec))
    findings += fit_findings(entries, tp_size)
    findings += head_findings(model, modules, entries, tp_size)
    rest = leftover(modules, entries)
    if tp.replicate_rest:
        findings += rest_findings(modules, rest)
    findings += tie_findings(modules, entries)
    return Resolution(entries, findings, source, rest)


def names_near(model: nn.Module, modules: Mapping[str, Any], pattern: str, n: int = 5) -> list[
    str
]:
    """Module names close to ``pattern`` (a glob: its stars are read as '0')."""
    import difflib

    close = blocks.names_near(model, pattern.replace("*", "0"), n=n)
    if not close:  # compare leaf names: a misspelled last component
        names = [m for m in modules if m]
        leaf = pattern.rsplit(".", 1)[-1]
        close = [m for m in names if difflib.get_close_matches(leaf, [m.rsplit(".", 1)[-1]],
                                                               cutoff=0.6)][:n]
    return close


def _defaults(spec: StyleSpec, sequence_parallel: bool, loss_parallel: bool) -> StyleSpec:
    """The style's layouts where the entry gave none; sequence/loss parallel change them."""
    seq = "shard(1)"
    if spec.style in ("colwise", "colwise_gather"):
        out = "replicate" if spec.style == "colwise_gather" else "shard(-1)"
        local = True
        if spec.style == "colwise_gather" and loss_parallel:
            out, local = "shard(-1)", False
        return spec.with_defaults(input_layouts=(seq if sequence_parallel else "replicate",),
                                  output_layouts=(out,), use_local_output=local)
    if spec.style == "rowwise":
        return spec.with_defaults(input_layouts=("shard(-1)",),
                                  output_layouts=(seq if sequence_parallel else "replicate",),
                                  use_local_output=True)
    if spec.style in EMBEDDING_STYLES:
        return spec.with_defaults(input_layouts=("replicate",),
                                  output_layouts=(seq if sequence_parallel else "replicate",),
                                  use_local_output=True)
    if spec.style == "sequence_parallel":
        return spec.with_defaults(sequence_dim=1, use_local_output=False)
    if spec.style == "prepare_input":
        return spec.with_defaults(use_local_output=False)
    if spec.style == "prepare_output":
        return spec.with_defaults(use_local_output=True)
    return spec


def _fit(message: str, fix: str) -> Finding:
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
                misfit[(f"{{path}} ({spec.style}) contains {_generalize(inner[0])}, which the "
                        f"plan also maps: {spec.style!r} distributes every parameter below it",
                        "use 'prepare_input'/'prepare_output' for the outer module, or drop "
                        "the inner entry")].append(path)
    found = [_fit(message.format(path=paths[0]) + _more(paths), fix)
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


def leftover(modules: Mapping[str, Any], entries: list[tuple[str, Any, StyleSpec]]) -> list[
    tuple[str, Any]
]:
    """Modules that own parameters that no style turns into DTensors, in model order."""
    covered = {path for path, _, spec in entries if spec.style in PARAM_STYLES}
    out = []
    for name, module in modules.items():
        if name in covered or any(name.startswith(c + ".") for c in covered if c):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            out.append((name, module))
    return out


def rest_findings(modules: Mapping[str, Any], rest: list[tuple[str, Any]]) -> list[Finding]:
    """CP409: replicate_rest wraps a module's inputs and outputs; that is safe only for a
    module none of whose children own parameters (a norm, an embedding, a bias holder)."""
    found = []
    for name, module in rest:
        children = [n for n, m in module.named_modules() if n and any(
            True for _ in m.parameters(recurse=False))]
        if children:
            found.append(_fit(
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
                found.append(_fit(
                    f"{path}.{pname} is tied to {others[0]} (one parameter in two modules); "
                    f"{spec.style!r} would replace it in {path} only and untie them",
                    f"leave {path} out of the plan (it is then replicated with its twin), or "
                    "untie the weights"))
    return found


# -- the auto plan --------------------------------------------------------------------------

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


def _generalize(name: str) -> str:
    """``layers.3.attention.wq`` -> ``layers.*.attention.wq``: one entry per repeated unit."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


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
            patterns.setdefault(_generalize(name), style)
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
            patterns.setdefault(_generalize(name), StyleSpec(leaves[leaf]))
            if leaves[leaf] == "colwise" and "." in name:
                parents.setdefault(_generalize(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[0])
        elif isinstance(module, nn.Embedding) and leaf in EMBEDDING_NAMES:
            patterns.setdefault(_generalize(name), StyleSpec("embedding_rowwise"))
        elif isinstance(module, nn.Linear) and leaf in OUTPUT_NAMES and name.count(".") <= 1:
            patterns.setdefault(_generalize(name), StyleSpec("colwise_gather"))
        elif sequence_parallel and _is_norm(module):
            patterns.setdefault(_generalize(name), StyleSpec("sequence_parallel"))
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


# -- apply -----------------------------------------------------------------------------------


def _placement(layout: str | None) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if layout is None:
        return None
    if layout == "replicate":
        return Replicate()
    match = _SHARD.fullmatch(layout)
    assert match, layout
    return Shard(int(match.group(1)))


def torch_style(spec: StyleSpec) -> Any:
    """The ``ParallelStyle`` for a resolved (defaults filled) spec."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    def one(layouts: tuple[str | None, ...] | None) -> Any:
        return _placement(layouts[0]) if layouts else None

    def many(layouts: tuple[str | None, ...] | None) -> Any:
        return tuple(_placement(x) for x in layouts) if layouts is not None else None

    def kw(layouts: tuple[tuple[str, str | None], ...] | None) -> Any:
        return {k: _placement(v) for k, v in layouts} if layouts is not None else None

    if spec.style in ("colwise", "colwise_gather", "embedding_colwise"):
        return ColwiseParallel(input_layouts=one(spec.input_layouts),
                               output_layouts=one(spec.output_layouts),
                               use_local_output=bool(spec.use_local_output))
    if spec.style in ("rowwise", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=one(spec.input_layouts),
                               output_layouts=one(spec.output_layouts),
                               use_local_output=bool(spec.use_local_output))
    if spec.style == "sequence_parallel":
        return SequenceParallel(sequence_dim=spec.sequence_dim or 1,
                                use_local_output=bool(spec.use_local_output))
    if spec.style == "prepare_input":
        return PrepareModuleInput(
            input_layouts=many(spec.input_layouts),
            desired_input_layouts=many(spec.desired_input_layouts),
            input_kwarg_layouts=kw(spec.input_kwarg_layouts),
            desired_input_kwarg_layouts=kw(spec.desired_input_kwarg_layouts),
            use_local_output=bool(spec.use_local_output),
        )
    if spec.style == "prepare_output":
        return PrepareModuleOutput(
            output_layouts=many(spec.output_layouts),
            desired_output_layouts=many(spec.desired_output_layouts),
            use_local_output=bool(spec.use_local_output),
        )
    if spec.style == "replicate":
        return replicate_style()
    raise AssertionError(spec.style)


def apply_resolution(resolution: Resolution, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    for _, module, spec in resolution.entries:
        parallelize_module(module, mesh, torch_style(spec))


def replicate_rest(resolution: Resolution, mesh: DeviceMesh) -> int:
    """Replicate the parameters no style touched (norms without sequence parallel) as
    DTensors over ``mesh``: every parameter is then a DTensor on one mesh, which foreach and
    fused optimizers and ``clip_grad_norm_`` need. Values and gradients are unchanged: these
    modules already computed the same values on every tp rank."""
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    # Tied parameters (one Parameter in two modules) become one DTensor in both.
    replaced: dict[int, nn.Parameter] = {}
    for _, module in resolution.rest:
        for pname, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(
                    distribute_tensor(param, mesh, [Replicate()]),
                    requires_grad=param.requires_grad)
            module.register_parameter(pname, replaced[id(param)])
    for _, module in resolution.rest:
        parallelize_module(module, mesh, replicate_style())
    return len(resolution.rest)


_REPLICATE_STYLE: Any = None


def replicate_style() -> Any:
    """A ParallelStyle (built on first use: torch is imported lazily) that replicates a
    module's own parameters over the mesh, takes local inputs as replicated DTensors and
    hands back local outputs; buffers (e.g. RoPE tables) stay plain tensors."""
    global _REPLICATE_STYLE
    if _REPLICATE_STYLE is None:
        _REPLICATE_STYLE = _make_replicate_style()
    return _REPLICATE_STYLE()


def _make_replicate_style() -> type:
    import torch
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.utils._pytree import tree_map

    class ReplicateParallel(ParallelStyle):
        def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
            for pname, param in list(module.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    continue
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank),
                    requires_grad=param.requires_grad))

        @staticmethod
        def _inputs(module: nn.Module, inputs: Any, mesh: Any) -> Any:
            def wrap(t: Any) -> Any:
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                    return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                return t
            return tree_map(wrap, inputs)

        @staticmethod
        def _outputs(module: nn.Module, outputs: Any, mesh: Any) -> Any:
            return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, outputs)

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return distribute_module(module, device_mesh, self._partition, self._inputs,
                                     self._outputs)

        def __repr__(self) -> str:
            return "ReplicateParallel()"

    return ReplicateParallel


# -- loss parallel ----------------------------------------------------------------------------


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute the loss (and call ``backward``) on vocabulary-sharded logits.

    With ``TP(loss_parallel=True)`` the output head returns a DTensor sharded on its last
    tensor dim; ``F.cross_entropy`` on it must run inside this context, and so must the
    ``backward()`` of that loss::

        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()

    Without a DTensor the context changes nothing, so the same code runs on one process.
    """
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    with torch_loss_parallel():
        yield


def local_loss(loss: Any) -> Any:
    """A loss computed under :func:`loss_parallel` is a replicated DTensor; its local value
    (the full loss on every rank) as a plain tensor, e.g. for logging or all_reduce."""
    from torch.distributed.tensor import DTensor

    return loss.to_local() if isinstance(loss, DTensor) else loss


__all__ = ["HF_STYLES", "STYLES", "TP", "PlanMap", "StyleSpec", "local_loss", "loss_parallel"]
