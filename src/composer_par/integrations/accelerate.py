"""Hugging Face accelerate running a composer_par plan.

    from composer_par.integrations.accelerate import prepare_accelerator

    accelerator, model = prepare_accelerator(plan, model)    # checks, mesh, plan.apply
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:                                     # the loop is accelerate's own
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state("ckpt")                           # composer_par's checkpoint layout

:class:`PlanAccelerator` is an ``accelerate.Accelerator`` whose mesh is the plan's: the
plan's DeviceMesh is preset on a ``ParallelismConfig`` whose sizes mirror the plan's
mesh dims (shard, replicate and model-parallel roles), so accelerate's rank properties
and the Trainer's token counting see the same layout the plan runs on. The plan owns the
parallelism; what accelerate would do a second time is turned off:

* ``prepare`` adopts the plan's model as it is: no DDP or FSDP wrapping, no TP
  re-sharding, no device move or dtype cast (accelerate's own FSDP2 path would swap the
  optimizer's parameters for placeholders and map them back by pointer);
* data loaders are sharded by ``plan.data_shard()``: ranks that differ only in a
  model-parallel mesh dim read the same samples (accelerate's split over all processes
  would give every TP rank other data);
* ``gather_for_metrics`` returns each data shard's samples once (accelerate's would
  repeat them once per rank reading the shard);
* ``clip_grad_norm_`` is :func:`composer_par.training.clip_grad_norm_`, one norm over
  parameters on any meshes;
* ``save_state`` / ``load_state`` write and read :mod:`composer_par.checkpoint`'s
  sharded layout (accelerate's would have rank 0 save full state dicts of DTensors).

Settings that overlap a plugin of the plan, or that the plan cannot run under, are
refused before anything is built (:func:`accelerate_findings`, codes CP711-CP719).
This module imports accelerate only when an accelerator is made: ``PlanAccelerator``
lives in a module of its own that imports accelerate, loaded when the class is first
asked for; ``import composer_par`` never imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from composer_par.findings import Finding
from composer_par.plugin import Role, Stage

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.integrations._plan_accelerator import PlanAccelerator
    from composer_par.plan import ParallelPlan

TRAINER = "accelerate"

# Environment variables `accelerate launch` (and its config file) set; a plan run under
# such a launch must be refused the same as the keyword arguments.
_ENV_FSDP = "ACCELERATE_USE_FSDP"
_ENV_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
_ENV_MEGATRON = "ACCELERATE_USE_MEGATRON_LM"
_ENV_AC = "FSDP_ACTIVATION_CHECKPOINTING"
_ENV_RAM = "FSDP_CPU_RAM_EFFICIENT_LOADING"
_ENV_DYNAMO = "ACCELERATE_DYNAMO_BACKEND"
_ENV_PRECISION = "ACCELERATE_MIXED_PRECISION"
_ENV_PARALLELISM = "ACCELERATE_USE_PARALLELISM_CONFIG"
_ENV_CP = "PARALLELISM_CONFIG_CP_SIZE"
_ENV_SP = "PARALLELISM_CONFIG_SP_SIZE"


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "1"))
    except ValueError:
        return 1


# -- what the plan is --------------------------------------------------------------------


def mirrored_sizes(plan: ParallelPlan, world_size: int) -> dict[str, int]:
    """The plan's mesh as accelerate's ``ParallelismConfig`` sizes: the dims the plan
    shards over (``dp_shard_size``), replicates over (``dp_replicate_size``) and splits
    the model over (``tp_size``), each the product of those mesh dims' sizes."""
    mesh = plan.mesh.resolve(world_size)
    roles: dict[str, Role] = {}
    for declaration in plan.hooks.declarations():
        for claim in declaration.claims:
            roles[claim.dim] = claim.role
    sizes = {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1}
    field = {Role.SHARD: "dp_shard_size", Role.REPLICATE: "dp_replicate_size",
             Role.MODEL_PARALLEL: "tp_size"}
    for name in mesh.names:
        key = field.get(roles.get(name, Role.OTHER))
        if key is not None:
            sizes[key] *= mesh.size(name)
    return sizes


def _has_pipeline(plan: ParallelPlan) -> bool:
    return bool(plan.hooks.implementers(Stage.PIPELINE_SPLIT))


def _plan_has(plan: ParallelPlan, name: str) -> bool:
    return plan.plugin(name) is not None


def plan_findings(plan: ParallelPlan, world_size: int | None, trainer: str) -> list[Finding]:
    """The plan's own errors, a process count that does not fit its mesh (CP711) and a
    pipeline the trainer's loop cannot run (CP718)."""
    findings = [f for f in plan.validate(world_size=world_size).findings
                if f.severity.value == "error"]
    if world_size is not None:
        problem = plan.mesh.check_world_size(world_size)
        if problem is not None:
            findings.append(Finding(
                "CP711", f"{trainer} runs {world_size} process(es) and the plan's mesh does "
                f"not fit them: {problem}", plugin=trainer,
                fix="launch as many processes as the plan's mesh holds, or give one mesh dim "
                "the size -1 so that the plan takes the world size"))
    if _has_pipeline(plan):
        findings.append(Finding(
            "CP718", f"the plan splits the model into pipeline stages, and {trainer}'s loop "
            "calls the whole model forward and then backward on one batch: it cannot run a "
            "pipeline schedule", plugin=trainer,
            fix="train a pipeline plan with its own loop: step = plan.training_step(model, "
            "loss_fn); loss = step.step(inputs, targets); step.clip_grad_norm_(...); "
            "optimizer.step() (composer_par.checkpoint for checkpoints), or drop the pp "
            "plugin to run inside the trainer"))
    return findings


# -- what accelerate is told ---------------------------------------------------------------


def accelerate_findings(plan: ParallelPlan, settings: Mapping[str, Any],
                        trainer: str = TRAINER) -> list[Finding]:
    """Every setting of ``Accelerator(**settings)`` (and of the launch environment) that
    would do a plugin's job a second time or that the plan cannot run under."""
    findings: list[Finding] = []

    def add(code: str, message: str, fix: str) -> None:
        findings.append(Finding(code, message, fix=fix, plugin=trainer))

    fsdp_plugin = settings.get("fsdp_plugin")
    uses_fsdp = fsdp_plugin is not None or _env_true(_ENV_FSDP)
    sharding = [what for what, on in (
        ("an FSDP plugin (fsdp_plugin, fsdp / fsdp_config, or ACCELERATE_USE_FSDP)", uses_fsdp),
        ("DeepSpeed", settings.get("deepspeed_plugin") is not None
         or settings.get("deepspeed_plugins") is not None or _env_true(_ENV_DEEPSPEED)),
        ("Megatron-LM", settings.get("megatron_lm_plugin") is not None
         or _env_true(_ENV_MEGATRON)),
        ("accelerate's tensor parallelism (torch_tp_plugin)",
         settings.get("torch_tp_plugin") is not None),
    ) if on]
    if sharding:
        add("CP714", f"{trainer} is set to shard or wrap the model itself with "
            f"{' and '.join(sharding)}, and the plan already shards it (its data_parallel "
            "stage wraps every block, auto-wrap would wrap them a second time)",
            "remove the FSDP / DeepSpeed / Megatron-LM / TP settings (and accelerate "
            "launch's distributed_type FSDP): the plan's FSDP2, HSDP and TP plugins shard")
    ac = bool(getattr(fsdp_plugin, "activation_checkpointing", False)) or (
        uses_fsdp and _env_true(_ENV_AC))
    if ac:
        where = ("the plan checkpoints its blocks already (activation_checkpoint)"
                 if _plan_has(plan, "activation_checkpoint")
                 else "it would wrap blocks after the plan sharded them, outside the apply order")
        add("CP712", f"{trainer}'s own activation checkpointing is on: {where}",
            "turn it off and add ActivationCheckpoint() (mode full or selective) to the plan")
    ram = bool(getattr(fsdp_plugin, "cpu_ram_efficient_loading", False)) or _env_true(_ENV_RAM)
    if ram:
        add("CP715", "CPU-RAM-efficient loading is on: rank 0 loads the full weights and "
            "broadcasts them to the other ranks' FSDP shards, which gives tensor-parallel "
            "ranks the wrong parts and skips the plan's materialization",
            "turn it off (fsdp_config cpu_ram_efficient_loading, "
            f"{_ENV_RAM}); build the model on meta and load with LoadSafetensors or "
            "initialize with MetaInit: each rank then reads only its own shards")
    dynamo = settings.get("dynamo_plugin")
    backend = settings.get("dynamo_backend") or getattr(dynamo, "backend", None) or (
        os.environ.get(_ENV_DYNAMO))
    backend_name = str(getattr(backend, "value", backend) or "no").lower()
    if backend_name not in ("no", "none"):
        where = ("the plan compiles its blocks already (compile)" if _plan_has(plan, "compile")
                 else "it would compile the whole sharded model, FSDP's hooks inside the graph")
        add("CP713", f"{trainer} is set to torch.compile the model (backend {backend_name}): "
            f"{where}", "turn accelerate's / the Trainer's compile off and add Compile() to "
            "the plan: it compiles each block after checkpointing and before sharding")
    config = settings.get("parallelism_config")
    cp = max(int(getattr(config, "cp_size", 1) or 1),
             _env_int(_ENV_CP) if _env_true(_ENV_PARALLELISM) else 1)
    sp = max(int(getattr(config, "sp_size", 1) or 1),
             _env_int(_ENV_SP) if _env_true(_ENV_PARALLELISM) else 1)
    if cp > 1 or sp > 1:
        what = " and ".join(x for x, n in (("context parallelism", cp),
                                           ("sequence parallelism", sp)) if n > 1)
        add("CP716", f"{trainer} is set to {what} (cp_size {cp}, sp_size {sp}); a plan "
            "splits sequences with its own plugins, over its own mesh dims",
            "set cp_size and sp_size to 1; for sequence parallelism inside tp use "
            "TP(sequence_parallel=True), for long sequences the plan's CP plugin (each "
            "rank then takes its part of every sample: docs/cp.md)")
    precision = settings.get("mixed_precision") or os.environ.get(_ENV_PRECISION) or "no"
    precision = str(getattr(precision, "value", precision)).lower()
    if precision != "no":
        fsdp2 = plan.plugin("fsdp2")
        where = ("the plan's FSDP2 sets its own mixed precision"
                 if getattr(fsdp2, "mixed_precision", None) is not None
                 else "autocast would wrap a model the plan already built, and its casts "
                 "are not part of the plan")
        add("CP717", f"{trainer}'s mixed precision is {precision!r}: {where}",
            "set mixed_precision='no' (Trainer: bf16/fp16 off) and give FSDP2 "
            "mixed_precision={param_dtype = 'bfloat16', reduce_dtype = 'float32'} in the plan")
    loader = settings.get("dataloader_config")
    if getattr(loader, "dispatch_batches", None):
        add("CP719", "dispatch_batches is on: rank 0 would read every batch and hand out "
            "one slice per process, so tensor-parallel ranks would get different samples "
            "instead of the plan's data shards",
            "leave dispatch_batches unset (or False): each rank then reads the shard "
            "plan.data_shard() gives it")
    return findings


def parallelism_config(plan: ParallelPlan, world_size: int, device_mesh: Any) -> Any:
    """accelerate's ``ParallelismConfig`` mirroring the plan, ``device_mesh`` preset."""
    from accelerate import ParallelismConfig

    sizes = mirrored_sizes(plan, world_size)
    try:
        config = ParallelismConfig(**sizes)
    except ValueError:
        # Replication beside TP without sharding (HSDP x TP) is a layout the plan runs and
        # ParallelismConfig's constructor refuses: set the sizes it describes afterwards.
        config = ParallelismConfig(tp_size=sizes["tp_size"])
        config._set_size("dp_replicate", sizes["dp_replicate_size"])
        config._set_size("dp_shard", sizes["dp_shard_size"])
    config.device_mesh = device_mesh
    return config


# -- the accelerator -----------------------------------------------------------------------


def plan_accelerator_class() -> type[PlanAccelerator]:
    """:class:`PlanAccelerator`, importing accelerate (this module does not)."""
    from composer_par.integrations._plan_accelerator import PlanAccelerator

    return PlanAccelerator


def __getattr__(name: str) -> Any:
    # PlanAccelerator subclasses accelerate.Accelerator, so its module imports accelerate:
    # that module is loaded when the class is first asked for.
    if name == "PlanAccelerator":
        return plan_accelerator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_accelerator(plan: ParallelPlan | str | os.PathLike[str], model: nn.Module,
                        **accelerator_kwargs: Any) -> tuple[PlanAccelerator, nn.Module]:
    """``(accelerator, model)``: a :class:`PlanAccelerator` for ``plan`` (refusing what
    overlaps it before anything is built) and ``model`` with the plan applied on its mesh.
    ``plan`` may be a plan file, or an accelerate config YAML or DeepSpeed JSON, imported
    as ``composer-par import`` does (its findings printed; add a materializer to the
    plan for a model on meta by importing it yourself:
    ``composer_par.integrations.sources.load_plan``). Build the optimizer on the
    returned model's parameters, then ``accelerator.prepare``."""
    from composer_par.integrations.sources import load_plan

    accelerator = plan_accelerator_class()(load_plan(plan), **accelerator_kwargs)
    return accelerator, accelerator.apply(model)


__all__ = ["accelerate_findings", "mirrored_sizes", "parallelism_config",
           "plan_accelerator_class", "plan_findings", "prepare_accelerator"]
