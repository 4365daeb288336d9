"""Float8: float8 training of a model's Linear layers with torchao, in the convert stage.

    plan = (ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2()).use(Compile())
            .use(Float8(recipe="tensorwise")).use(MetaInit()))
    model = plan.apply(model)

The convert stage (before tensor parallelism and FSDP2 see the model) swaps the chosen
``nn.Linear`` layers for torchao's float8 ones (:mod:`.selection`: every Linear of the
blocks whose dims are multiples of 16; the model's first and last layers and the others
stay in high precision, each named by CP969). The weights stay high-precision master
weights (what the optimizer steps, checkpoints save and safetensors exports hold); each
matmul casts its operands to float8 with dynamic scales, per tensor (``tensorwise``) or
per row (``rowwise``, ``rowwise_with_gw_hp``: the weight gradient's matmul in high
precision).

* FSDP2 with ``tensorwise``: the weights all-gather in float8 (one byte per element), with
  their scales precomputed in one all-reduce per optimizer step (:mod:`.scales`); the
  rowwise recipes gather in high precision (a row's scale needs the whole row).
* TP: torchao's float8 styles for the converted layers of a tensorwise recipe
  (:mod:`.tp_styles`, through the ``composer_par_parallel_style`` hook).
* EP: the routed experts (3-D weights, not Linear layers) stay in high precision:
  torchao's float8 grouped matmuls are a CUDA-only prototype that needs experts calling
  ``torch._grouped_mm``; the dense layers beside them convert.
* On a device without float8 matmuls (CPU; GPUs below SM89) torchao emulates them:
  ``emulate = "auto"`` does so on CPU, and refuses (CP966) the hardware path where the
  device lacks it.

Modules: ``torchao_api`` (every torchao symbol used), ``selection`` (which layers),
``device`` (float8 hardware), ``scales`` (the per-step precompute), ``tp_styles``,
``estimate``, ``findings`` (CP961-CP969). Torch and torchao are imported inside functions
only: the static path needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    CodeRange,
    EstimatePart,
    EstimateSettings,
    Finding,
    OptionError,
    Plugin,
    Role,
    Rule,
    Stage,
    bool_option,
    hookimpl,
    ordering_option,
    runs_of,
)

from . import torchao_api
from .estimate import float8_terms
from .findings import (
    RECIPES,
    RULES,
    choice_findings,
    device_findings,
    gather_findings,
)
from .selection import Choice, choose

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import ApplyContext, MeshSpec, PlanView

ALL_GATHERS = ("auto", "float8", "high_precision")


def _patterns(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v
                                                       for v in value):
        raise OptionError(f"expected a list of module-path patterns; got {value!r}")
    return tuple(value)


def _skip(value: Any) -> tuple[str, ...]:
    return _patterns(value) or ()


def _emulate(value: Any) -> str | bool:
    if value in ("auto", True, False):
        return value  # type: ignore[no-any-return]
    raise OptionError(f"emulate must be \"auto\", true or false; got {value!r}")


def sharded_dims(plan: PlanView, mesh: MeshSpec) -> list[str]:
    """The mesh dims a data-parallel plugin shards weights over (FSDP2's). One of size 1
    counts: FSDP2 still gathers (copies) its units there, and a float8 all-gather casts
    the fp32 master weights to float8 once, instead of to bf16 and then to float8."""
    return [c.dim for d in plan.declarations() if "data_parallel" in d.provides
            for c in d.claims if c.role is Role.SHARD and c.dim in mesh]


@attrs.frozen
class Float8(Plugin):
    """Float8 training of Linear layers (torchao), in the convert stage.

    Options: ``recipe`` (``"tensorwise"``, the default: per-tensor scales, float8
    all-gathers under FSDP2; ``"rowwise"``; ``"rowwise_with_gw_hp"``); ``modules`` (globs
    of the Linear layers to convert, ``*`` one path component; default: every Linear of
    the blocks); ``skip`` (globs of layers to leave out); ``convert_ends`` (also convert
    the Linear layers outside the blocks: the model's first and last layers; default
    false); ``all_gather`` (``"auto"``: float8 under FSDP2 with the tensorwise recipe,
    else high precision; ``"float8"``; ``"high_precision"``); ``emulate`` (``"auto"``:
    emulated on CPU, float8 matmuls on CUDA; true; false); ``after`` / ``before``.
    """

    name: ClassVar[str] = "float8"
    rules: ClassVar[tuple[Rule, ...]] = RULES
    code_ranges: ClassVar[tuple[CodeRange, ...]] = (
        CodeRange("CP", 961, 969, "float8 training"),)

    recipe: str = attrs.field(default="tensorwise", validator=attrs.validators.in_(RECIPES))
    modules: tuple[str, ...] | None = attrs.field(default=None, converter=_patterns)
    skip: tuple[str, ...] = attrs.field(default=(), converter=_skip)
    convert_ends: bool = bool_option(False)
    all_gather: str = attrs.field(default="auto", validator=attrs.validators.in_(ALL_GATHERS))
    emulate: str | bool = attrs.field(default="auto", converter=_emulate)
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    def float8_gather(self, plan: PlanView, mesh: MeshSpec) -> bool:
        """Whether FSDP2 all-gathers the converted weights in float8."""
        return (self.all_gather != "high_precision" and self.recipe == "tensorwise"
                and bool(sharded_dims(plan, mesh)))

    # -- validation ------------------------------------------------------------------

    @hookimpl
    def composer_par_validate_plan(self, plan: PlanView, mesh: MeshSpec) -> list[Finding]:
        found = []
        if not torchao_api.installed():
            found.append(Finding(
                "CP967", "the float8 plugin converts layers with torchao, and torchao is not "
                "installed here", fix="pip install 'composer-par[float8]' (torchao >= 0.18)"))
        sharded = sharded_dims(plan, mesh)
        hooked = [h.dim for h in plan.comm_hooks() if h.all_gather is not None
                  and h.dim in sharded]
        found += gather_findings(self.recipe, self.all_gather, sharded, hooked)
        return found

    def choose(self, model: nn.Module, blocks: list[Any]) -> Choice:
        return choose(model, blocks, modules=self.modules, skip=self.skip,
                      convert_ends=self.convert_ends)

    @hookimpl
    def composer_par_validate_model(self, plan: PlanView, model: nn.Module,
                                    blocks: list[Any]) -> list[Finding]:
        found = choice_findings(self.choose(model, blocks))
        from .device import float8_hardware, where_it_runs

        device = where_it_runs()
        if device is not None:
            hardware, described = float8_hardware(device)
            compiled = bool(plan.stage_plugins(Stage.COMPILE))
            found += device_findings(device, hardware, described, self.emulate, compiled)
        return found

    # -- explain and estimate --------------------------------------------------------

    @hookimpl
    def composer_par_describe(self, plan: PlanView) -> list[tuple[str, str]]:
        which = ("the Linear layers " + ", ".join(self.modules) if self.modules is not None
                 else "every Linear layer of the blocks" + (
                     " and the model's first and last layers" if self.convert_ends else
                     " (the model's first and last layers stay in high precision)"))
        text = (f"{which} to torchao float8 ({self.recipe} scales"
                f"{'' if self.emulate != True else ', emulated'}); dims not multiples of 16 "  # noqa: E712
                "and routed experts stay in high precision (validate with the model names "
                "each, CP969)")
        if self.skip:
            text += f"; skipped: {', '.join(self.skip)}"
        steps = [("convert", text)]
        mesh = plan.mesh
        if self.float8_gather(plan, mesh):
            steps.append(("data_parallel", "FSDP2 all-gathers the float8 weights in float8 "
                          "(1 byte per element); their scales computed in one all-reduce of "
                          "the amaxes once per optimizer step (plan.training_step and the "
                          "trainer adapters)"))
        elif sharded_dims(plan, mesh):
            why = ("a rowwise recipe's weights gather in high precision (torchao gathers "
                   "only per-tensor-scaled weights in float8)" if self.recipe != "tensorwise"
                   else "all_gather = \"high_precision\"")
            steps.append(("data_parallel", f"FSDP2 all-gathers the weights in high "
                          f"precision: {why}"))
        if any(c.role is Role.MODEL_PARALLEL for d in plan.declarations() for c in d.claims
               if d.plugin == "tp"):
            steps.append(("tensor_parallel", "torchao's Float8ColwiseParallel / "
                          "Float8RowwiseParallel for the converted layers" if
                          self.recipe == "tensorwise" else
                          "torch's own TP styles for the converted layers (torchao's float8 "
                          "styles assume per-tensor scales)"))
        return steps

    @hookimpl
    def composer_par_estimate_settings(self) -> EstimateSettings | None:
        # The converted matmuls run at the device's float8 rate, unless emulated.
        return None if self.emulate is True else EstimateSettings(matmul_dtype="float8")

    @hookimpl
    def composer_par_estimate_shape(self, plan: PlanView, layout: Any, model: Any) -> Any:
        """The converted weights gather in float8 (one byte each) under FSDP2 with the
        tensorwise recipe: marked so in the shape, for FSDP2's terms to count."""
        from .estimate import gathered_in_float8

        if not self.float8_gather(plan, layout.mesh):
            return None
        return gathered_in_float8(model)

    @hookimpl
    def composer_par_estimate(self, plan: PlanView, layout: Any, model: Any, workload: Any,
                              stage: Any) -> EstimatePart:
        mesh = layout.mesh
        sharded = sharded_dims(plan, mesh)
        dim = sharded[0] if sharded else None
        if stage is not None and stage.block_gathers is not None:
            gathers = stage.block_gathers
        else:
            # Each block gathers in forward and, resharded after forward (the default for
            # all blocks but the last), again in backward, once per pass: at most 2.
            gathers = ((1 if layout.reshard_after_forward is False else 2)
                       * runs_of(workload, stage))
        dtype = layout.param_dtype or model.dtype or workload.dtype or "float32"
        collectives, memory, notes = float8_terms(
            model, dim=dim, shard=layout.shard_size() if dim else 1, gathers=gathers,
            param_dtype=dtype, recipe=self.recipe,
            float8_gather=self.float8_gather(plan, mesh))
        return EstimatePart(collectives=collectives, memory=memory, notes=notes)

    # -- apply -----------------------------------------------------------------------

    @hookimpl
    def composer_par_convert(self, ctx: ApplyContext) -> str:
        from composer_par.plugin import clean_name

        choice = self.choose(ctx.model, ctx.blocks)
        emulate = self.emulated(ctx.device)
        gather = self.float8_gather(ctx.plan, ctx.mesh)
        config = torchao_api.linear_config(self.recipe, emulate=emulate,
                                           float8_all_gather=gather)
        keep = set(choice.converted)
        ctx.model = torchao_api.convert(ctx.model, config,
                                        lambda module, path: clean_name(path) in keep)
        ctx.notes["float8"] = choice
        how = "emulated" if emulate else "float8 matmuls"
        gathered = "; FSDP2 all-gathers them in float8" if gather else ""
        return f"{self.recipe} ({how}): {choice.summary()}{gathered}"

    def emulated(self, device: Any) -> bool:
        """Whether the layers emulate float8 matmuls on ``device``."""
        if self.emulate != "auto":
            return bool(self.emulate)
        import torch

        return torch.device(device).type != "cuda"

    @hookimpl
    def composer_par_parallel_style(self, module: nn.Module, style: Any) -> Any:
        from .tp_styles import float8_style

        return float8_style(module, style)

    @hookimpl
    def composer_par_finalize(self, ctx: ApplyContext) -> str | None:
        from .scales import install

        scales = install(ctx.model)
        if scales is None:
            return None
        return (f"scales of {len(scales.weights)} float8 all-gather weight(s) precomputed "
                "in one all-reduce per optimizer step")

    @hookimpl
    def composer_par_parameters_changed(self, model: nn.Module) -> None:
        from .scales import forget_all

        forget_all(model)


__all__ = ["ALL_GATHERS", "RECIPES", "RULES", "Choice", "Float8", "choose"]
