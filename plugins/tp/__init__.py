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

This package imports torch only inside functions: the static path must not. Its modules:
``styles`` (the style table, layouts, one entry parsed), ``plan_map`` (the ``plan``
option), ``patterns`` (module-path globs), ``auto`` (``plan="auto"``), ``resolution``
(the plan against a model), ``findings`` (what can be wrong), ``apply``
(``parallelize_module``, ``replicate_rest``) and ``loss`` (loss parallelism); the plugin
class is here.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    Claim,
    EstimateSettings,
    Finding,
    Plugin,
    Role,
    Rule,
    bool_option,
    dim_option,
    hookimpl,
    ordering_option,
)

from .apply import (
    apply_resolution,
    leave_distributed,
    replicate_rest,
    replicate_style,
    retie,
    torch_style,
)
from .auto import (
    EMBEDDING_NAMES,
    GPT_LEAVES,
    HF_LLAMA_LEAVES,
    LLAMA_LEAVES,
    OUTPUT_NAMES,
    auto_plan,
    hf_tp_plan,
)
from .findings import (
    HEAD_ATTRS,
    KV_HEAD_ATTRS,
    RULES,
    fit_findings,
    head_findings,
    option_conflicts,
    rest_findings,
    tie_findings,
)
from .heads import set_local_head_counts
from .loss import local_loss, loss_parallel
from .patterns import matches, names_near
from .plan_map import PlanMap, plan_option
from .resolution import Resolution, leftover, resolve
from .styles import (
    ALL_KEYS,
    EMBEDDING_STYLES,
    HF_STYLES,
    LINEAR_STYLES,
    PARAM_STYLES,
    STYLE_KEYS,
    STYLES,
    StyleSpec,
    UnknownStyle,
    parse_layout,
)

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import ApplyContext, MeshSpec, PlanView


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
    rules: ClassVar[tuple[Rule, ...]] = RULES

    dim: str = dim_option("tp")
    plan: str | PlanMap = attrs.field(default="auto", converter=plan_option)
    sequence_parallel: bool = bool_option(False)
    loss_parallel: bool = bool_option(False)
    replicate_rest: bool = bool_option(True)
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
    def composer_par_estimate_settings(self) -> EstimateSettings:
        return EstimateSettings(sequence_parallel=self.sequence_parallel,
                                loss_parallel=self.loss_parallel)

    @hookimpl
    def composer_par_estimate_shape(self, layout: Any, model: Any) -> Any:
        """What this plan splits of the measured model, and what it leaves whole."""
        from .held import plan_split

        return plan_split(self, layout, model)

    @hookimpl
    def composer_par_estimate(self, layout: Any, model: Any, workload: Any,
                              stage: Any) -> Any:
        from .estimate import estimate_part

        return estimate_part(self, layout, model, workload, stage)

    @hookimpl
    def composer_par_suggest(self, model: Any, topology: Any) -> Any:
        from .suggest import suggest_axes

        return suggest_axes(self, model, topology)

    @hookimpl
    def composer_par_describe(self, plan: PlanView) -> list[tuple[str, str]]:
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

    def resolve(self, model: nn.Module, tp_size: int, *, starts: bool = True,
                ends: bool = True) -> Resolution:
        """Which module gets which style (patterns expanded, defaults filled), with the
        model-aware findings. Mutates nothing. ``starts``/``ends``: ``model`` begins /
        ends the whole model (a pipeline stage may do neither)."""
        return resolve(self, model, tp_size, starts=starts, ends=ends)

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
        # A pipeline stage may lack the model's start (embedding) or end (norm, head).
        stage, last = None, None
        if ctx.pipeline is not None:
            stage = next((p.stage for p in ctx.pipeline.parts if p.module is ctx.model), None)
            last = ctx.pipeline.num_stages - 1
        resolution = self.resolve(ctx.model, size, starts=stage in (None, 0),
                                  ends=stage in (None, last))
        errors = [f for f in resolution.findings if f.severity.value == "error"]
        if errors:  # validate() ran already; the model changed since (a convert stage)
            raise RuntimeError("TP plan no longer fits the model:\n" +
                               "\n".join(f.format() for f in errors))
        left = leave_distributed(resolution)
        if self.sequence_parallel and left:
            # Their inputs would arrive split on the sequence, as DTensors they were not
            # distributed to take (expert parallelism's all-to-all dispatch).
            raise RuntimeError(
                f"sequence_parallel = true with module(s) another plugin distributed "
                f"already ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}): "
                "sequence parallelism would hand them activations split on the sequence, "
                "which they do not take. Set sequence_parallel = false (TP still splits "
                "attention and the dense layers)")
        mesh = ctx.submesh(self.dim)
        apply_resolution(resolution, mesh, ctx.hooks.parallel_style)
        localized = set_local_head_counts(resolution.local_heads)
        replicated = replicate_rest(resolution, mesh) if self.replicate_rest else 0
        retie(resolution)
        ctx.notes["tp_plan"] = [(path, spec.describe()) for path, _, spec in
                                [*resolution.entries, *((p, o, s) for p, o, _, s in
                                                        resolution.params)]]
        counts = Counter(spec.style for _, _, spec in resolution.entries)
        text = (f"parallelize_module over {self.dim}({size}) ({resolution.source}): "
                + ", ".join(f"{n} {s}" for s, n in counts.items()))
        if resolution.params:
            text += f"; {len(resolution.params)} parameter(s) split"
        if resolution.ties:
            text += f"; {len(resolution.ties)} tied group(s) kept tied"
        if resolution.fallbacks:
            text += "; left whole: " + ", ".join(
                m for f in resolution.fallbacks for m in f.modules)
        if localized:
            text += f"; head counts made local in {localized} attention module(s)"
        if left:
            text += f"; {len(left)} module(s) already distributed left as they are"
        if self.sequence_parallel:
            text += "; sequence parallel"
        if self.loss_parallel:
            text += "; loss parallel (logits sharded on the vocabulary)"
        if replicated:
            text += f"; {replicated} other module(s) replicated over {self.dim}"
        return text


__all__ = [
    "ALL_KEYS",
    "EMBEDDING_NAMES",
    "EMBEDDING_STYLES",
    "GPT_LEAVES",
    "HEAD_ATTRS",
    "HF_LLAMA_LEAVES",
    "HF_STYLES",
    "KV_HEAD_ATTRS",
    "LINEAR_STYLES",
    "LLAMA_LEAVES",
    "OUTPUT_NAMES",
    "PARAM_STYLES",
    "RULES",
    "STYLES",
    "STYLE_KEYS",
    "TP",
    "PlanMap",
    "Resolution",
    "StyleSpec",
    "UnknownStyle",
    "apply_resolution",
    "auto_plan",
    "fit_findings",
    "head_findings",
    "hf_tp_plan",
    "leftover",
    "local_loss",
    "loss_parallel",
    "matches",
    "names_near",
    "option_conflicts",
    "parse_layout",
    "replicate_rest",
    "replicate_style",
    "resolve",
    "rest_findings",
    "retie",
    "tie_findings",
    "torch_style",
]
