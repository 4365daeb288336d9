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
    from composer_par.estimate import EstimatePart, Layout, ModelShape, Workload
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


@hookspec
def composer_par_estimate(
    plan: ParallelPlan, layout: Layout, model: ModelShape, workload: Workload
) -> EstimatePart | None:
    """This plugin's own terms of ``composer-par estimate`` (memory and communication).

    Called: by :func:`composer_par.estimate.estimate_plan` (the ``estimate`` and
    ``suggest`` commands), once per estimate; must not import torch, except to read
    what only torch knows (the pipeline plugin reads a multi-stage schedule's order from
    torch's schedule classes, as ``explain`` does). ``layout`` is the
    :class:`~composer_par.estimate.Layout` (the resolved mesh, each mesh dim's role and
    owner, which dims cross nodes), ``model`` the
    :class:`~composer_par.estimate.ModelShape` (sizes and parameter groups), ``workload``
    the :class:`~composer_par.estimate.Workload` (sequence, micro-batch, dtypes,
    optimizer).
    Returns: an :class:`~composer_par.estimate.EstimatePart`, or None to let the built-in
    estimator of the role of each mesh dim this plugin claims apply (shard: FSDP,
    replicate: HSDP / DDP, model parallel: TP). A part's ``collectives`` (logical payload
    bytes per step and rank, see :mod:`composer_par.testing.comm_count`) replace the
    built-in estimate of the plugin's claimed dims; ``memory`` adds per-rank bytes;
    ``activation_checkpoint`` states the activation policy the plugin applies.
    """


@hookspec
def composer_par_estimate_settings(plan: ParallelPlan) -> EstimateSettings | None:
    """How this plugin runs, as far as it changes ``composer-par estimate``.

    Called: by :meth:`composer_par.estimate.Layout.from_plan` (the ``estimate`` and
    ``suggest`` commands), once per estimate, before the layout is built; must not
    import torch.
    Returns: a :class:`~composer_par.plugin.EstimateSettings` setting the fields this
    plugin decides, each left None otherwise: a data-parallel sharding plugin its
    ``reshard_after_forward`` and mixed-precision ``param_dtype`` / ``reduce_dtype``
    (dtype names), a model-parallel one ``sequence_parallel`` / ``loss_parallel``, a
    context-parallel one ``sequence_split`` (each rank holds 1 / sequence_split of every
    sequence's tokens), an expert-parallel one ``experts_dim`` (the mesh dim whose ranks
    each hold num_experts / its size of every routed experts tensor) and
    ``experts_split`` (the mesh dim that splits each expert's weights further), an
    activation-checkpointing one ``activation_checkpoint`` (``"none"``, ``"selective"``
    or ``"full"``) and ``checkpoint_every``. Or None. The answers are merged in plan
    order, a later plugin's set field over an earlier one's; what no plugin sets keeps
    the estimator's default (torch's reshard default, the workload's dtypes, no
    sequence or loss parallelism, the declared ``checkpointing`` policy if any).
    This is how the estimate learns these facts: it never reads a plugin's options.
    """
