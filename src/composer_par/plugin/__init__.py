"""Everything a plugin author touches, in one import: ``composer_par.plugin``.

The built-in plugins (FSDP2, HSDP, TP, ...) are written against exactly this package, and
so is a third party's. A plugin is a frozen attrs class deriving from :class:`Plugin`:
its fields are its options (the names a plan file uses), ``name`` is its registry name,
``rules`` its catalog of finding codes, and its methods marked ``@hookimpl`` act in the
hooks of :mod:`composer_par.plugin.hookspecs` (the reference: one docstring per hook)::

    from typing import Any, ClassVar

    import attrs

    from composer_par.plugin import Finding, Plugin, Rule, Severity, hookimpl

    @attrs.frozen
    class Freeze(Plugin):
        name: ClassVar[str] = "freeze"
        rules: ClassVar[tuple[Rule, ...]] = (Rule(
            "HELLO01", Severity.ERROR, "no parameter name starts with the prefix",
            fix="set prefix to the start of a parameter name", example='prefix = "embed"'),)

        prefix: str = attrs.field(default="embed")

        @hookimpl
        def composer_par_validate_model(self, model: Any) -> list[Finding]:
            if any(n.startswith(self.prefix) for n, _ in model.named_parameters()):
                return []
            return [Finding("HELLO01", f"no parameter name starts with {self.prefix!r}")]

        @hookimpl
        def composer_par_convert(self, ctx: Any) -> str:
            frozen = [p.requires_grad_(False) for n, p in ctx.model.named_parameters()
                      if n.startswith(self.prefix)]
            return f"froze {len(frozen)} parameter(s)"

Register it under the entry-point group ``composer_par.plugins`` and a plan file names it
with ``[[plugins]] name = "freeze"``. What the package holds:

* **The plugin**: :class:`Plugin`, :data:`hookimpl`; :class:`Claim` and :class:`Role` (the
  mesh dims a plugin owns: shard, replicate, model parallel, other), :class:`Declaration`
  (claims, ``provides``/``requires`` capabilities, ``after``/``before`` ordering, whether it
  needs blocks, its checkpointing policy), :class:`Stage` and :data:`STAGES` (the apply
  order: convert, pipeline split, tensor parallel, activation checkpoint, compile, data
  parallel, materialize, finalize).
* **Options** that check what a plan file hands in and name the option when it is wrong:
  :func:`dim_option`, :func:`blocks_option`, :func:`ordering_option`, :func:`int_option`,
  :func:`bool_option`, :func:`positive_number_option`, :func:`import_string_findings`
  (a ``"module:function"`` option checked without importing it; rule
  :data:`IMPORT_STRING_RULE`, CP224), :func:`dtype_option` (one table of dtype names for
  the project,
  :func:`dtype_name`).
* **Findings**: :class:`Finding` (code, message, fix; made inside a hook it names the
  plugin), :class:`Severity`, :class:`Rule` (a catalog entry: code, severity, meaning, fix,
  example), :class:`CodeRange` (the codes a plugin keeps for itself, its class attribute
  ``code_ranges``), :func:`did_you_mean`. Third parties use their own code prefix.
* **What hooks read**: :class:`PlanView`, the read-only view of the plan hooks receive as
  ``plan`` (mesh, topology, world size, declarations, replicate dims, comm hooks; no plugin
  objects, so no plugin reads another's options; :func:`provided` asks it whether a plugin
  provides a capability, :func:`has_data_parallel` whether one reduces gradients over the
  data-parallel dims); :class:`ApplyContext`, what stage hooks
  receive (the model, the shared blocks, the mesh, ``submesh()``, the device, the typed
  ``data_parallel_modules`` and ``installed_comm_hooks``, the plan's one hook caller as
  ``ctx.hooks``); :class:`MeshSpec`, :class:`Topology`, :class:`Block`,
  :func:`clean_name`, :func:`path_matches` (a module-path glob, ``*`` one path component),
  :func:`modules_by_clean_name` (every module by its clean name, the outer of a wrapper
  pair kept); :func:`tied_outside` (the parameters a block shares with a module outside
  it: one parameter cannot be in two FSDP units), :func:`tied_registrations` (every
  parameter registered under several names, each name with its module).
* **FSDP units beside the blocks** (:mod:`composer_par.plugin.fsdp_units`): a Hugging
  Face model's own FSDP plan read (:func:`own_units`, :class:`OwnUnit`,
  :data:`FSDP_STYLES`) and units of small parameters joined with a neighbour
  (:func:`join_small_units`, :class:`JoinedUnit`; :func:`small_remainder`: a root left
  holding small parameters only), for any plugin that shards or replicates by unit; the
  model's expert-parallel plan (:func:`expert_parallel_plan`, its ``_ep_plan``).
* **Composition values**: folded dims (:class:`FoldedDim`: a model-parallel dim data
  parallelism also reduces over, context and expert parallelism's), launch dims
  (:class:`LaunchDim`: a mesh dim whose coordinates are separate launches, fault-tolerant
  replica groups), comm hooks
  (:class:`CommHook`, :class:`CommSetup`, :class:`GradBucket`, :class:`GradReducer`,
  :func:`all_reduce_mean`; :func:`average_gradients`: a folded dim's gradients averaged
  by its own plugin when no data-parallel plugin does it; :func:`sum_gradient`: a
  tensor whose gradient is summed over a mesh dim in backward), estimates
  (:class:`EstimateSettings`, :class:`EstimatePart`, :class:`Collective`; a pipeline's
  stages: :class:`EstimatePipeline`, :class:`EstimateRank`, :class:`EstimateStage`);
  auxiliary losses (:func:`split_sequence`: a plugin that gives each rank part of every
  sequence says so, and load-balancing losses total their statistics over its ranks;
  :func:`carries`: whether a model makes its router loss through
  ``add_router_loss``, see :mod:`composer_par.aux_loss`); losses: :func:`logits_of` (the
  logits in whatever the model returned, as ``loss_fn`` is given it).
* **Files a plugin keeps**: :func:`open_regular` (a regular file opened for reading, or
  a named error at once: never a wait on a pipe), :func:`claim_directory` and
  :func:`remove_dead_directories` (a private directory that records its maker, so a
  later run removes those whose maker was killed).
* **Blocks already wrapped**: :data:`ALREADY_WRAPPED`, :data:`CHECKPOINT_MARK`,
  :func:`already_wrapped`, :func:`wrapped_block_findings`.

Five advanced modules are imported on their own, each for what a few plugins need and
most never touch (they import torch, so a plugin imports them inside its hooks or for
type checking): :mod:`composer_par.plugin.initialize` (layout-invariant initialization),
:mod:`composer_par.plugin.loader` (the weights-loader base),
:mod:`composer_par.plugin.fsdp_state` (FSDP2's comm hooks and gradient divide factors),
:mod:`composer_par.plugin.pipeline` (pipeline stages and schedule timelines) and
:mod:`composer_par.plugin.torch_private` (every private torch symbol, each reached by a
function there and checked on every supported torch release; it imports no torch
itself). Nothing else of composer_par is for plugins: the built-in plugins and contrib
import only this package and these five.

Facts pass between plugins only through hook answers and the typed fields of the context:
never import another plugin or read its options. docs/writing-plugins.md is the long
form, starting from the plugin above.
"""

from composer_par.aux_loss import carries, split_sequence
from composer_par.blocks import (
    Block,
    clean_name,
    modules_by_clean_name,
    names_near,
    path_matches,
)
from composer_par.checkpoint.claims import claim_directory, remove_dead_directories
from composer_par.checkpoint.paths import open_regular
from composer_par.dtypes import DtypeError, dtype_bytes, dtype_name

# The estimator's modules import composer_par.plugin.base, not this package: no cycle.
from composer_par.estimate.collectives import Collective
from composer_par.estimate.layout import run_nodes
from composer_par.estimate.memory import held_elements, optimizer_bytes
from composer_par.estimate.model_shape import ModelShape, ParamGroup
from composer_par.estimate.parts import (
    ComputeTerm,
    EstimatePart,
    EstimatePipeline,
    EstimateRank,
    EstimateSection,
    EstimateStage,
    MemoryTerm,
    runs_of,
)
from composer_par.estimate.timing import split_bytes
from composer_par.estimate.units import format_bytes, format_count
from composer_par.findings import CodeRange, Finding, Rule, Severity, did_you_mean
from composer_par.logging import get_logger
from composer_par.mesh import MeshSpec
from composer_par.outputs import logits_of
from composer_par.plugin.base import (
    STAGES,
    Claim,
    Declaration,
    EstimateSettings,
    FoldedDim,
    LaunchDim,
    Plugin,
    Role,
    ShardApart,
    Stage,
    hookimpl,
)
from composer_par.plugin.capabilities import has_data_parallel, provided
from composer_par.plugin.comm import (
    CommHook,
    CommSetup,
    GradBucket,
    GradReducer,
    all_reduce_mean,
)
from composer_par.plugin.context import ApplyContext
from composer_par.plugin.fsdp_units import (
    FSDP_STYLES,
    JoinedUnit,
    OwnUnit,
    join_small_units,
    own_units,
    small_remainder,
)
from composer_par.plugin.gradient_sum import sum_gradient
from composer_par.plugin.gradients import average_gradients
from composer_par.plugin.model_plans import expert_parallel_plan
from composer_par.plugin.options import (
    IMPORT_STRING_RULE,
    OptionError,
    blocks_option,
    bool_option,
    dim_option,
    dtype_option,
    import_string_findings,
    int_option,
    ordering_option,
    positive_number_option,
)
from composer_par.plugin.overlap import OVERLAP_MARKS, comm_begins, comm_ends
from composer_par.plugin.suggesting import (
    SPLIT_BACKWARD,
    SuggestAxis,
    SuggestChoice,
    SuggestContext,
)
from composer_par.plugin.view import PlanView
from composer_par.plugin.wrapping import (
    ALREADY_WRAPPED,
    CHECKPOINT_MARK,
    already_wrapped,
    wrapped_block_findings,
)
from composer_par.tables import table
from composer_par.ties import tied_outside, tied_registrations
from composer_par.topology import Topology

__all__ = [
    "ALREADY_WRAPPED",
    "CHECKPOINT_MARK",
    "FSDP_STYLES",
    "IMPORT_STRING_RULE",
    "OVERLAP_MARKS",
    "SPLIT_BACKWARD",
    "STAGES",
    "ApplyContext",
    "Block",
    "Claim",
    "CodeRange",
    "Collective",
    "CommHook",
    "CommSetup",
    "ComputeTerm",
    "Declaration",
    "DtypeError",
    "EstimatePart",
    "EstimatePipeline",
    "EstimateRank",
    "EstimateSection",
    "EstimateSettings",
    "EstimateStage",
    "Finding",
    "FoldedDim",
    "GradBucket",
    "GradReducer",
    "JoinedUnit",
    "LaunchDim",
    "MemoryTerm",
    "MeshSpec",
    "ModelShape",
    "OptionError",
    "OwnUnit",
    "ParamGroup",
    "PlanView",
    "Plugin",
    "Role",
    "Rule",
    "Severity",
    "ShardApart",
    "Stage",
    "SuggestAxis",
    "SuggestChoice",
    "SuggestContext",
    "Topology",
    "all_reduce_mean",
    "already_wrapped",
    "average_gradients",
    "blocks_option",
    "bool_option",
    "carries",
    "claim_directory",
    "clean_name",
    "comm_begins",
    "comm_ends",
    "did_you_mean",
    "dim_option",
    "dtype_bytes",
    "dtype_name",
    "dtype_option",
    "expert_parallel_plan",
    "format_bytes",
    "format_count",
    "get_logger",
    "has_data_parallel",
    "held_elements",
    "hookimpl",
    "import_string_findings",
    "int_option",
    "join_small_units",
    "logits_of",
    "modules_by_clean_name",
    "names_near",
    "open_regular",
    "optimizer_bytes",
    "ordering_option",
    "own_units",
    "path_matches",
    "positive_number_option",
    "provided",
    "remove_dead_directories",
    "run_nodes",
    "runs_of",
    "small_remainder",
    "split_bytes",
    "split_sequence",
    "sum_gradient",
    "table",
    "tied_outside",
    "tied_registrations",
    "wrapped_block_findings",
]
