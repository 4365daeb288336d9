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
This module imports accelerate only when an accelerator is made (``PlanAccelerator`` is
defined on first use); ``import composer_par`` never imports this module.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_par.findings import Finding
from composer_par.integrations.errors import refuse_errors
from composer_par.plugin import Role, Stage

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.checkpoint import CheckpointInfo
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
            "splits sequences only with TP's sequence_parallel, inside its tp mesh dim",
            "set cp_size and sp_size to 1; for sequence parallelism use "
            "TP(sequence_parallel=True) in the plan")
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


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1"))


def _on_cpu(plan: ParallelPlan) -> bool:
    """The plan runs on CPU (gloo): no CUDA here, or its device says cpu."""
    import torch

    return not torch.cuda.is_available() or str(plan.device or "").startswith("cpu")


def _device_mesh(plan: ParallelPlan, world: int) -> Any:
    """The plan's DeviceMesh, built once here when the plan has none, so that the plan's
    apply, accelerate's config and every collective share one set of process groups."""
    return plan.device_mesh(world, "cpu" if _on_cpu(plan) else "cuda")


# -- the accelerator -----------------------------------------------------------------------


@functools.cache
def plan_accelerator_class() -> type:
    """:class:`PlanAccelerator`, defined on first use: accelerate is imported then, not
    when this module is."""
    import accelerate

    class PlanAccelerator(accelerate.Accelerator):  # type: ignore[misc,name-defined]
        """``accelerate.Accelerator`` running ``plan`` (see the module). ``kwargs`` are the
        Accelerator's own; those that overlap the plan raise
        :class:`~composer_par.integrations.errors.IntegrationError` before anything is
        built. ``cpu`` defaults to True when the plan runs on CPU (gloo)."""

        def __init__(self, plan: ParallelPlan, **kwargs: Any) -> None:

            world = _world_size()
            refuse_errors(TRAINER, plan_findings(plan, world, TRAINER)
                          + accelerate_findings(plan, kwargs))
            if "cpu" not in kwargs and _on_cpu(plan):
                kwargs["cpu"] = True
            super().__init__(**kwargs)
            self.plan = plan
            self._plan_checks(world)
            mesh = _device_mesh(plan, world)
            config = parallelism_config(plan, world, mesh)
            self.state.parallelism_config = config
            self.state.device_mesh = mesh
            self._plan_models: list[nn.Module] = []

        def _plan_checks(self, world: int) -> None:
            """What accelerate's state says once built (a launch configuration, an earlier
            Accelerator in this process): refused the same way."""
            findings = []
            if self.num_processes != world:
                findings.append(Finding(
                    "CP711", f"accelerate sees {self.num_processes} process(es) and the process "
                    f"group has {world} ranks ({self.distributed_type})", plugin=TRAINER,
                    fix="on CPU give Accelerator cpu=True (Trainer: use_cpu=True) so accelerate "
                    "uses the gloo group; launch with torchrun or accelerate launch"))
            from accelerate.utils import DistributedType

            kind = self.distributed_type
            if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                        DistributedType.MEGATRON_LM):
                findings.append(Finding(
                    "CP714", f"accelerate's state is {kind}: it would shard or wrap the model "
                    "the plan shards", plugin=TRAINER,
                    fix="launch without accelerate's FSDP / DeepSpeed / Megatron-LM config"))
            refuse_errors(TRAINER, findings)

        # -- the model -------------------------------------------------------------------------

        def apply(self, model: nn.Module) -> nn.Module:
            """``plan.apply(model)`` on the accelerator's mesh; the model ``prepare`` takes."""
            applied = self.plan.apply(model)
            self._plan_models.append(applied)
            return applied

        def _adopt(self, model: nn.Module) -> None:
            from torch.distributed.tensor import DTensor

            if any(model is m for m in self._plan_models):
                return
            plan_made = bool(self.plan.applied) and (
                any(isinstance(p, DTensor) for p in model.parameters())
                or any(model is m for m in self.plan.data_parallel_modules))
            if not plan_made:
                raise ValueError(
                    f"accelerator.prepare got a {type(model).__name__} the plan has not applied: "
                    "apply it first (accelerator, model = prepare_accelerator(plan, model), or "
                    "model = accelerator.apply(model)), then build the optimizer on "
                    "model.parameters()")
            self._plan_models.append(model)

        def _check_optimizer(self, optimizer: Any, models: Iterable[nn.Module]) -> None:
            own = {id(p) for m in models for p in m.parameters()}
            inner = getattr(optimizer, "optimizer", optimizer)
            for group in inner.param_groups:
                for param in group["params"]:
                    if id(param) not in own:
                        raise ValueError(
                            f"{type(inner).__name__} holds a parameter of shape "
                            f"{tuple(param.shape)} that is no parameter of the plan's model: build "
                            "the optimizer after applying the plan, on model.parameters()")

        def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
            """accelerate's ``prepare`` for a plan: models are adopted unchanged, optimizers
            and schedulers wrapped as accelerate wraps them, data loaders sharded by the
            plan. Returns the objects in the same order (one object alone, as accelerate)."""
            import torch

            if device_placement is None:
                device_placement = [None for _ in args]  # type: ignore[misc]
            elif len(device_placement) != len(args):
                raise ValueError(f"device_placement should be a list with {len(args)} elements "
                                 "(the number of objects passed)")
            models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
            for model in models:
                self._adopt(model)
                # accelerate's prepare_model returns a model so marked as it is: no wrapper,
                # no move, no cast.
                model._is_accelerate_prepared = True  # type: ignore[assignment]
            for obj in args:
                if isinstance(obj, torch.optim.Optimizer):
                    self._check_optimizer(obj, models or self._plan_models)
            result = tuple(self._prepare_one(obj, first_pass=True, device_placement=d)
                           for obj, d in zip(args, device_placement, strict=True))
            result = tuple(self._prepare_one(obj, device_placement=d)
                           for obj, d in zip(result, device_placement, strict=True))
            for item in result:
                if any(item in container for container in (
                        self._dataloaders, self._models, self._optimizers, self._schedulers)):
                    item._is_accelerate_prepared = True
            return result if len(result) > 1 else result[0]

        # -- data --------------------------------------------------------------------------------

        def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None,
                                slice_fn_for_dispatch: Any = None) -> Any:
            """accelerate's sharded loader over the plan's data shards (``plan.data_shard()``):
            shard ``index`` of ``count`` gets every ``count``-th batch from the ``index``-th
            on (with ``split_batches``: the ``index``-th slice of each batch)."""
            from accelerate.data_loader import prepare_data_loader

            if getattr(data_loader, "_is_accelerate_prepared", False):
                if data_loader not in self._dataloaders:
                    self._dataloaders.append(data_loader)
                return data_loader
            if device_placement is None:
                device_placement = self.device_placement
            index, count = self.plan.data_shard(self.process_index, self.num_processes)
            prepared = prepare_data_loader(
                data_loader, self.device, num_processes=count, process_index=index,
                split_batches=self.split_batches, put_on_device=device_placement,
                rng_types=self.rng_types.copy(), dispatch_batches=False,
                even_batches=self.even_batches, use_seedable_sampler=self.use_seedable_sampler,
                data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking,
                use_stateful_dataloader=self.use_stateful_dataloader, torch_device_mesh=None)
            self._dataloaders.append(prepared)
            return prepared

        def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
            """accelerate's ``gather_for_metrics`` over the plan's data shards: each shard's
            samples once, in shard order, the padding of the last batch dropped.

            Ranks that differ only in a model-parallel mesh dim read the same samples (the
            loaders are sharded by ``plan.data_shard()``), so a gather over every process
            would return each sample once per such rank; the first rank of each shard
            stands for it. The last batch's padding is cut as accelerate cuts it, by the
            remainder the shard-wise loader counted."""
            import torch
            from accelerate.utils import recursively_apply

            world = self.num_processes
            ranks = self._shard_ranks
            if len(ranks) == world:  # every rank a shard of its own: accelerate's split
                return super().gather_for_metrics(input_data, use_gather_object)
            try:
                recursively_apply(lambda x: x, input_data, error_on_other_type=True)
                all_tensors = True
            except TypeError:
                all_tensors = False
            if use_gather_object or not all_tensors:
                # As accelerate's gather_object: each rank gives a list, the lists joined.
                gathered: list[Any] = [None] * world
                torch.distributed.all_gather_object(gathered, input_data)
                data: Any = [item for rank in ranks for item in gathered[rank]]
                return self._drop_padding(data, objects=True)
            # accelerate's gather: every rank's tensor (one element for a scalar), of one
            # size on every rank, joined along the first tensor dim in rank order.
            whole = self.gather(input_data)

            def shard_copies(tensor: torch.Tensor) -> torch.Tensor:
                size = tensor.shape[0] // world
                return torch.cat([tensor[rank * size:(rank + 1) * size] for rank in ranks])

            data = recursively_apply(shard_copies, whole)
            return self._drop_padding(data, objects=False)

        @functools.cached_property
        def _shard_ranks(self) -> list[int]:
            """The first rank of each data shard, in shard order: worked out once (the
            plan and the process count do not change once the accelerator is made), not
            at every batch an evaluation gathers."""
            world = self.num_processes
            first: dict[int, int] = {}
            for rank in range(world):
                first.setdefault(self.plan.data_shard(rank, world)[0], rank)
            return [first[index] for index in range(len(first))]

        def _drop_padding(self, data: Any, *, objects: bool) -> Any:
            """At the end of a loader, the samples past the dataset's end (padding
            accelerate added to even the last batch out over the shards) are cut."""
            from accelerate.utils import recursively_apply

            state = self.gradient_state
            if not state.end_of_dataloader or state.remainder <= 0:
                return data  # mid-loader, no padding, or a loader without a length
            remainder = state.remainder
            if objects:
                return data[:remainder]
            return recursively_apply(lambda t: t[:remainder], data)

        # -- gradients ---------------------------------------------------------------------------

        def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                            norm_type: float = 2) -> torch.Tensor:
            """One norm over every gradient on any mesh (composer_par.training.clip_grad_norm_)."""
            from composer_par.training import clip_grad_norm_

            self.unscale_gradients()
            return clip_grad_norm_(list(parameters), max_norm, norm_type)

        # -- checkpoints -------------------------------------------------------------------------

        def _one_model_and_optimizer(self) -> tuple[nn.Module, Any]:
            if len(self._models) != 1 or len(self._optimizers) > 1:
                raise ValueError(
                    f"save_state / load_state of a plan keep one model and at most one optimizer; "
                    f"this accelerator prepared {len(self._models)} model(s) and "
                    f"{len(self._optimizers)} optimizer(s): save each with "
                    "composer_par.checkpoint.save(path, model, optimizer)")
            optimizer = self._optimizers[0].optimizer if self._optimizers else None
            return self._models[0], optimizer

        def _checkpoint_root(self, directory: str | os.PathLike[str] | None) -> Path:
            if directory is None:
                raise ValueError(
                    "save_state / load_state of a plan need a directory: composer_par numbers "
                    "the steps inside it (step-NNNNNNNNN), in place of accelerate's "
                    "automatic_checkpoint_naming")
            return Path(directory)

        def save_state(self, output_dir: str | os.PathLike[str] | None = None,
                       safe_serialization: bool = True, **save_model_func_kwargs: Any) -> str:
            """Save the model and optimizer with :func:`composer_par.checkpoint.save` into
            ``output_dir/step-NNNNNNNNN`` (sharded, committed last), with accelerate's step,
            the schedulers' and registered objects' states (JSON) and every rank's RNG
            states. Returns the committed step directory. ``composer_par.checkpoint.load``
            reads it outside accelerate; ``load_state`` reads what ``checkpoint.save`` wrote."""
            from composer_par.checkpoint import save

            model, optimizer = self._one_model_and_optimizer()
            extra = {"accelerate": {
                "step": self.step,
                "schedulers": [s.state_dict() for s in self._schedulers],
                "custom": [o.state_dict() for o in self._custom_objects],
            }}
            path = save(self._checkpoint_root(output_dir), model, optimizer, extra=extra,
                        plan=self.plan)
            self.project_configuration.iteration += 1
            return str(path)

        def load_state(self, input_dir: str | os.PathLike[str] | None = None,
                       load_kwargs: dict[str, Any] | None = None,
                       **load_model_func_kwargs: Any) -> CheckpointInfo:
            """Load a composer_par checkpoint (a step directory, or a root: its latest
            committed step) into the prepared model and optimizer; restore accelerate's step
            and the schedulers' and registered objects' states when it saved them."""
            from composer_par.checkpoint import load

            model, optimizer = self._one_model_and_optimizer()
            info = load(self._checkpoint_root(input_dir), model, optimizer)
            saved = info.extra.get("accelerate") if isinstance(info.extra, dict) else None
            if saved:
                self.step = int(saved.get("step", 0))  # type: ignore[has-type]
                for scheduler, state in zip(self._schedulers, saved.get("schedulers", []),
                                            strict=False):
                    scheduler.load_state_dict(state)
                for obj, state in zip(self._custom_objects, saved.get("custom", []),
                                      strict=False):
                    obj.load_state_dict(state)
            return info

    return PlanAccelerator


def __getattr__(name: str) -> Any:
    # PlanAccelerator subclasses accelerate.Accelerator: made when first asked for.
    if name == "PlanAccelerator":
        return plan_accelerator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_accelerator(plan: ParallelPlan, model: nn.Module, **accelerator_kwargs: Any
                        ) -> tuple[Any, nn.Module]:
    """``(accelerator, model)``: a :class:`PlanAccelerator` for ``plan`` (refusing what
    overlaps it before anything is built) and ``model`` with the plan applied on its mesh.
    Build the optimizer on the returned model's parameters, then ``accelerator.prepare``."""
    accelerator = plan_accelerator_class()(plan, **accelerator_kwargs)
    return accelerator, accelerator.apply(model)


__all__ = ["accelerate_findings", "mirrored_sizes", "parallelism_config",
           "plan_accelerator_class", "plan_findings", "prepare_accelerator"]
