"""The ``compress`` plugin: compress the gradient all-reduce over a plan's replicate dim.

It claims no mesh dim and acts in no transform stage: it answers the composition hook
``composer_par_comm_hooks`` with one :class:`~composer_par.plugin.comm.CommHook` on its ``dim``,
and the data-parallel plugin that owns that dim (HSDP, with or without FSDP2) installs
it on every FSDP module. Its own validation rules have the prefix ``CPC``: the class
attribute ``rules`` (:data:`CATALOG`), documented in the README and docs/rules.md.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from composer_par.plugin import (
    CodeRange,
    CommHook,
    CommSetup,
    DtypeError,
    Finding,
    GradReducer,
    Plugin,
    Role,
    Rule,
    Severity,
    bool_option,
    dim_option,
    dtype_name,
    hookimpl,
    int_option,
)

if TYPE_CHECKING:
    import torch.nn as nn
    from composer_par.plugin import ApplyContext, MeshSpec, PlanView

METHODS = ("none", "bf16", "fp16", "powersgd")
# A dtype spelled any way composer_par accepts ("bfloat16", "BF16", "half") names the
# low-precision method sending in it.
_BY_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}

# The plugin's own rule codes (documented in the README and docs/rules.md, tested in
# tests/).
CATALOG: tuple[Rule, ...] = (
    Rule("CPC101", Severity.ERROR, "compression on a plan that replicates over no mesh dim",
         "replicate across nodes with HSDP and point dim at its replicate dim, or drop the "
         "compress plugin",
         '[mesh]\ndp_shard = 4\n\n[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\n'
         'name = "compress"\nmethod = "powersgd"\n'),
    Rule("CPC102", Severity.WARNING, "the replicate dim has size 1: nothing to compress",
         "drop the compress plugin on single-node runs, or grow the replicate dim",
         '[mesh]\ndp_replicate = 1\ndp_shard = 4\n\n[[plugins]]\nname = "hsdp"\n\n'
         '[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\nname = "compress"\n'),
    Rule("CPC103", Severity.WARNING, "PowerSGD finds no parameter large enough to compress",
         'lower min_compress_numel or rank, or use method = "bf16"',
         "ParallelPlan(MeshSpec(dp_replicate=2)).use(HSDP()).use(Compress(method=\"powersgd\"))"
         ".use(MetaInit()).validate(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1)))"),
)
# code -> (severity, title), as earlier versions exported it.
RULES: dict[str, tuple[Severity, str]] = {r.code: (r.severity, r.title) for r in CATALOG}


def _method(value: Any) -> str:
    name = value.lower() if isinstance(value, str) else value
    if name == "off":
        name = "none"
    elif isinstance(value, str) and name not in METHODS:
        with contextlib.suppress(DtypeError):  # not a dtype either: refused below
            name = _BY_DTYPE.get(dtype_name(value), name)
    if name not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}; got {value!r}")
    return str(name)


@attrs.frozen
class Compress(Plugin):
    """Gradient compression of the replicate dim's all-reduce.

    Options:

    * ``method``: ``"bf16"`` / ``"fp16"`` (each rank's gradient is sent in 16 bits and
      summed in fp32: an all-to-all of the compressed chunks, a local fp32 sum, an
      all-gather of the 16-bit result), ``"powersgd"`` (rank-``rank`` approximation with
      error feedback), or ``"none"`` (no hook at all: exactly the plan without it);
    * ``dim``: the replicate mesh dim (default ``dp_replicate``);
    * PowerSGD: ``rank`` (4), ``min_compress_numel`` (tensors with fewer elements, and
      any tensor a rank-``rank`` factorization would not shrink at least 2x, are sent
      uncompressed; 4096), ``start_step`` (plain all-reduce before it; 0),
      ``error_feedback`` (true), ``warm_start`` (reuse last step's Q; true), ``seed``
      (of the initial Q; identical on every rank).
    """

    name: ClassVar[str] = "compress"
    requires: ClassVar[frozenset[str]] = frozenset({"data_parallel"})
    rules: ClassVar[tuple[Rule, ...]] = CATALOG
    code_ranges: ClassVar[tuple[CodeRange, ...]] = (
        CodeRange("CPC", 101, 199, "gradient compression on the replicate dim"),)

    method: str = attrs.field(default="bf16", converter=_method)
    dim: str = dim_option("dp_replicate")
    rank: int = int_option(4, low=1)
    min_compress_numel: int = int_option(4096, low=0)
    start_step: int = int_option(0, low=0)
    error_feedback: bool = bool_option(True)
    warm_start: bool = bool_option(True)
    seed: int = int_option(0, low=0)

    # -- composition ---------------------------------------------------------------------

    @hookimpl
    def composer_par_comm_hooks(self) -> list[CommHook]:
        if self.method == "none":
            return []  # configured off: the plan runs exactly as without this plugin
        return [CommHook(self.dim, all_reduce=self.reducer, description=self.summary())]

    @hookimpl
    def composer_par_estimate_comm_hook(self, layout: Any, model: Any, workload: Any,
                                        collective: Any) -> tuple[Any, ...] | None:
        """What the compressed all-reduce sends in place of the replicate dim's."""
        from composer_par.plugin import dtype_bytes

        from composer_par_compress.estimate import low_precision, powersgd

        if self.method == "none" or collective.kind != "all_reduce":
            return None
        group = collective.group_size or layout.mesh.size(collective.dim)
        if self.method == "powersgd":
            return powersgd(collective, model, layout.tensor_parallel_size(),
                            layout.shard_size(), self.rank, self.min_compress_numel)
        return low_precision(collective, group, dtype_bytes(workload.reduce_dtype),
                             self.method)

    @hookimpl
    def composer_par_suggest(self) -> list[Any]:
        """Its method on the replicate dim it hooks, when that dim has ranks: with and
        without it; opt-in (it changes the gradients training sees)."""
        from composer_par.plugin import SuggestAxis, SuggestChoice

        if self.method == "none":
            return []
        own = self.options()
        label = f"compress {self.method}"

        def choices(ctx: Any) -> list[Any]:
            if ctx.size(self.dim) < 2:
                return [SuggestChoice()]
            return [SuggestChoice(), SuggestChoice(label, own)]

        return [SuggestAxis(self.name, None, 70, (1,), choices, opt_in=True)]

    def reducer(self, setup: CommSetup) -> GradReducer:
        """The reducer for one apply (called by the owner of ``dim`` through the hook)."""
        if self.method == "powersgd":
            from composer_par_compress.powersgd import PowerSGD

            return PowerSGD(rank=self.rank, min_compress_numel=self.min_compress_numel,
                            start_step=self.start_step, error_feedback=self.error_feedback,
                            warm_start=self.warm_start, seed=self.seed)
        import torch

        from composer_par_compress.lowp import LowPrecisionAllReduce

        dtype = torch.bfloat16 if self.method == "bf16" else torch.float16
        return LowPrecisionAllReduce(dtype)

    def summary(self) -> str:
        if self.method == "powersgd":
            return (f"PowerSGD rank {self.rank} with"
                    f"{'' if self.error_feedback else 'out'} error feedback (tensors under "
                    f"{self.min_compress_numel} elements uncompressed)")
        if self.method == "none":
            return "no compression"
        return f"{self.method} transfer with fp32 accumulation"

    # -- validation ----------------------------------------------------------------------

    @hookimpl
    def composer_par_validate_plan(self, plan: PlanView, mesh: MeshSpec) -> list[Finding]:
        if self.method == "none":
            return []
        decls = plan.declarations()
        replicated = [(d.plugin, c.dim) for d in decls for c in d.claims
                      if c.role is Role.REPLICATE and c.dim in mesh]
        found: list[Finding] = []
        if self.dim not in {dim for _, dim in replicated}:
            shards = [f"{d.plugin} shards over {c.dim}" for d in decls for c in d.claims
                      if c.role is Role.SHARD and c.dim in mesh]
            context = (f" ({'; '.join(shards)}: those gradients are reduce-scattered, which "
                       f"{self.method} does not compress)") if shards else ""
            others = [dim for _, dim in replicated]
            fix = (f"set dim = {others[0]!r}" if others else
                   "replicate across nodes with HSDP (e.g. [mesh] dp_replicate = <nodes>, "
                   "dp_shard = <devices per node>, and the hsdp plugin)")
            found.append(Finding(
                "CPC101",
                f"{self.method} compresses the gradient all-reduce over a replicate dim, and "
                f"no plugin replicates over {self.dim!r}{context}",
                fix=f"{fix}, or drop the compress plugin",
            ))
        elif mesh.is_resolved and mesh.size(self.dim) == 1:
            found.append(Finding(
                "CPC102",
                f"replicate dim {self.dim!r} has size 1: no gradient crosses it, so "
                f"{self.method} saves nothing and only adds work",
                fix=f"drop the compress plugin, or grow {self.dim}",
            ))
        return found

    @hookimpl
    def composer_par_validate_model(self, model: nn.Module) -> list[Finding]:
        if self.method != "powersgd":
            return []
        from composer_par_compress.powersgd import compressible

        shapes = [tuple(p.shape) for p in model.parameters()]
        if any(compressible(s, self.rank, self.min_compress_numel) for s in shapes):
            return []
        largest = max(shapes, key=lambda s: _numel(s), default=())
        return [Finding(
            "CPC103",
            f"PowerSGD rank {self.rank} compresses no parameter of {type(model).__name__}: "
            f"none has >= {self.min_compress_numel} elements and a rank-{self.rank} "
            f"factorization at least 2x smaller (largest: {list(largest)}); every "
            "gradient would be sent uncompressed",
            fix="lower min_compress_numel or rank, or use method = \"bf16\"",
        )]

    # -- explain and apply ---------------------------------------------------------------

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        if self.method == "none":
            return [("finalize", "compression configured off: no comm hook")]
        return [("data_parallel", f"comm hook on {self.dim}'s gradient all-reduce: "
                 f"{self.summary()}")]

    @hookimpl
    def composer_par_finalize(self, ctx: ApplyContext) -> str:
        if self.method == "none":
            return "compression off"
        records = [r for r in ctx.installed_comm_hooks
                   if r.plugin == self.name and r.dim == self.dim]
        modules = sum(r.modules for r in records)
        owners = ", ".join(sorted({r.owner for r in records})) or "nobody"
        return (f"{self.summary()} on {self.dim}({ctx.mesh.size(self.dim)}): "
                f"{modules} FSDP module(s), installed by {owners}")


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out
