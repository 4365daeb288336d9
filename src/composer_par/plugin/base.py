"""The plugin base class, claims, stages and the hook markers.

A plugin is an attrs class whose fields are its options (the same names a plan file
uses) and whose methods marked with :data:`hookimpl` act in the stages of
:mod:`composer_par.plugin.hookspecs`. Built-ins and third-party plugins use exactly this API.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import attrs
import pluggy

from composer_par.blocks import BlockSpec
from composer_par.findings import CodeRange, Rule, register_catalog

PROJECT = "composer_par"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class Stage(enum.Enum):
    """The canonical apply order (DESIGN.md section 4); the value is the hook name."""

    CONVERT = "composer_par_convert"
    PIPELINE_SPLIT = "composer_par_pipeline_split"
    TENSOR_PARALLEL = "composer_par_tensor_parallel"
    ACTIVATION_CHECKPOINT = "composer_par_activation_checkpoint"
    COMPILE = "composer_par_compile"
    DATA_PARALLEL = "composer_par_data_parallel"
    MATERIALIZE = "composer_par_materialize"
    FINALIZE = "composer_par_finalize"

    @property
    def label(self) -> str:
        return self.name.lower()


STAGES: tuple[Stage, ...] = tuple(Stage)


class Role(enum.StrEnum):
    """What a plugin does over a mesh dim it claims."""

    SHARD = "shard"  # parameters sharded over the dim (FSDP)
    REPLICATE = "replicate"  # parameters replicated, gradients all-reduced (HSDP/DDP)
    MODEL_PARALLEL = "model_parallel"  # tensor/sequence parallel: activations move
    OTHER = "other"


@attrs.frozen
class Claim:
    """A plugin's declaration that it owns a mesh dim."""

    dim: str
    role: Role


@attrs.frozen
class FoldedDim:
    """A model-parallel mesh dim over which the parameters its plugin does not split are
    equal, so data parallelism reduces their gradients over it too (the
    ``composer_par_folded_dims`` hook): context parallelism's ``cp`` (each rank a slice of
    the same samples) and expert parallelism's ``ep`` (each rank its own samples)."""

    dim: str
    # Whether ranks along the dim read different samples (ep) or the same samples, each
    # its own slice of them (cp). Only the first kind counts in the plan's data shards.
    distinct_samples: bool


@attrs.frozen
class LaunchDim:
    """A mesh dim whose coordinates are separate launches of the plan (the
    ``composer_par_launch_dims`` hook): fault-tolerant replica groups, each its own job
    with its own process group (its own ``torchrun``), which a plugin ties together
    outside torch.distributed. One launch holds the ranks of one coordinate: the plan
    lays out, checks and builds its mesh with this dim at size 1 (``plan.launch_mesh()``),
    and counts the dim in its data shards with ``index``, this launch's coordinate
    (None where it is not known: static validation)."""

    dim: str
    index: int | None = None


@attrs.frozen
class Declaration:
    """What a plugin tells the plan before anything runs (the declaration hook)."""

    plugin: str
    claims: tuple[Claim, ...] = ()
    # Capabilities: e.g. "data_parallel" (FSDP2, HSDP), "materialize" (MetaInit, loaders).
    provides: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    # Whether the plugin acts on the shared blocks (so "no blocks found" matters to it).
    needs_blocks: bool = False
    # How the plugin wraps blocks for activation checkpointing, if it does: a policy name
    # ("full", "selective", ...). Compile reads it to check its backend can trace that.
    checkpointing: str | None = None
    # The plugin's rule catalog (its class attribute ``rules``): validation reports two
    # plugins giving one code different meanings (CP222). Not part of equality.
    rules: tuple[Rule, ...] = attrs.field(default=(), eq=False, repr=False)


@attrs.frozen
class ShardApart:
    """Modules a data-parallel plugin shards as units of their own, over its mesh without
    the ``without`` dims (the ``composer_par_shard_apart`` hook).

    Their parameters differ along ``without`` (expert parallelism's experts: each ep rank
    holds other experts), and their gradients already sum over it (the model's own
    collectives bring every ep rank's tokens' contributions to the expert's holder), so
    the data-parallel plugin divides them by the number of all data shards, ``without``'s
    ranks included, instead of its own mesh's size."""

    modules: tuple[Any, ...] = attrs.field(eq=False, repr=False)
    paths: tuple[str, ...]
    without: tuple[str, ...]


@attrs.frozen
class EstimateSettings:
    """What a plugin tells ``composer-par estimate`` about how it runs, where another
    plugin's terms or the core's accounting depend on it (the
    ``composer_par_estimate_settings`` hook): each field None unless it decides it.

    The answers of a plan's plugins are merged in plan order, a later plugin's set field
    over an earlier one's; fields no plugin sets keep the estimator's defaults. What only
    the plugin's own terms need (its units, its buffers) stays in its own options.
    """

    # Data-parallel sharding (FSDP2 and the like): torch's reshard_after_forward (True,
    # False, or an int group size: a pipeline counts its stages' all-gathers from it),
    # and the mixed-precision dtypes by name.
    reshard_after_forward: bool | int | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    # The dtype the model's matrix multiplications run in, when not the parameters'
    # (float8 training): the step-time model runs them at that dtype's throughput.
    matmul_dtype: str | None = None
    # How tensor parallelism cuts a block's activations: with sequence parallelism the
    # norms' tokens too; with loss parallelism the logits' vocabulary.
    sequence_parallel: bool | None = None
    loss_parallel: bool | None = None
    # Each rank holds 1 / sequence_split of every sequence's tokens (context
    # parallelism): its activations are those of seq / sequence_split tokens.
    sequence_split: int | None = None
    # Activation checkpointing: "none", "selective" or "full", on every N-th block.
    activation_checkpoint: str | None = None
    checkpoint_every: int | None = None
    # Which of a checkpointed block's collectives its recomputation issues again:
    # "none" (their outputs are saved), "early_stop" (up to the last tensor backward
    # needs, torch's default), "all" (the whole forward's).
    checkpoint_reissue: str | None = None
    # Selective checkpointing saves the outputs of the 1st, (N+1)-th, ... matmul of each
    # block (1: every matmul's).
    checkpoint_matmul_every: int | None = None
    # Selective checkpointing saves the attention kernel's outputs (the output and its
    # log-sum-exp) instead of recomputing the attention in backward.
    checkpoint_saves_attention: bool | None = None
    # Selective checkpointing saves the outputs of the functional collectives (what
    # tensor parallelism gathers and reduces) instead of issuing them again in backward.
    checkpoint_saves_collectives: bool | None = None

    def set_fields(self) -> dict[str, Any]:
        """The fields this answer sets (not None)."""
        return {k: v for k, v in attrs.asdict(self, recurse=False).items() if v is not None}


class Plugin:
    """Base of every plugin. Subclasses are ``@attrs.frozen`` classes that set ``name``.

    Override :meth:`declare` (or the class attributes it reads) to claim mesh dims and
    state requirements; implement the stage hooks of :mod:`composer_par.plugin.hookspecs`
    as methods marked ``@hookimpl``.
    """

    name: ClassVar[str] = ""
    provides: ClassVar[frozenset[str]] = frozenset()
    requires: ClassVar[frozenset[str]] = frozenset()
    needs_blocks: ClassVar[bool] = False
    # The plugin's own rule codes (code, severity, meaning, fix, example): what its
    # findings mean, listed by `composer-par rules`. A finding made in one of its hooks
    # takes its severity from here unless it gives one. Third parties: a prefix of their
    # own (e.g. "ACME101"), so no code means two things.
    rules: ClassVar[tuple[Rule, ...]] = ()
    # The ranges of rule codes the plugin keeps for itself (PP's CP6xx); its other codes
    # lie in the core's shared ranges (CP2xx options and claims, CP3xx topology, CP4xx the
    # model). No two plugins' ranges overlap, nor one of the core's.
    code_ranges: ClassVar[tuple[CodeRange, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Known as soon as the class exists: severities are looked up without importing
        # anything else (torch included).
        register_catalog(cls)

    def claims(self) -> tuple[Claim, ...]:
        return ()

    def declare(self) -> Declaration:
        return Declaration(
            plugin=self.name,
            claims=self.claims(),
            provides=self.provides,
            requires=self.requires,
            after=tuple(getattr(self, "after", ()) or ()),
            before=tuple(getattr(self, "before", ()) or ()),
            needs_blocks=self.needs_blocks,
            rules=self.rules,
        )

    @hookimpl
    def composer_par_declare(self) -> Declaration:
        decl = self.declare()
        if isinstance(decl, Declaration) and self.rules and not decl.rules:
            # A declare() built from scratch still carries the class's catalog.
            decl = attrs.evolve(decl, rules=self.rules)
        return decl

    @hookimpl
    def composer_par_block_spec(self) -> BlockSpec | None:
        # Plugins with a ``blocks`` option (see blocks_option) tell the shared block finder.
        return BlockSpec.parse(getattr(self, "blocks", None))

    # -- options (the plan file's view of the plugin) ----------------------------------

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        if not attrs.has(cls):
            return ()
        return tuple(f.alias for f in attrs.fields(cls))  # type: ignore[arg-type]

    def options(self, *, include_defaults: bool = False) -> dict[str, Any]:
        """The options that differ from their defaults, in plan-file form."""
        if not attrs.has(type(self)):
            return {}
        out: dict[str, Any] = {}
        for f in attrs.fields(type(self)):  # type: ignore[arg-type, misc]
            value = getattr(self, f.name)
            default = f.default
            if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                default = default.factory()  # type: ignore[attr-defined]
            # The type check keeps e.g. 1 where the default is True (1 == True).
            if include_defaults or type(value) is not type(default) or value != default:
                out[f.alias] = _plain(value)
        return out

    @classmethod
    def stages(cls) -> tuple[Stage, ...]:
        """The stages this plugin class implements, in apply order (an implementation
        named otherwise counts through pluggy's ``specname``)."""
        hooks = set()
        for attr in dir(cls):
            opts = getattr(getattr(cls, attr, None), f"{PROJECT}_impl", None)
            if isinstance(opts, dict):
                hooks.add(opts.get("specname") or attr)
        return tuple(s for s in STAGES if s.value in hooks)


def _plain(value: Any) -> Any:
    """Option values as a plan file writes them (nested attrs objects become tables)."""
    if attrs.has(type(value)):
        fields = attrs.asdict(value, recurse=False)
        return {k: _plain(v) for k, v in fields.items() if v is not None}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
