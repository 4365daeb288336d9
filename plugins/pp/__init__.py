"""PP: pipeline parallelism over the ``pp`` mesh dim with torch's own schedules.

The model is cut into stages of contiguous blocks (:mod:`.split`) in its own stage of the
apply order, ``pipeline_split``: after convert, before tensor parallel, so that every
later stage (TP, activation checkpointing, compile, FSDP2, materialize, finalize) acts
only on this rank's part(s) and a rank never materializes another stage's weights. Each
part is the model's own root module with the other stages' modules taken out
(:mod:`.parts`), so any model whose blocks sit in a ModuleList, ModuleDict or
Sequential runs without edits. The training step (``plan.training_step``) runs
``torch.distributed.pipelining``'s schedule over the parts (:mod:`.runtime`).

Under FSDP2 torch's stage runs every microbatch's backward with gradient sync off and
parameters kept unsharded after backward, then reduce-scatters the accumulated
gradients once, after the last microbatch; the FSDP2 plugin's ``reshard_after_forward``
is left as the user set it (docs/pp.md says why and what each choice costs).

This package imports torch only inside functions: the plugin class is importable on a
laptop, and its rules (CP601-CP612) run there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    Claim,
    CodeRange,
    EstimatePart,
    Finding,
    Plugin,
    Role,
    Rule,
    Severity,
    Stage,
    bool_option,
    clean_name,
    did_you_mean,
    dim_option,
    has_data_parallel,
    hookimpl,
    ordering_option,
)

from .layer_config import LayerConfigError, stage_layers
from .schedules import (
    SCHEDULES,
    ScheduleInfo,
    canonical,
    fitting_microbatches,
    microbatch_problem,
    placement,
)
from .split import SplitError, StageSplit, compute_split, tied_across

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import ApplyContext, MeshSpec, PlanView, Topology

_E, _W = Severity.ERROR, Severity.WARNING
_PLAN = "[mesh]\npp = 2\n\n[[plugins]]\nname = \"pp\"\n"

RULES = (
    Rule("CP601", _E, "unknown pipeline schedule",
         "use one of torch's schedule names (any case): " + ", ".join(SCHEDULES),
         _PLAN + "schedule = \"1f1bb\"\n"),
    Rule("CP602", _E, "more pipeline stages than the split can fill",
         "use at most as many stages (pp size x stages_per_rank) as the model has blocks, "
         "plus one for what comes before the first block and one for what follows the last",
         "ParallelPlan(MeshSpec(pp=5)).use(PP()).validate(llama_with_2_blocks)"),
    Rule("CP603", _E, "the microbatch count does not fit the schedule",
         "raise microbatches to what the message names, or pick another schedule",
         "[mesh]\npp = 4\n\n[[plugins]]\nname = \"pp\"\nschedule = \"1F1B\"\n"
         "microbatches = 2\n"),
    Rule("CP604", _E, "the per-rank batch cannot be cut into the microbatches",
         "make the per-rank batch a multiple of microbatches (at least microbatches)",
         "step = plan.training_step(model, loss_fn)  # microbatches = 4\n"
         "step.step(tokens[:6], tokens[:6])"),
    Rule("CP605", _E, "stages_per_rank does not fit the schedule",
         "use stages_per_rank = 2 with ZBVZeroBubble and DualPipeV, 1 with GPipe and 1F1B",
         _PLAN + "schedule = \"ZBVZeroBubble\"\nstages_per_rank = 1\n"),
    Rule("CP606", _E, "a combination torch's pipelining does not support here",
         "use a schedule without split backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS), "
         "or drop the conflicting plugin",
         "[mesh]\npp = 2\n\n[[plugins]]\nname = \"pp\"\nschedule = \"ZBVZeroBubble\"\n\n"
         "[[plugins]]\nname = \"compile\"\nbackend = \"aot_eager\"\n"),
    Rule("CP607", _W, "sharding or tensor parallelism crosses nodes while pp stays inside",
         "list pp first in [mesh], so the pipeline's point-to-point sends cross nodes and "
         "the collectives stay inside a node",
         "[mesh]\ndp_shard = 4\npp = 2\n\n[topology]\nnodes = 2\ndevices_per_node = 4\n\n"
         "[[plugins]]\nname = \"fsdp2\"\n\n[[plugins]]\nname = \"pp\"\n"),
    Rule("CP608", _E, "the pipeline split cannot be made",
         "list one module path list per stage covering every parameter once, or use "
         "split = \"auto\"",
         "ParallelPlan(MeshSpec(pp=2)).use(PP(split=[[\"tok_embeddings\", \"layers.0\"], "
         "[\"layers.1\", \"norm\"]])).validate(llama)  # output.weight in no stage"),
    Rule("CP609", _E, "tied parameters on two pipeline stages",
         "untie them (e.g. tie_word_embeddings = false), or keep both modules on one stage",
         "a model whose output head shares the token embedding's weight, under pp = 2"),
    Rule("CP610", _E, "parameters on the root module under a pipeline",
         "move root-level parameters into a submodule",
         "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
         "        self.scale = nn.Parameter(torch.ones(1))  # on the root"),
    Rule("CP611", _E, "a per-layer config list cannot be cut to a pipeline stage",
         "keep the layers in a ModuleList (or a container keyed by layer number) under the "
         "module holding the config, or drop the per-layer setting",
         "a Hugging Face model with config.layer_types whose layers were moved into an "
         "nn.ModuleDict keyed by name, under pp = 2"),
    Rule("CP612", _E, "a stage cannot tell which tensor is its hidden state",
         "keep what the forward does between the embedding and the first block (or "
         "between the last block and the modules after it) inside a module, or give the "
         "stages explicit module lists",
         "a model whose forward takes the mean over the sequence of the embedding's "
         "output, outside any module, before its blocks, under pp = 2"),
    Rule("CP613", _E, "overlap cannot run the plan's forward and backward at once",
         "use overlap with DualPipeV, and with no plugin whose blocks call collectives it "
         "does not mark (tensor or context parallelism), or drop overlap",
         _PLAN + "schedule = \"1F1B\"\noverlap = true\n"),
)


class PipelineError(ValueError):
    """What a pipeline refuses when the plan is applied or a step runs (CP604, CP606):
    ``finding`` holds the code, the message and the fix."""

    def __init__(self, finding: Finding) -> None:
        self.finding = finding
        super().__init__(finding.format())


def _positive_or_none(instance: Any, attribute: Any, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive int; got {value!r}")


def _split_option(value: Any) -> str | tuple[tuple[str, ...], ...]:
    if value in ("auto", "pp_plan"):
        return str(value)
    if (isinstance(value, (list, tuple)) and value and all(
            isinstance(stage, (list, tuple)) and stage and all(isinstance(p, str) for p in stage)
            for stage in value)):
        return tuple(tuple(stage) for stage in value)
    raise ValueError(
        "split must be \"auto\", \"pp_plan\" (a Hugging Face model's own pipeline plan) or a "
        f"list of module-path lists, one per stage; got {value!r}")


def _schedule_name(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str):
        raise ValueError(f"schedule must be a schedule name; got {value!r}")


@attrs.frozen
class PP(Plugin):
    """Pipeline parallelism (``torch.distributed.pipelining``) over ``dim`` (``pp``).

    Options: ``schedule`` (torch's names, any case: GPipe, 1F1B, Interleaved1F1B,
    LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); ``microbatches`` per
    step (default: the smallest count >= the number of stages the schedule accepts);
    ``stages_per_rank`` (virtual stages; default 2 for the V schedules, else 1);
    ``split``: ``"auto"`` (contiguous blocks balanced by parameter count), ``"pp_plan"``
    (a Hugging Face model's pipeline plan), or a list of module paths per stage;
    ``overlap``: with DualPipeV, each overlapped forward and backward runs its halves at
    once, one microbatch's expert all-to-alls behind the other's compute
    (:mod:`composer_par.plugin.overlap`; torch alone runs them one after the other).
    """

    name: ClassVar[str] = "pp"
    provides: ClassVar[frozenset[str]] = frozenset({"pipeline"})
    needs_blocks: ClassVar[bool] = True
    rules: ClassVar[tuple[Rule, ...]] = RULES
    code_ranges: ClassVar[tuple[CodeRange, ...]] = (
        CodeRange("CP", 601, 699, "pipeline parallelism"),)

    dim: str = dim_option("pp")
    schedule: str = attrs.field(default="1F1B", validator=_schedule_name)
    microbatches: int | None = attrs.field(default=None, validator=_positive_or_none)
    stages_per_rank: int | None = attrs.field(default=None, validator=_positive_or_none)
    split: str | tuple[tuple[str, ...], ...] = attrs.field(default="auto",
                                                          converter=_split_option)
    overlap: bool = bool_option(False)
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    def claims(self) -> tuple[Claim, ...]:
        # Ranks along pp run different stages of the same samples: not data parallel.
        return (Claim(self.dim, Role.OTHER),)

    # -- derived settings ---------------------------------------------------------------

    @property
    def info(self) -> ScheduleInfo | None:
        name = canonical(self.schedule)
        return SCHEDULES[name] if name else None

    def virtual_stages(self) -> int:
        """Stages per rank: the option, else what the schedule takes (2 for V, else 1)."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        info = self.info
        return info.stages_per_rank if info and info.stages_per_rank else 1

    def microbatch_count(self, pp: int) -> int:
        if self.microbatches is not None:
            return self.microbatches
        info = self.info
        stages = pp * self.virtual_stages()
        return fitting_microbatches(info, pp, self.virtual_stages(), stages) if info else stages

    def stage_placement(self, pp: int) -> tuple[tuple[int, ...], ...]:
        info = self.info
        return placement(pp, pp * self.virtual_stages(), info.style if info else "loop")

    def compute_split(self, model: nn.Module, blocks: Sequence[Any], pp: int) -> StageSplit:
        return compute_split(model, blocks, self.split, pp * self.virtual_stages())

    # -- validation -----------------------------------------------------------------------

    @hookimpl
    def composer_par_validate_plan(
        self, plan: PlanView, mesh: MeshSpec, topology: Topology | None
    ) -> list[Finding]:
        info = self.info
        if info is None:
            lower = {name.lower(): name for name in SCHEDULES}
            near = did_you_mean(self.schedule.lower(), lower)
            for low, name in lower.items():  # torch's spelling in the suggestion
                near = near.replace(f"'{low}'", f"'{name}'")
            return [Finding(
                "CP601", f"unknown pipeline schedule {self.schedule!r}{near}",
                fix=f"use one of {', '.join(SCHEDULES)} (any case)")]
        found: list[Finding] = []
        per_rank = self.virtual_stages()
        if info.stages_per_rank is not None and per_rank != info.stages_per_rank:
            what = ("runs two stages per rank on a V-shaped placement" if info.style == "v"
                    else "runs one stage per rank")
            found.append(Finding(
                "CP605", f"{info.name} {what}; stages_per_rank = {per_rank}",
                fix=f"set stages_per_rank = {info.stages_per_rank} (or leave it out), or use "
                + ("Interleaved1F1B or LoopedBFS for several looped stages per rank"
                   if info.stages_per_rank == 1 else "GPipe or 1F1B for one stage per rank")))
        size = mesh.size(self.dim) if self.dim in mesh else 0
        if size > 0:
            stages = size * per_rank
            if not isinstance(self.split, str) and len(self.split) != stages:
                found.append(Finding(
                    "CP608", f"split lists {len(self.split)} stage(s) of module paths, and "
                    f"the plan runs {stages} pipeline stages ({self.dim}({size}) x "
                    f"stages_per_rank {per_rank})",
                    fix=f"give {stages} lists of module paths, one per stage"))
            problem = microbatch_problem(info, self.microbatch_count(size), size, per_rank)
            if problem:
                fit = fitting_microbatches(info, size, per_rank, self.microbatch_count(size))
                found.append(Finding("CP603", problem,
                                     fix=f"use microbatches = {fit} (or any larger count "
                                     f"{info.name} accepts), or another schedule"))
        compilers = plan.stage_plugins(Stage.COMPILE)
        if info.split_backward and compilers:
            found.append(self._compiled_refusal(info.name, f"{', '.join(compilers)} compiles "
                                                "the blocks"))
        if info.split_backward:
            found += self._hooked_averaging(info.name, plan, mesh)
            found += self._selective_refusal(info.name, plan)
        if self.overlap:
            found += self._overlap_problems(info, plan, mesh)
        found += self._topology(plan, mesh, topology)
        return found

    def _hooked_averaging(self, schedule: str, plan: PlanView, mesh: MeshSpec
                          ) -> list[Finding]:
        """A folded dim (ep, cp) with no data-parallel plugin: its plugin averages the
        gradients over it by parameter hooks, which torch's weight backward bypasses (it
        writes ``.grad`` itself), so the gradients would stay per-rank, silently."""
        if has_data_parallel(plan):
            return []
        folded = [f.dim for f in plan.folded_dims()
                  if f.dim in mesh and mesh.size(f.dim) != 1]
        owners = {c.dim: d.plugin for d in plan.declarations() for c in d.claims}
        return [Finding(
            "CP606", f"{schedule} writes weight gradients apart from the autograd engine, "
            f"so the gradient hooks of the {owners.get(dim, '?')} plugin, which average "
            f"over {dim} when no data-parallel plugin does, never run: each {dim} rank "
            "would keep its own gradients",
            fix=f"add fsdp2 (it averages over {dim} itself; dp_shard = 1 is enough), or "
            "use GPipe, 1F1B, Interleaved1F1B or LoopedBFS", plugin=self.name)
            for dim in folded]

    def _overlap_problems(self, info: ScheduleInfo, plan: PlanView, mesh: MeshSpec
                          ) -> list[Finding]:
        """overlap needs a schedule with overlapped actions, and every collective inside
        the blocks marked: two threads issuing unmarked ones on one group could issue
        them in different orders on different ranks."""
        from composer_par.plugin import OVERLAP_MARKS

        if not info.overlaps:
            return [Finding("CP613", f"overlap runs the halves of each overlapped forward "
                            f"and backward at once, and {info.name} has none",
                            fix="use schedule = \"DualPipeV\", or drop overlap",
                            plugin=self.name)]
        return [Finding(
            "CP613", f"overlap runs a forward and a backward on two threads at once, and "
            f"the {d.plugin} plugin's collectives over {c.dim}({mesh.size(c.dim)}) inside "
            "the blocks are not marked, so the threads could issue them in different "
            "orders on different ranks", fix=f"drop overlap, or {c.dim} (set it to 1)",
            plugin=self.name)
            for d in plan.declarations() for c in d.claims
            if c.role is Role.MODEL_PARALLEL and c.dim in mesh and mesh.size(c.dim) > 1
            and OVERLAP_MARKS not in d.provides]

    def _selective_refusal(self, schedule: str, plan: PlanView) -> list[Finding]:
        """torch's weight pass runs a second backward over each block, so a
        checkpointed block is recomputed twice, which torch's selective checkpointing
        refuses at the first step ("Trying to backward an extra time"; measured on
        torch 2.13). Full checkpointing recomputes as often as asked."""
        return [Finding(
            "CP606", f"{schedule} splits each backward into input and weight gradients, "
            f"which recomputes each checkpointed block twice, and the {d.plugin} plugin's "
            f"{d.checkpointing} checkpointing allows one recompute only (torch refuses "
            "the second at the first step)",
            fix="use full checkpointing (mode = \"full\"), or GPipe, 1F1B, "
            "Interleaved1F1B or LoopedBFS", plugin=self.name)
            for d in plan.selective_checkpointing()]

    def _compiled_refusal(self, schedule: str, what: str) -> Finding:
        # torch refuses torch.compile wrappers for these schedules itself; blocks compiled
        # in place through AOTAutograd fail in the weight backward (measured on torch
        # 2.13: "compiled with non-empty donated buffers").
        return Finding(
            "CP606", f"{schedule} splits each backward into input and weight gradients, "
            f"which torch does not support on compiled modules ({what})",
            fix="use GPipe, 1F1B, Interleaved1F1B or LoopedBFS, or drop compile",
            plugin=self.name)

    def _topology(self, plan: PlanView, mesh: MeshSpec, topology: Topology | None
                  ) -> list[Finding]:
        if (topology is None or self.dim not in mesh or not mesh.is_resolved
                or topology.world_size != mesh.world_size or mesh.size(self.dim) == 1):
            return []
        if topology.crosses_nodes(mesh, self.dim):
            return []
        heavy = [c.dim for d in plan.declarations() for c in d.claims
                 if c.role in (Role.SHARD, Role.MODEL_PARALLEL) and c.dim in mesh
                 and mesh.size(c.dim) > 1 and topology.crosses_nodes(mesh, c.dim)]
        if not heavy:
            return []
        order = [self.dim, *(n for n in mesh.names if n != self.dim)]
        reordered = ", ".join(f"{n} = {mesh.size(n)}" for n in order)
        return [Finding(
            "CP607",
            f"{', '.join(heavy)} crosses nodes on {topology.describe()} while {self.dim} "
            f"stays inside a node: collectives ({', '.join(heavy)}) would run over the "
            f"slow links that the pipeline's point-to-point sends need far less of",
            fix=f"list {self.dim} first in [mesh]: {reordered}")]

    @hookimpl
    def composer_par_validate_model(self, model: nn.Module, blocks: list[Any], mesh: MeshSpec
                                    ) -> list[Finding]:
        if self.info is None or self.dim not in mesh or mesh.size(self.dim) < 1:
            return []
        from .runtime import compiled_modules

        found: list[Finding] = []
        compiled = compiled_modules([model]) if self.info.split_backward else []
        if compiled:
            found.append(self._compiled_refusal(
                self.info.name, f"{', '.join(compiled[:3])} compiled before the plan"))
        try:
            split = self.compute_split(model, blocks, mesh.size(self.dim))
        except SplitError as exc:
            return [*found, Finding(exc.code, str(exc), fix=exc.fix)]
        try:
            stage_layers(model, split.blocks)
        except LayerConfigError as exc:
            found.append(Finding("CP611", str(exc), fix=exc.fix))
        return found + [Finding(
            "CP609", f"{a} (stage {sa}) and {b} (stage {sb}) are one tied parameter: "
            "each stage would train its own copy",
            fix="untie them (for a Hugging Face model: tie_word_embeddings = false), or "
            "give both modules to one stage with an explicit split")
            for a, b, sa, sb in tied_across(model, split)]

    # -- explain --------------------------------------------------------------------------

    @hookimpl
    def composer_par_describe(self, plan: PlanView) -> list[tuple[str, str]]:
        info = self.info
        mesh = plan.mesh
        size = mesh.size(self.dim) if self.dim in mesh else -1
        how = {"auto": "contiguous blocks balanced by parameter count",
               "pp_plan": "the model's Hugging Face pipeline plan"}.get(
                   self.split if isinstance(self.split, str) else "",
                   "the given module paths per stage")
        if info is None or size < 1:
            return [("pipeline_split", f"cut the model into stages over {self.dim} ({how})")]
        per_rank = self.virtual_stages()
        where = "; ".join(f"rank {r}: stage(s) {', '.join(map(str, s))}"
                          for r, s in enumerate(self.stage_placement(size)))
        return [
            ("pipeline_split", f"cut the model into {size * per_rank} stages over "
             f"{self.dim}({size}) ({how}); {where}; keep only this rank's stage(s)"),
            ("finalize", f"{info.name} schedule with {self.microbatch_count(size)} "
             "microbatches per step (plan.training_step runs it)"),
        ]

    @hookimpl
    def composer_par_timeline(self, mesh: MeshSpec) -> Any:
        from .timeline import timeline

        info = self.info
        if info is None or self.dim not in mesh or mesh.size(self.dim) < 1:
            return None
        size = mesh.size(self.dim)
        per_rank = self.virtual_stages()
        if (microbatch_problem(info, self.microbatch_count(size), size, per_rank)
                or (info.stages_per_rank is not None and per_rank != info.stages_per_rank)):
            return None  # validation reports it; torch would refuse to build the schedule
        return timeline(info.name, size, per_rank, self.microbatch_count(size), self.dim)

    @hookimpl
    def composer_par_estimate_pipeline(self, layout: Any, model: Any, workload: Any) -> Any:
        from .estimate import estimate_pipeline

        return estimate_pipeline(self, layout, model, workload)

    @hookimpl
    def composer_par_suggest(self, model: Any, topology: Any) -> Any:
        from .suggest import suggest_axes

        return suggest_axes(self, model, topology)

    @hookimpl
    def composer_par_estimate(self, layout: Any, model: Any, workload: Any,
                              stage: Any) -> Any:
        """Why there are no pipeline terms, when the plan cannot run its schedule."""
        from .estimate import cuts, problem

        if stage is not None or not cuts(self, layout):
            return None
        why = problem(self, layout, model, workload)
        return EstimatePart(collectives=(), notes=(why,)) if why else None

    # -- stages ---------------------------------------------------------------------------

    @hookimpl
    def composer_par_pipeline_split(self, ctx: ApplyContext) -> str:
        from composer_par.plugin.pipeline import Pipeline, StagePart

        from .layer_config import give_stage_configs
        from .parts import build_parts
        from .runtime import build_schedule

        info = self.info
        assert info is not None  # validation refused an unknown schedule
        size = ctx.mesh.size(self.dim)
        rank = ctx.mesh.coordinate(ctx.rank)[self.dim]
        split = self.compute_split(ctx.model, ctx.blocks, size)
        layout = self.stage_placement(size)
        group = ctx.submesh(self.dim).get_group()
        model_keys = tuple(clean_name(k) for k in ctx.model.state_dict(keep_vars=True))
        model_name = type(ctx.model).__name__
        try:
            per_layer = stage_layers(ctx.model, split.blocks)
        except LayerConfigError as exc:  # validation refuses it first
            raise PipelineError(Finding("CP611", str(exc), fix=exc.fix,
                                        plugin=self.name)) from None
        boundaries = self._boundaries(ctx.model, split, layout[rank], model_name)
        _, built = build_parts(ctx.model, split.stages, split.shared, layout[rank], ctx.blocks)
        parts = [StagePart(stage, module, blocks, owned) for stage, module, blocks, owned in built]
        for part in parts:
            # Each stage's base model reads per-layer lists by the index of the layers it
            # iterates: its own config holds its layers' entries.
            give_stage_configs(part.module, per_layer[part.stage], model_name)
        microbatches = self.microbatch_count(size)
        device = ctx.device

        def schedule(loss_fn: Any, count: int = microbatches) -> Any:
            # The training step asks for more under accumulation: microbatches x k.
            problem = microbatch_problem(info, count, size, self.virtual_stages())
            if problem:
                raise PipelineError(Finding(
                    "CP603", problem, fix=f"use an accumulate whose product with "
                    f"microbatches = {microbatches} {info.name} accepts, or another "
                    "microbatch count", plugin=self.name))
            return build_schedule(schedule=info.name, microbatches=count,
                                  num_stages=split_count, device=device, group=group,
                                  parts=[(p.stage, p.module) for p in parts], loss_fn=loss_fn,
                                  boundaries=boundaries, overlap=self.overlap)

        def check_batch(batch: int) -> None:
            if batch < microbatches or batch % microbatches:
                raise PipelineError(Finding(
                    "CP604", f"the per-rank batch has {batch} sample(s), which "
                    f"{microbatches} microbatches do not divide evenly (each microbatch must "
                    "be as large, or the mean loss would weigh samples unevenly)",
                    fix=f"use a per-rank batch that is a multiple of {microbatches}, or set "
                    f"microbatches to a divisor of {batch}", plugin=self.name))

        split_count = len(split.stages)
        ctx.pipeline = Pipeline(
            dim=self.dim, size=size, rank=rank, schedule=info.name, microbatches=microbatches,
            split=split.stages, placement=layout, parts=parts, build_schedule=schedule,
            check_batch=check_batch, stage_params=split.params, model_keys=model_keys)
        # Whatever looks at the whole model's blocks from here on sees this rank's only.
        ctx.blocks[:] = [b for p in parts for b in p.blocks]
        held = "; ".join(f"stage {p.stage}: {len(p.blocks)} block(s)" for p in parts)
        return (f"{split_count} stages over {self.dim}({size}), {info.name} with "
                f"{microbatches} microbatches; this rank: {held}")

    @staticmethod
    def _boundaries(model: nn.Module, split: StageSplit, local: Sequence[int],
                    model_name: str) -> dict[int, Any]:
        """Each local stage's boundary (:mod:`.boundary`), its first block hooked: made
        on the whole model, before the split prunes it."""
        from .boundary import StageBoundary, install
        from .split import units_after_blocks

        modules = {clean_name(n): m for n, m in model.named_modules()}
        after = frozenset(units_after_blocks(model, [b for bs in split.blocks for b in bs]))
        last = len(split.stages) - 1
        out = {}
        for stage in local:
            path = split.blocks[stage][0] if split.blocks[stage] else ""
            first = modules.get(path) if stage > 0 and path else None
            if first is not None:
                install(first)
            out[stage] = StageBoundary(stage, model_name, first, path,
                                       after if stage < last else frozenset())
        return out

    @hookimpl
    def composer_par_finalize(self, ctx: ApplyContext) -> str:
        from .runtime import compiled_modules, keep_unsharded_until_backward

        info = self.info
        assert info is not None
        if not info.split_backward:
            return f"nothing to change for {info.name}"
        compiled = compiled_modules([ctx.model])
        if compiled:
            # Validation finds a compile stage and a model compiled before the plan; this
            # catches a module compiled by any other means during apply.
            raise PipelineError(self._compiled_refusal(
                info.name, f"{', '.join(compiled[:3])} compiled"))
        changed = keep_unsharded_until_backward(ctx.model, ctx.data_parallel_modules)
        if not changed:
            return "no sharded module to keep unsharded"
        return (f"{info.name} computes weight gradients after the input gradients: "
                f"{changed} FSDP module(s) keep parameters unsharded from forward to backward "
                "(resharded after backward)")


__all__ = ["PP", "RULES", "SCHEDULES", "PipelineError"]
