"""Every hook a plugin can implement. This module is the plugin-author reference.

Implement a hook as a method of your :class:`~composer_par.plugin.Plugin` subclass
marked with ``@hookimpl``; its name must be one below (pluggy rejects misspelled
names when the plugin is used). A hook's arguments may be any subset of the spec's.

Kinds of hook:

* **declaration** -- what a plugin claims and needs, asked before anything else.
* **validation** -- findings about the plan (static, no torch) or the model.
* **composition** -- how plugins cooperate without knowing each other: one plugin
  contributes (HSDP: its replicate dim), another asks (FSDP2: which dims to replicate over).
* **training** -- what a plugin does around each step of ``plan.training_step``: before
  the first forward, and whether the optimizer may apply the step (fault tolerance).
* **stage** -- the eight steps of the apply order. ``ParallelPlan.apply`` calls them in
  the order of :class:`~composer_par.plugin.Stage`, never in registration order. Within a
  stage, plugins run in ``use()`` order adjusted by their declared ``after``/``before``.
  Each stage hook returns a short description of what it did (or None): one log event
  per applied step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_par.plugin.base import hookspec

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.blocks import BlockSpec
    from composer_par.estimate import (
        Collective,
        EstimatePart,
        EstimatePipeline,
        EstimateStage,
        Layout,
        ModelShape,
        Workload,
    )
    from composer_par.findings import Finding
    from composer_par.mesh import MeshSpec
    from composer_par.plan import ParallelPlan
    from composer_par.plugin.base import (
        Declaration,
        EstimateSettings,
        FoldedDim,
        LaunchDim,
        ShardApart,
    )
    from composer_par.plugin.comm import CommHook
    from composer_par.plugin.context import ApplyContext
    from composer_par.plugin.pipeline import Timeline
    from composer_par.plugin.suggesting import SuggestAxis
    from composer_par.topology import Topology


# -- declaration -----------------------------------------------------------------------


@hookspec
def composer_par_declare() -> Declaration | None:
    """Declare the plugin's claims on mesh dims, capabilities, requirements and ordering.

    Called: once per plan, whenever it is validated, explained or applied.
    Returns: a :class:`~composer_par.plugin.Declaration`. The base class implements it
    from ``Plugin.claims()`` and the class attributes ``provides``/``requires``/
    ``needs_blocks`` and the options ``after``/``before``; override ``claims()``.
    """


# -- validation --------------------------------------------------------------------------


@hookspec
def composer_par_validate_plan(
    plan: ParallelPlan, mesh: MeshSpec, topology: Topology | None
) -> list[Finding] | None:
    """Findings about the plan alone: options, the mesh, the topology.

    Called: by ``validate()`` and ``apply()``, and by ``composer-par validate`` without a
    model. Must not import torch or touch a process group: it runs on a laptop.
    ``mesh`` is resolved against the world size when that is known (else it may hold
    a ``-1``); ``topology`` is None when nothing says how ranks lie on nodes.
    Returns: findings (possibly empty). All plugins' findings are collected together.
    """


@hookspec
def composer_par_validate_model(
    plan: ParallelPlan, model: nn.Module, blocks: list[Any], mesh: MeshSpec
) -> list[Finding] | None:
    """Findings about the plan applied to ``model`` (e.g. a module MetaInit cannot init).

    Called: by ``validate(model)`` and by ``apply(model)`` before anything is mutated.
    ``blocks`` is the list of ``(path, module)`` pairs the shared block finder found;
    ``mesh`` is the plan's mesh resolved against the world size when that is known (so a
    ``tp = -1`` has its size), else as written.
    Returns: findings (possibly empty). Must not mutate the model.
    """


# -- composition -------------------------------------------------------------------------


@hookspec
def composer_par_replicate_dims(plan: ParallelPlan) -> list[str] | None:
    """Mesh dims over which data-parallel sharding should replicate (HSDP's dim).

    Called: by a data-parallel plugin building its mesh (FSDP2 asks; HSDP answers).
    Returns: the names of mesh dims this plugin replicates over, outermost first.
    """


@hookspec
def composer_par_folded_dims(plan: ParallelPlan) -> list[FoldedDim] | None:
    """Model-parallel mesh dims that data parallelism folds in (context and expert
    parallelism's dims).

    Called: by data-parallel plugins building their mesh, by ``plan.data_shard()`` and
    ``plan.data_parallel_dims()``, and by ``explain``; statically (must not import torch).
    Returns: :class:`~composer_par.plugin.FoldedDim` values, one per claimed mesh dim over
    which the parameters the plugin does not split are equal across ranks, so their
    gradients must also be averaged over it. FSDP2 then shards over its own dim and these
    together (one flattened shard dim; replicate dims stay outer), and HSDP alone
    replicates over its dim and these. A dim whose ``distinct_samples`` is true is a
    data-parallel dim of the plan's data shards (ranks along it read different samples).
    With no data-parallel plugin in the plan, nothing else reduces over a folded dim: the
    folding plugin averages those gradients itself. Parameters that differ along the dim
    (expert parallelism's experts) are the folding plugin's business.
    """


@hookspec
def composer_par_launch_dims(plan: ParallelPlan) -> list[LaunchDim] | None:
    """Mesh dims whose coordinates are separate launches of the plan (fault-tolerant
    replica groups: each is its own job with its own process group).

    Called: statically (must not import torch) whenever the plan lays out its mesh:
    validation, ``apply``, ``data_shard``, ``explain``, ``estimate``.
    Returns: :class:`~composer_par.plugin.LaunchDim` values, one per such dim the plugin
    ties together. One launch then holds the ranks of one coordinate: its world size is
    the mesh's product without these dims, its DeviceMesh has them at size 1 (so a
    data-parallel plugin that owns one builds as it would for one replica, and a comm hook
    on it does the reduction across launches), and ``plan.data_shard()`` counts them,
    this launch at ``index``. The dims must be outermost; their plugin checks that.
    """


@hookspec
def composer_par_shard_apart(plan: ParallelPlan, model: nn.Module) -> list[ShardApart] | None:
    """Modules that data parallelism must shard apart from their block, over its mesh
    without some model-parallel dims (expert parallelism's experts, over the data-parallel
    dims without ``ep``: torchtitan's arrangement).

    Called: at apply, by the data-parallel plugin in its data_parallel stage, with the
    model (or the pipeline part) as the earlier stages left it, before it shards the
    blocks. The data-parallel plugin shards each answer's modules as units of their own
    (bottom-up: before the blocks that hold them) over its mesh less ``without``, and
    divides their summed gradients by the number of all data shards (the product of
    ``plan.data_parallel_dims()``'s sizes, times the cp ranks', each holding part of the
    sequences), since the modules' gradients already sum over ``without``.
    Returns: :class:`~composer_par.plugin.ShardApart` values, or None.
    """


@hookspec
def composer_par_comm_hooks(plan: ParallelPlan) -> list[CommHook] | None:
    """Customize the collectives of one mesh dim (gradient compression, custom comms).

    Called: by validation (statically: must not import torch) and, at apply, by the
    data-parallel plugin that owns each hooked dim, in its data_parallel stage.
    Returns: :class:`~composer_par.plugin.comm.CommHook` values, each naming one mesh dim and
    giving factories (called once per apply with a :class:`~composer_par.plugin.comm.CommSetup`)
    for what to customize there:

    * on a **replicate** dim (HSDP's), ``all_reduce``: a
      :class:`~composer_par.plugin.comm.GradReducer` called once per FSDP module per backward
      with a :class:`~composer_par.plugin.comm.GradBucket` (flat gradient buffer, per-parameter
      views, the dim's process group, the divisor); it reduces the buffer in place. With
      FSDP2, FSDP2 then shards over its own dim only (a 1-D mesh) and runs the reducer
      through ``set_all_reduce_hook`` on the reduce-scatter output of every FSDP module;
      with HSDP alone, the replicate modules' own all-reduce is pointed at a 1-rank group
      and the reducer does the reduction (:mod:`composer_par.plugin.comm` says why);
    * on a **shard** dim (FSDP2's), ``all_gather`` / ``reduce_scatter``: instances of
      FSDP2's ``AllGather`` / ``ReduceScatter`` comm classes, installed on every FSDP
      module with ``set_custom_all_gather`` / ``set_custom_reduce_scatter``.

    A hook on a dim that no data-parallel plugin owns is error CP218; two plugins hooking
    one dim CP219; a collective the dim does not run CP220. ``apply`` raises if a hook was
    installed by no plugin. Installations are recorded in ``ctx.installed_comm_hooks``.
    """


@hookspec
def composer_par_block_spec(plan: ParallelPlan) -> BlockSpec | None:
    """How to find the model's blocks, if this plugin was told explicitly.

    Called: once per validate/apply; the shared block finder uses the answer. Two
    plugins answering differently is a validation error (CP208).
    Returns: a :class:`~composer_par.blocks.BlockSpec`, or None to let the finder detect.
    The base class answers it from a ``blocks`` option (``composer_par.plugin.blocks_option``),
    so a plugin with that option needs no implementation of its own.
    """


@hookspec
def composer_par_state_dict_adapter(plan: ParallelPlan, model: nn.Module) -> Any:
    """How the model's parameter names map to the names of weight files (name mapping).

    Called: by the loaders (``LoadSafetensors``, ``LoadCheckpoint``) when they validate
    and load, and by ``composer_par.checkpoint.export_safetensors(..., plan=plan)``.
    ``model`` is the model as the user built it (names without wrapper prefixes).
    Returns: an object with ``to_file(name: str) -> str`` giving the file's key for a model
    name (see :mod:`composer_par.checkpoint.adapter`), or None. The answers of several
    plugins are applied one after the other, in the plan's order. Names only: a rank reads
    just its own slice of each tensor, so adapters cannot transform tensors.
    """


@hookspec
def composer_par_parallel_style(plan: ParallelPlan, module: nn.Module, style: Any) -> Any:
    """A tensor-parallel style to apply to ``module`` in place of ``style``, for a module
    this plugin changed in the convert stage (float8's layers take torchao's float8 styles).

    Called: by a tensor-parallel plugin at apply, for each module it is about to give a
    torch ``ParallelStyle`` (``style``, already built), before ``parallelize_module``.
    Returns: a ``ParallelStyle`` with the same layouts as ``style``, or None to keep it.
    Two plugins answering for one module is an error (``RuntimeError`` naming both).
    """


# -- training ------------------------------------------------------------------------------


@hookspec
def composer_par_parameters_changed(plan: ParallelPlan, model: nn.Module) -> None:
    """The parameters of ``model`` may change before its next forward: forget what was
    derived from their values (float8's precomputed weight scales).

    Called: by ``plan.training_step`` at the start of every step and after its backward
    (an optimizer step comes next), and by the trainer adapters after every optimizer step
    they drive; on every rank at the same points. ``model`` is what ``apply`` returned (or
    a module holding it). Must be cheap, local (no collective: a rank may call it where
    another calls nothing else) and idempotent; work that needs a collective is done
    lazily, e.g. before the model's next forward, which every rank runs.
    Returns: None.
    """


@hookspec
def composer_par_step_begin(plan: ParallelPlan, model: nn.Module) -> None:
    """Before each training step's first forward, on every rank.

    Called: by :meth:`composer_par.training.TrainingStep.step` (``plan.training_step``)
    once per step, with the model ``apply`` returned. A fault-tolerant plugin forms the
    step's quorum of replica groups here, and a group that is behind takes a live peer's
    state before it computes anything.
    Returns: nothing.
    """


@hookspec
def composer_par_step_commit(plan: ParallelPlan, model: nn.Module, optimizer: Any
                             ) -> bool | None:
    """Whether the optimizer may apply this step: after backward, before the optimizer
    step, on every rank.

    Called: by :meth:`composer_par.training.TrainingStep.optimizer_step` once per step,
    with the model ``apply`` returned and the optimizer about to step; every plugin is
    asked. Returns: False to discard the step (the optimizer does not step, and the
    gradients are zeroed as after a step), True or None to let it apply. Every rank of a
    launch must get the same answer (a fault-tolerant plugin's quorum decides it).
    """


# -- stages (apply order) ----------------------------------------------------------------


@hookspec
def composer_par_convert(ctx: ApplyContext) -> str | None:
    """Stage 1: module swaps (float8, quantization, adapters) before any sharding."""


@hookspec
def composer_par_pipeline_split(ctx: ApplyContext) -> str | None:
    """Stage 1b: cut the model into pipeline stages over a pipeline mesh dim.

    Called: once per apply, after convert (so the split sees the final module types) and
    before tensor parallel. The plugin keeps only this rank's part(s) of ``ctx.model`` and
    sets ``ctx.pipeline`` (a :class:`~composer_par.plugin.pipeline.Pipeline`); every later
    stage then runs once per local part, with ``ctx.model`` and ``ctx.blocks`` that part's.
    At most one plugin may split a plan.
    """


@hookspec
def composer_par_tensor_parallel(ctx: ApplyContext) -> str | None:
    """Stage 2: ``parallelize_module`` over model-parallel mesh dims."""


@hookspec
def composer_par_activation_checkpoint(ctx: ApplyContext) -> str | None:
    """Stage 3: wrap the shared blocks for activation checkpointing (``ctx.replace_block``)."""


@hookspec
def composer_par_compile(ctx: ApplyContext) -> str | None:
    """Stage 4: per-block ``torch.compile``, after checkpoint wrapping, before FSDP."""


@hookspec
def composer_par_data_parallel(ctx: ApplyContext) -> str | None:
    """Stage 5: ``fully_shard`` bottom-up (each block, then the root) or replication."""


@hookspec(firstresult=True)
def composer_par_materialize(ctx: ApplyContext) -> str | None:
    """Stage 6: ``to_empty`` on the target device, then init or load the weights.

    Exactly one plugin may implement it in a plan (a second is error CP207). Called only
    when the model still has parameters or buffers on the meta device, or when the plugin
    is used explicitly; it must leave no tensor on meta.
    """


@hookspec
def composer_par_finalize(ctx: ApplyContext) -> str | None:
    """Stage 7: comm hooks, prefetch settings, gradient divide factors (needs FSDP modules)."""


# -- explain -----------------------------------------------------------------------------


@hookspec
def composer_par_describe(plan: ParallelPlan) -> list[tuple[str, str]] | None:
    """What this plugin will do, for ``explain()``: ``[(stage_label, text), ...]``.

    Called: by ``ParallelPlan.explain``; must not import torch. Plugins that do not
    implement it are described by the names of the stages they implement.
    """


@hookspec
def composer_par_timeline(plan: ParallelPlan, mesh: MeshSpec) -> Timeline | None:
    """What the plugin's runtime does tick by tick in one step (a pipeline schedule), for
    ``explain``: a :class:`~composer_par.plugin.pipeline.Timeline`, or None.

    Called: by ``ParallelPlan.explain`` when the mesh is resolved (``mesh`` is); unlike
    ``composer_par_describe`` it may import torch (to read a schedule's own order), so a
    plugin answers only when the plan uses what it draws.
    """


# -- estimation --------------------------------------------------------------------------
#
# ``composer-par estimate`` and ``suggest`` ask a plan's plugins in the order the plan
# applies them: the plugin that cuts the model into pipeline stages
# (composer_par_estimate_pipeline), the model-parallel plugins for the model one rank
# holds (composer_par_estimate_shape), every plugin for its own terms
# (composer_par_estimate), and a plugin whose comm hook customizes a mesh dim's
# collectives for what runs instead (composer_par_estimate_comm_hook). Before any of them,
# each plugin says how it runs where others' terms depend on it
# (composer_par_estimate_settings). The estimator adds the answers to the core's
# accounting (parameters, gradients and optimizer states as the claims' roles divide
# them; activations of the model's blocks) and turns compute and communication into a
# step time; it knows no plugin by name. ``suggest`` asks every installed plugin which
# sizes and options of its own it may take (composer_par_suggest).
#
# None of these hooks may import torch (they run on a laptop), except to read what only
# torch knows (a multi-stage pipeline schedule's order, as ``explain`` does).
# docs/writing-plugins.md ("What it costs") has a worked example, run by the tests.


@hookspec
def composer_par_estimate_settings(plan: ParallelPlan) -> EstimateSettings | None:
    """How this plugin runs, where the core's accounting or another plugin's terms
    depend on it.

    Called: by :meth:`composer_par.estimate.Layout.from_plan`, once per estimate, before
    the layout is built.
    Returns: a :class:`~composer_par.plugin.EstimateSettings` setting the fields this
    plugin decides, each left None otherwise: a data-parallel sharding plugin its
    ``reshard_after_forward`` and mixed-precision ``param_dtype`` / ``reduce_dtype``
    (dtype names), a plugin changing the matmuls' precision ``matmul_dtype`` (float8),
    a model-parallel one ``sequence_parallel`` / ``loss_parallel``, a context-parallel
    one ``sequence_split`` (each rank holds 1 / sequence_split of every sequence's
    tokens), an activation-checkpointing one ``activation_checkpoint`` (``"none"``,
    ``"selective"`` or ``"full"``), ``checkpoint_every``, ``checkpoint_reissue``,
    ``checkpoint_matmul_every``, ``checkpoint_saves_attention`` and
    ``checkpoint_saves_collectives``. Or None. The answers
    are merged in plan order, a later plugin's set field over an earlier one's; what no
    plugin sets keeps the estimator's default. The estimate never reads a plugin's
    options: what the plugin's own terms need stays with the plugin (its answer to
    ``composer_par_estimate`` reads them).
    """


@hookspec
def composer_par_estimate_pipeline(
    plan: ParallelPlan, layout: Layout, model: ModelShape, workload: Workload
) -> EstimatePipeline | None:
    """The model cut into pipeline stages, if this plugin cuts it (stage 1b's estimate).

    Called: once per estimate, first, with the whole ``model``. At most one plugin of a
    plan may answer (two are an error).
    Returns: an :class:`~composer_par.estimate.EstimatePipeline`: the mesh dim, the
    stages each coordinate runs (each an :class:`~composer_par.estimate.EstimateStage`
    with its part of ``model``, its passes per step, its all-gathers when the runtime
    decides them), the microbatches each rank holds at its heaviest moments, its
    point-to-point sends, the bubble and notes; or None. Every plugin is then asked for
    its terms once per stage (``composer_par_estimate`` with ``stage``), and each rank is
    estimated on its own; the report shows the fullest and the slowest.
    """


@hookspec
def composer_par_estimate_shape(
    plan: ParallelPlan, layout: Layout, model: ModelShape
) -> ModelShape | None:
    """The model as this plugin's transform leaves one rank's view of it (stage 2's
    estimate), when it holds part of some tensors in a way the core cannot tell from
    the claims' roles.

    Called: once per estimate (and per pipeline stage), after the pipeline, in plan
    order, each answer handed to the next plugin as ``model``. Tensors a
    model-parallel dim splits the ordinary way (a TP-style split of every matrix's
    dimension 0, ``TensorShape.tp``) need no answer: the core divides them by the
    model-parallel dims. Expert parallelism answers: each MoE block's routed experts
    move to a group of their own (``ParamGroup.apart`` names the dims they differ along,
    ``parent`` the block), holding this rank's ``num_experts / ep`` of them; data
    parallelism then shards that group over its dims without ``apart``. A plugin that
    makes data parallelism gather some tensors narrower than the parameters marks them
    (``TensorShape.gather_bytes``: float8's converted weights gather in one byte).
    Returns: the transformed :class:`~composer_par.estimate.ModelShape`, or None.
    """


@hookspec
def composer_par_estimate(
    plan: ParallelPlan, layout: Layout, model: ModelShape, workload: Workload,
    stage: EstimateStage | None,
) -> EstimatePart | None:
    """This plugin's own terms: what it costs in memory, communication and compute.

    Called: once per estimate with ``stage`` None (the whole step), and, when a plugin
    cut the model into pipeline stages (``layout.pipeline_dim``), once more per stage of
    each pipeline rank with ``stage`` that :class:`~composer_par.estimate.EstimateStage`
    and ``model`` its part. An answer for a stage depends on its part of the model, its
    passes and gathers, not on its label: stages that differ only in their label are
    asked once, and the answer serves each (a pipeline of one layer a stage repeats one
    shape on every rank). The whole-step answer then serves the report (sections,
    notes, compute) and its memory and collectives are not counted. ``layout`` is the
    :class:`~composer_par.estimate.Layout` (the resolved mesh, each mesh dim's role and
    owner, which dims cross nodes, the merged settings), ``model`` the
    :class:`~composer_par.estimate.ModelShape` as one rank holds it (after
    ``composer_par_estimate_shape``), ``workload`` the
    :class:`~composer_par.estimate.Workload` with its dtypes and checkpointing mode
    resolved. A term counts ``runs_of(workload, stage)`` forward and backward passes.
    Returns: an :class:`~composer_par.estimate.EstimatePart`, or None (nothing to add):

    * ``collectives``: :class:`~composer_par.estimate.Collective` values, per step and
      rank, on the mesh dims this plugin runs them over: kind, calls, logical payload
      bytes (see :mod:`composer_par.testing.comm_count`), the group when not the dim's
      own (``group_size``, ``nodes``) and what each runs behind (``overlap``:
      ``"compute"`` when it overlaps the step's compute, ``"none"`` when the ranks wait
      for it);
    * ``terms``: :class:`~composer_par.estimate.MemoryTerm` values, bytes per rank by
      category (``params``, ``grads``, ``optimizer``, ``activations``, ``buffers``,
      ``other``; negative for bytes moved off the device; ``transient`` when held only
      while one stage runs); ``memory``: named extra bytes (category ``other``);
    * ``compute``: :class:`~composer_par.estimate.ComputeTerm` FLOPs per rank and step
      beyond the model's forward and backward (recomputation);
    * ``activation_checkpoint``: the activation policy the plugin applies, if it decides
      it; ``sections``, ``accounting``, ``notes``: what the report shows of its terms
      (a note beginning ``"risk:"`` is repeated by ``suggest`` for the layout it picks).

    The core counts parameters, gradients and optimizer states as the roles of the
    plan's claims divide them (a shard dim and the dims folded into it, the
    model-parallel dims for the tensors they split) and the model's activations;
    everything else a plugin causes is its own to state.
    """


@hookspec
def composer_par_estimate_comm_hook(
    plan: ParallelPlan, layout: Layout, model: ModelShape, workload: Workload,
    collective: Collective,
) -> tuple[Collective, ...] | None:
    """What runs in place of ``collective`` once this plugin's comm hook customizes it.

    Called: for each collective another plugin states on a mesh dim that one of this
    plugin's :class:`~composer_par.plugin.comm.CommHook` values (``composer_par_comm_hooks``)
    customizes, for the kind it customizes (``all_reduce``, ``all_gather``,
    ``reduce_scatter``); only the hooking plugin is asked.
    Returns: the collectives that run instead (e.g. a compressed all-reduce's all-to-all
    and all-gather, keeping ``collective``'s overlap), or None to leave it as it is.
    """


@hookspec
def composer_par_suggest(
    model: ModelShape, topology: Topology, workload: Workload
) -> list[SuggestAxis] | None:
    """What ``composer-par suggest`` may try of this plugin: the sizes of its mesh dim and
    the options it may run with.

    Called: by :func:`composer_par.tools.suggest.suggest` on an instance of every installed
    plugin, made with its default options (or those given with ``--option``), once per
    suggestion; must not import torch.
    Returns: :class:`~composer_par.plugin.SuggestAxis` values, or None: each names the
    mesh dim it claims (or None: an option of the layout, as activation checkpointing's
    mode), its position in the mesh (``order``, outermost first), the sizes worth trying
    (1: without it), and ``choices(context)``: given every axis's size
    (:class:`~composer_par.plugin.SuggestContext`), the ways it can run
    (:class:`~composer_par.plugin.SuggestChoice`: a label, the plugin's options or None
    when it is not used, a preference); none: these sizes do not suit it (TP not dividing
    the heads, EP not dividing the experts). ``first_fit``: its choices run from the
    fastest to the leanest in memory (suggest keeps the first that fits).
    """
