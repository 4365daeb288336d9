"""Compile: ``torch.compile`` each shared block, after checkpointing, before FSDP.

Per block and in place (``block.compile()``): ``torch.compile(module)`` would return an
``OptimizedModule`` whose parameter names start with ``_orig_mod.``; ``Module.compile``
compiles the block's call and leaves the module tree and its names untouched. Compiling
blocks before ``fully_shard`` keeps FSDP's hooks out of the graphs (FSDP2 marks its hooks
dynamo-disabled), and after activation checkpointing so the checkpoint is traced as one
region of the block's graph.

On CPU (torch 2.13, gcc) inductor compiles a small Llama block's forward and backward,
but a first step with a cold cache builds C++ kernels in every process, too slow for the
CI's distributed tests, which use ``backend="aot_eager"`` (the same capture, no code
generation); docs/activation-checkpointing.md has the times.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    ALREADY_WRAPPED,
    Finding,
    Plugin,
    Role,
    Rule,
    Severity,
    blocks_option,
    bool_option,
    did_you_mean,
    hookimpl,
    ordering_option,
    wrapped_block_findings,
)

if TYPE_CHECKING:
    from composer_par.plugin import ApplyContext, Block, MeshSpec, PlanView

# torch.compile's modes; each configures inductor, and torch hands ``mode`` to whatever
# backend is named, so with another backend the first forward fails with a TypeError.
INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# Backends under which selective activation checkpointing (a checkpoint with a
# ``context_fn``) was measured to train correctly on torch 2.13: dynamo traces the
# checkpoint as a higher-order op that these run through AOTAutograd or eagerly.
SELECTIVE_AC_BACKENDS = frozenset({
    "inductor", "aot_eager", "eager", "aot_eager_decomp_partition",
    "aot_eager_default_partitioner",
})


# Backends that run the captured graph through AOTAutograd. Under tensor parallelism
# (torch 2.13, measured on gloo; tests/test_composition.py) AOTAutograd mishandles a
# compiled block whose input is TP's ``to_local()`` output (a view of a DTensor's local
# tensor): backward fails (TP alone: "'Tensor' object has no attribute '_local_tensor'")
# or, under FSDP2 x TP, the first block's input gradient is lost without an error (the
# token embedding trains on zeros); and a checkpointed attention block (SDPA) fails in
# its first forward (a DeviceMesh among the tensors saved for backward). ``eager``
# (dynamo's capture, no AOTAutograd) trains at parity. Rule CP221.
AOT_BACKEND_PREFIXES = ("aot_", "inductor")


RULES = (
    Rule("CP217", Severity.ERROR, "a compile mode with a backend other than inductor",
         'drop mode, or use backend = "inductor"',
         '[mesh]\ndp_shard = 2\n\n[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\n'
         'name = "compile"\nbackend = "aot_eager"\nmode = "max-autotune"\n'),
    Rule("CP221", Severity.ERROR, "compile through AOTAutograd under tensor parallelism",
         'use backend = "eager" (dynamo capture without AOTAutograd), or drop compile or '
         "the tensor-parallel plugin",
         '[mesh]\ndp_shard = 2\ntp = 2\n\n[[plugins]]\nname = "tp"\n\n[[plugins]]\n'
         'name = "fsdp2"\n\n[[plugins]]\nname = "compile"\nbackend = "aot_eager"\n'),
    Rule("CP410", Severity.ERROR, "the compile backend is not registered with torch",
         "use a registered backend (torch.compiler.list_backends(exclude_tags=()) lists "
         "them), or register yours before validating",
         'ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Compile(backend="inductr"))'
         ".use(MetaInit()).validate(model)"),
    ALREADY_WRAPPED,
    Rule("CP412", Severity.ERROR, "inductor on CPU finds no C++ compiler",
         'install g++ (or set CXX to a C++ compiler), or use backend = "aot_eager"',
         "# on a CPU machine without g++:\n"
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Compile()).use(MetaInit())"
         ".validate(model)"),
    Rule("CP413", Severity.WARNING, "selective checkpointing under an unverified backend",
         'use a backend verified with selective checkpointing (inductor, aot_eager, eager), '
         'or mode = "full" for activation checkpointing',
         'plan.use(ActivationCheckpoint(mode="selective")).use(Compile(backend="my_backend"))'
         ".validate(model)"),
)


def _mode(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and value not in INDUCTOR_MODES:
        raise ValueError(f"mode must be one of {list(INDUCTOR_MODES)} or None; got {value!r}")


def _backend(instance: Any, attribute: Any, value: Any) -> None:
    if not (isinstance(value, str) and value) and not callable(value):
        raise ValueError(f"backend must be a backend name or a callable; got {value!r}")


def backend_name(backend: Any) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


@attrs.frozen
class Compile(Plugin):
    """Per-block ``torch.compile`` (stage ``compile``).

    Options: ``backend`` (default ``"inductor"``; a registered backend name, or a callable
    from Python); ``mode`` (an inductor mode, only with the inductor backend);
    ``fullgraph`` (fail on graph breaks instead of splitting); ``blocks``.
    """

    name: ClassVar[str] = "compile"
    needs_blocks: ClassVar[bool] = True
    rules: ClassVar[tuple[Rule, ...]] = RULES

    mode: str | None = attrs.field(default=None, validator=_mode)
    fullgraph: bool = bool_option(False)
    backend: Any = attrs.field(default="inductor", validator=_backend)
    blocks: str | tuple[str, ...] | None = blocks_option()
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    @hookimpl
    def composer_par_validate_plan(self, plan: PlanView, mesh: MeshSpec) -> list[Finding]:
        found = []
        name = backend_name(self.backend)
        split = _model_parallel_dims(plan, mesh)
        if split and isinstance(self.backend, str) and name.startswith(AOT_BACKEND_PREFIXES):
            who, dim = split[0]
            found.append(Finding(
                "CP221",
                f"compile backend {name!r} runs each block through AOTAutograd, which on "
                f"torch 2.13 mishandles blocks that {who} splits over mesh dim {dim}: their "
                "backward fails, or (under FSDP2) trains on wrong gradients without an "
                "error; checkpointed attention blocks fail in forward",
                fix='use backend = "eager" (dynamo capture without AOTAutograd: measured at '
                "parity with tensor parallelism, with and without activation "
                f"checkpointing), or drop compile or {who}",
            ))
        if self.mode is not None and name != "inductor":
            found.append(Finding(
                "CP217",
                f"mode={self.mode!r} is an inductor mode, and the backend is {name!r}: torch "
                "passes mode to the backend, whose first forward then fails",
                fix='drop mode, or use backend = "inductor"',
            ))
        return found

    @hookimpl
    def composer_par_validate_model(
        self, plan: PlanView, blocks: list[Block]
    ) -> list[Finding]:
        policies = [d.checkpointing for d in plan.declarations() if d.checkpointing]
        # A checkpointing plugin reports already-wrapped blocks itself.
        found = wrapped_block_findings(blocks) if not policies else []
        name = backend_name(self.backend)
        if isinstance(self.backend, str):
            import torch.compiler

            known = torch.compiler.list_backends(exclude_tags=())
            if name not in known:
                usual = sorted({*torch.compiler.list_backends(), "aot_eager", "eager"})
                found.append(Finding(
                    "CP410",
                    f"compile backend {name!r} is not registered with torch"
                    f"{did_you_mean(name, known)}",
                    fix=f"use a registered backend, e.g. one of {usual} (all: "
                    "torch.compiler.list_backends(exclude_tags=()))",
                ))
            elif name == "inductor" and not _is_cuda(plan) and _missing_cxx() is not None:
                found.append(Finding(
                    "CP412",
                    f"inductor on CPU builds C++ kernels and finds no C++ compiler "
                    f"({_missing_cxx()})",
                    fix='install g++ (or set CXX to a C++ compiler), or use backend = '
                    '"aot_eager"',
                ))
        if "selective" in policies and name not in SELECTIVE_AC_BACKENDS:
            found.append(Finding(
                "CP413",
                f"selective activation checkpointing under compile backend {name!r}, which is "
                "not known to support a checkpoint context_fn",
                fix=f"use one of {sorted(SELECTIVE_AC_BACKENDS)}, or mode = \"full\" for "
                "activation checkpointing",
            ))
        return found

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        opts = ", ".join(f"{k}={v}" for k, v in self.options().items() if k not in ("blocks",))
        return [("compile", "torch.compile each block in place" + (f" ({opts})" if opts else ""))]

    @hookimpl
    def composer_par_compile(self, ctx: ApplyContext) -> str:
        kwargs: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        for _, block in ctx.blocks:
            block.compile(**kwargs)
        ctx.notes["compiled_blocks"] = [path for path, _ in ctx.blocks]
        return f"torch.compile on {len(ctx.blocks)} block(s), backend {backend_name(self.backend)}"


def _model_parallel_dims(plan: PlanView, mesh: MeshSpec) -> list[tuple[str, str]]:
    """(plugin, dim) of every model-parallel claim on a mesh dim not of size 1."""
    return [(d.plugin, c.dim) for d in plan.declarations() for c in d.claims
            if c.role is Role.MODEL_PARALLEL and c.dim in mesh and mesh.size(c.dim) != 1]


def _is_cuda(plan: PlanView) -> bool:
    import torch

    if plan.device is not None:
        return torch.device(plan.device).type == "cuda"
    return torch.cuda.is_available()


def _missing_cxx() -> str | None:
    """Why inductor's C++ compiler cannot be found, or None when it can."""
    from composer_par.plugin import torch_private

    candidates = torch_private.inductor_cxx()
    if candidates is None:  # an inductor without this config: let torch report it
        return None
    names = [c for c in candidates if c]
    if any(shutil.which(c) for c in names):
        return None
    return f"looked for {names}; set CXX to override"


__all__ = ["Compile"]
