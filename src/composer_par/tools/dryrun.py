"""Dry-run a plan for chosen ranks of the full layout, in one process, without devices.

For each rank asked for, :func:`dry_run` initializes torch's *fake* process-group
backend as that rank of ``world_size`` (no peers, every collective a no-op), builds the
model on the meta device, validates the plan against it (the model-aware findings a
real run would hit) and applies the plan for real: TP's ``parallelize_module``,
activation checkpointing, compile wrapping, FSDP2's ``fully_shard``... on meta tensors,
so it takes no memory and seconds even for hundreds of ranks. What each rank would hold
is then read off the parameters: every parameter's local shape and bytes, and totals.

Then each rank runs one forward and backward of the applied model on *fake* tensors
(``FakeTensorMode``: shapes and dtypes, no data, no memory), so a plan that validates but
would fail in its first step (a shape error between a split and an unsplit projection)
fails here, on a laptop. Inputs come from the model: a Hugging Face model's
``main_input_name`` (token ids with ``labels=`` for a language model, images for a vision
model), else a first ``nn.Embedding`` (token ids) or ``nn.Linear`` (features). Where the
forward cannot be checked (no input known; a model whose own forward, unparallelized,
does not run on fake tensors: data-dependent ops such as a mixture-of-experts router's
``nonzero``) the result says so, with the reason, and does not count as a failure.

Materializing is the one stage a dry run cannot do (it would allocate the model). The
plugins that materialize (MetaInit, the loaders) are swapped, in a copy of the plan, for
a stand-in that declares exactly what they declare (claims, capabilities, ordering) and
leaves the parameters on meta; the result lists them as "skipped in dry run". The
model-aware validation still runs with the real plugins, so e.g. a module MetaInit
cannot initialize is still reported.

``MODULE:FACTORY`` is resolved as uvicorn and gunicorn resolve an app: import
``MODULE`` (with the current directory on ``sys.path``), then follow the dotted
attribute path ``FACTORY``; it must be callable with no arguments and return an
``nn.Module``. It is called under ``torch.device("meta")``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.findings import Report
from composer_par.plugin import Plugin, Stage, hookimpl

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plan import ParallelPlan
    from composer_par.plugin import Declaration
    from composer_par.plugin.context import ApplyContext

__all__ = [
    "DryRunError",
    "DryRunResult",
    "ParamLayout",
    "PipelineSplit",
    "RankLayout",
    "SkippedInDryRun",
    "default_ranks",
    "dry_run",
    "resolve_factory",
]


class DryRunError(ValueError):
    """The dry run cannot start: a bad ``MODULE:FACTORY``, a rank outside the layout, an
    unknown world size, or a process group already initialized in this process."""


# -- MODULE:FACTORY --------------------------------------------------------------------------

_IMPORT_STRING = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def resolve_factory(spec: str, *, cwd: str | os.PathLike[str] | None = None) -> Callable[[], Any]:
    """``"pkg.models:build"`` -> the callable, importing ``pkg.models`` with ``cwd`` (default:
    the current directory) first on ``sys.path``, as uvicorn and gunicorn do. A Hugging
    Face ``config.json`` (or a model directory holding one) -> a builder of its model
    (:mod:`composer_par.integrations.hf_config`)."""
    if not isinstance(spec, str):
        raise DryRunError(f'the model must be given as "<module>:<factory>"; got {spec!r}')
    if not _IMPORT_STRING.match(spec):
        return _config_factory(spec)
    module_name, _, attr = spec.partition(":")
    directory = os.fspath(cwd) if cwd is not None else os.getcwd()
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise DryRunError(f'could not import module "{module_name}" (looked in '
                              f"{directory} and on sys.path)") from exc
        raise DryRunError(f'importing module "{module_name}" failed: {exc}') from exc
    except Exception as exc:  # the user's module raised at import
        raise DryRunError(f'importing module "{module_name}" failed: '
                          f"{type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise DryRunError(f'attribute "{attr}" not found in module "{module_name}"') from None
    if not callable(obj):
        raise DryRunError(f'"{spec}" is a {type(obj).__name__}, not a factory: give a function '
                          "or class that builds the model when called with no arguments")
    return obj  # type: ignore[no-any-return]


def _config_factory(spec: str) -> Callable[[], Any]:
    """The builder of the model a Hugging Face config.json ``spec`` (or a directory holding
    one) describes; DryRunError where ``spec`` names none."""
    from composer_par.integrations.hf_config import (
        ConfigModelError,
        config_file,
        factory_from_config,
        not_a_config,
    )

    found = config_file(spec)
    if found is not None:
        try:
            return factory_from_config(found)
        except ConfigModelError as exc:
            raise DryRunError(str(exc)) from exc
    why = not_a_config(spec)
    if why is not None:
        raise DryRunError(f"{why}: give a Hugging Face config.json, a model directory "
                          'holding one, or "<module>:<factory>"')
    raise DryRunError(f'the model must be given as "<module>:<factory>" (e.g. '
                      f'"mypkg.models:build_model") or as a Hugging Face config.json (or a '
                      f"directory holding one); got {spec!r}")


def build_on_meta(factory: Callable[[], Any], spec: str = "the factory") -> nn.Module:
    import torch
    import torch.nn as nn

    with torch.device("meta"):
        try:
            model = factory()
        except Exception as exc:
            raise DryRunError(f"{spec}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise DryRunError(f"{spec}() returned a {type(model).__name__}, not an nn.Module")
    return model


# -- the stand-in materializer ---------------------------------------------------------------


@attrs.frozen(eq=False)
class SkippedInDryRun(Plugin):
    """Stands in for a materializing plugin in a dry run: declares what it declares and
    leaves every tensor on meta."""

    replaced: Plugin

    @property
    def name(self) -> str:  # type: ignore[override]  # the replaced plugin's name
        return self.replaced.name

    def declare(self) -> Declaration:
        return self.replaced.declare()

    @hookimpl
    def composer_par_materialize(self, ctx: ApplyContext) -> str:
        ctx.notes.setdefault("skipped_in_dry_run", []).append(self.replaced.name)
        return "skipped in dry run: would materialize (tensors stay on meta)"


# -- results ---------------------------------------------------------------------------------


@attrs.frozen
class ParamLayout:
    """One parameter on one rank."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    bytes: int  # of the local shard
    placements: str  # e.g. "dp_shard:Shard(0), tp:Replicate()", or "" for a plain tensor

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "global_shape": list(self.global_shape),
                "local_shape": list(self.local_shape), "dtype": self.dtype,
                "bytes": self.bytes, "placements": self.placements}


@attrs.frozen
class RankLayout:
    """What one rank would hold after ``apply``, or why applying failed."""

    rank: int
    coordinate: dict[str, int]
    node: int | None
    params: tuple[ParamLayout, ...] = ()
    steps: tuple[tuple[str, str, str], ...] = ()  # (stage, plugin, what it did)
    skipped: tuple[str, ...] = ()  # plugins skipped in the dry run
    seconds: float = 0.0
    failure: str | None = None  # the exception applying raised, with its last frames
    # With a pipeline: (stage, parameters, bytes) of each stage this rank holds.
    stages: tuple[tuple[int, int, int], ...] = ()
    # One forward and backward on fake tensors: "ran", "failed" or "not checked", and what.
    forward: tuple[str, str] | None = None
    # The reduction check of that forward (composer_par.reduction_check): each problem
    # found, as a CP434 message; empty when none (or not checked: see ``forward``).
    reductions: tuple[str, ...] = ()

    @property
    def local_numel(self) -> int:
        return sum(_numel(p.local_shape) for p in self.params)

    @property
    def local_bytes(self) -> int:
        return sum(p.bytes for p in self.params)

    @property
    def global_numel(self) -> int:
        return sum(_numel(p.global_shape) for p in self.params)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "coordinate": self.coordinate, "node": self.node,
            "ok": self.failure is None, "failure": self.failure,
            "seconds": round(self.seconds, 4),
            "steps": [{"stage": s, "plugin": p, "detail": d} for s, p, d in self.steps],
            "skipped_in_dry_run": list(self.skipped),
            "totals": {"params": self.local_numel, "bytes": self.local_bytes,
                       "global_params": self.global_numel},
            "pipeline_stages": [{"stage": s, "params": n, "bytes": b}
                                for s, n, b in self.stages],
            "forward": ({"status": self.forward[0], "detail": self.forward[1]}
                        if self.forward else None),
            "reductions": list(self.reductions),
            "params": [p.to_dict() for p in self.params],
        }


@attrs.frozen
class PipelineSplit:
    """The pipeline a plan cuts the model into (the same on every rank)."""

    dim: str
    size: int
    schedule: str
    microbatches: int
    split: tuple[tuple[str, ...], ...]  # module paths per stage
    placement: tuple[tuple[int, ...], ...]  # stages per pp rank
    stage_params: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        rank_of = {s: r for r, stages in enumerate(self.placement) for s in stages}
        return {"dim": self.dim, "size": self.size, "schedule": self.schedule,
                "microbatches": self.microbatches, "stopped_before_first_step": True,
                "stages": [{"stage": i, "pp_rank": rank_of[i], "modules": list(paths),
                            "params": self.stage_params[i] if self.stage_params else None}
                           for i, paths in enumerate(self.split)]}


@attrs.frozen
class DryRunResult:
    world_size: int
    report: Report  # static + model-aware findings (with the real plugins)
    ranks: tuple[RankLayout, ...]
    model: str  # what was built, e.g. "Llama (1.10 B parameters, 16 blocks at layers.*)"
    build_seconds: float = 0.0
    pipeline: PipelineSplit | None = None

    @property
    def ok(self) -> bool:
        return self.report.ok and all(
            r.failure is None and (r.forward is None or r.forward[0] != "failed")
            and not r.reductions for r in self.ranks)

    def exit_code(self) -> int:
        code = self.report.exit_code()
        return code if code else (0 if self.ok else 1)

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "model": self.model, "ok": self.ok,
                "build_seconds": round(self.build_seconds, 4),
                "report": self.report.to_dict(),
                "pipeline": self.pipeline.to_dict() if self.pipeline else None,
                "ranks": [r.to_dict() for r in self.ranks]}


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


# -- the dry run -----------------------------------------------------------------------------


def default_ranks(world_size: int) -> list[int]:
    """Rank 0 and the last rank (the two ends of every mesh dim's layout)."""
    return sorted({0, world_size - 1})


def dry_run(
    plan: ParallelPlan,
    model: str | Callable[[], Any],
    *,
    world_size: int | None = None,
    ranks: Iterable[int] | None = None,
) -> DryRunResult:
    """Apply ``plan`` as each of ``ranks`` (default: 0 and the last) of ``world_size``
    would, over the fake process-group backend, to the model ``model`` builds on meta.

    ``model`` is ``"MODULE:FACTORY"`` or a callable. ``world_size`` defaults to the plan's
    (topology, else mesh). The plan's own topology is used for the node of each rank.
    Raises :class:`DryRunError` when it cannot start; anything applying raises is
    reported in that rank's :attr:`RankLayout.failure`.
    """
    import torch.distributed as dist

    world = world_size if world_size is not None else plan.world_size()
    if world is None:
        raise DryRunError(f"{plan.mesh.equation()}: the world size is unknown; give "
                          "--world-size or --nodes/--devices-per-node")
    wanted = sorted(set(ranks)) if ranks is not None else default_ranks(world)
    outside = [r for r in wanted if not 0 <= r < world]
    if outside:
        raise DryRunError(f"rank {outside[0]} is outside the layout of {world} ranks "
                          f"(0 .. {world - 1})")
    if dist.is_available() and dist.is_initialized():
        raise DryRunError("a process group is already initialized in this process; a dry run "
                          "initializes its own fake one (run it outside torchrun)")
    spec = model if isinstance(model, str) else getattr(model, "__qualname__", "the factory")
    factory = resolve_factory(model) if isinstance(model, str) else model

    started = time.perf_counter()
    probe = build_on_meta(factory, spec)
    build_seconds = time.perf_counter() - started
    report = plan.validate(probe, world_size=world)
    description = _describe_model(probe, plan)
    if not report.ok:
        return DryRunResult(world, report, (), description, build_seconds)
    mesh = plan.mesh.resolve(world)
    layouts = []
    pipeline: PipelineSplit | None = None
    control: list[tuple[str, str]] = []  # the unparallelized model's forward, once

    def unparallelized() -> tuple[str, str]:
        if not control:
            control.append(forward_check(build_on_meta(factory, spec), mesh.sizes))
        return control[0]

    for rank in wanted:
        model_for_rank = probe if rank == wanted[0] else build_on_meta(factory, spec)
        layout, split = _dry_run_rank(plan, model_for_rank, mesh, world, rank, unparallelized,
                                      lambda: _in_bfloat16(build_on_meta(factory, spec)))
        layouts.append(layout)
        pipeline = pipeline or split
    return DryRunResult(world, report, tuple(layouts), description, build_seconds, pipeline)


def _describe_model(model: nn.Module, plan: ParallelPlan) -> str:
    from composer_par.blocks import find_blocks
    from composer_par.estimate import format_count

    blocks = find_blocks(model, plan.block_spec())
    count = sum(p.numel() for p in model.parameters())
    where = ""
    if blocks:
        first = blocks[0][0]
        where = f" at {first.rsplit('.', 1)[0]}.*" if "." in first else ""
    return (f"{type(model).__name__} ({format_count(count)} parameters, {len(blocks)} "
            f"block(s){where})")


def _in_bfloat16(model: nn.Module) -> nn.Module:
    """``model`` (on meta) with its floating parameters and buffers in bfloat16."""
    import torch

    return model.to(torch.bfloat16)


def _dry_plan(plan: ParallelPlan, device_mesh: Any, mesh: Any) -> ParallelPlan:
    """``plan`` on ``device_mesh`` with its materializers swapped for stand-ins."""
    from composer_par.plan import ParallelPlan as Plan

    dry = Plan(device_mesh if device_mesh is not None else mesh, topology=plan.topology,
               device="cpu")
    for plugin in plan.plugins:
        materializes = Stage.MATERIALIZE in plugin.stages()
        dry.use(SkippedInDryRun(plugin) if materializes else plugin)
    return dry


# What torch's fake kernel of grouped_mm (transformers' experts) says outside bfloat16.
_BF16_ONLY = "Expected inputs of BF16 type"


def _dry_run_rank(plan: ParallelPlan, model: nn.Module, mesh: Any, world: int,
                  rank: int, unparallelized: Callable[[], tuple[str, str]] | None = None,
                  in_bfloat16: Callable[[], nn.Module] | None = None,
                  ) -> tuple[RankLayout, PipelineSplit | None]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    fake_store = _fake_store()

    topology = plan.effective_topology()
    node = topology.node_of(rank) if topology and topology.world_size == world else None
    coordinate = mesh.coordinate(rank)
    started = time.perf_counter()
    _forget_sharding_decisions()
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        device_mesh = (init_device_mesh("cpu", mesh.sizes, mesh_dim_names=mesh.names)
                       if mesh.dims else None)
        dry = _dry_plan(plan, device_mesh, mesh)
        try:
            applied = _quietly(lambda: dry.apply(model))
        except Exception as exc:
            return RankLayout(rank, coordinate, node, seconds=time.perf_counter() - started,
                              failure=_failure(exc)), None
        params = tuple(_param_layout(name, p) for name, p in applied.named_parameters())
        steps = tuple((s.stage, s.plugin, s.detail) for s in dry.applied)
        skipped = tuple(dry.notes.get("skipped_in_dry_run", ()))
        split, stages = _pipeline(dry, params)
        seconds = time.perf_counter() - started
        forward = None
        problems: list[Any] = []
        if split is None:  # a pipeline's schedule cannot run over the fake process group
            setup = reduction_setup(dry, device_mesh)
            forward = _quietly(lambda: forward_check(applied, mesh.sizes, setup, problems))
            if forward[0] == "failed" and _BF16_ONLY in forward[1] and in_bfloat16:
                # Fake tensors run transformers' grouped experts in bfloat16 only: the
                # same plan on a bfloat16 copy checks the step and its reductions.
                again = _dry_plan(plan, device_mesh, mesh)
                copy = _quietly(lambda: again.apply(in_bfloat16()))
                forward = _quietly(lambda: forward_check(copy, mesh.sizes, setup, problems))
                if forward[0] == "ran":
                    forward = ("ran", forward[1] + " in bfloat16 (torch's fake grouped_mm, "
                               "which transformers' experts call, takes bfloat16 only)")
            if forward[0] == "failed" and unparallelized is not None:
                own = unparallelized()
                if own[0] != "ran":  # not the plan's doing: fake tensors cannot run it
                    forward = ("not checked", "the model's own forward, unparallelized, "
                               f"does not run on fake tensors either ({own[1]})")
        reductions = tuple(f"ERROR CP434: rank {rank}: {p.message()}" for p in problems)
        return RankLayout(rank, coordinate, node, params, steps, skipped, seconds,
                          stages=stages, forward=forward, reductions=reductions), split
    finally:
        dist.destroy_process_group()


def _positions(params: Any, seq: int) -> dict[str, Any]:
    """The places of a sequence's tokens, ``0..seq-1``, under the name the forward takes
    them by (the default it would compute): a plan that splits the sequence refuses a
    forward without them, as the rank's places are not that default on every rank."""
    import torch

    name = next((n for n in ("position_ids", "positions") if n in params), None)
    return {name: torch.arange(seq)[None]} if name else {}


def example_inputs(model: nn.Module, sizes: Sequence[int]) -> dict[str, Any] | None:
    """Inputs for one forward of ``model`` (one sample, a sequence every mesh dim size
    divides), made by the caller's tensor mode; None when nothing says what it takes."""
    import math

    import torch
    import torch.nn as nn

    seq = 2 * math.lcm(8, *[s for s in sizes if s > 0])
    name = getattr(model, "main_input_name", None)
    config = getattr(model, "config", None)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    kind = type(model).__name__
    if name == "input_ids" and config is not None:
        ids = torch.randint(0, int(getattr(config, "vocab_size", 2)), (1, seq))
        inputs = {"input_ids": ids}
        if "labels" in params and kind.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM")):
            inputs["labels"] = ids
        return {**inputs, **_positions(params, seq)}
    if name == "pixel_values" and config is not None:
        size = getattr(config, "image_size", 224)
        inputs = {"pixel_values": torch.randn(1, getattr(config, "num_channels", 3), size, size)}
        if "labels" in params and hasattr(config, "num_labels"):
            inputs["labels"] = torch.zeros(1, dtype=torch.long)
        return inputs
    first = next((p for p in params.values() if p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD)), None)
    if first is None:
        return None
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return {first.name: torch.randint(0, module.num_embeddings, (1, seq)),
                    **_positions(params, seq)}
        if isinstance(module, nn.Linear):
            return {first.name: torch.randn(1, module.in_features)}
    return None


def _scalar(output: Any) -> Any:
    """What backward starts from: the model's loss, else the sum of its first output."""
    import torch

    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    for value in (getattr(output, "logits", None), output,
                  output[0] if isinstance(output, (tuple, list)) and output else None):
        if isinstance(value, torch.Tensor):
            return value.float().sum()
    raise TypeError(f"the forward returned {type(output).__name__}: no tensor to start "
                    "backward from")


@attrs.frozen
class ReductionSetup:
    """What the reduction check needs of a plan on one rank: the mesh dims of size > 1,
    this rank's group over each (its ranks), and the dims whose ranks read different
    samples."""

    dims: tuple[str, ...]
    groups: dict[str, frozenset[int]]
    data_dims: tuple[str, ...]
    hooked_dims: tuple[str, ...] = ()  # folded dims: averaged by hooks without FSDP2


def reduction_setup(plan: ParallelPlan, device_mesh: Any) -> ReductionSetup | None:
    """The setup of the reduction check for ``plan`` on the mesh built for this rank."""
    import torch.distributed as dist

    if device_mesh is None:
        return None
    mesh = plan.mesh
    dims = tuple(n for n in mesh.names if mesh.size(n) > 1)
    groups = {n: frozenset(dist.get_process_group_ranks(device_mesh.get_group(n)))
              for n in dims}
    data = tuple(d for d in plan.data_parallel_dims() if d in dims)
    folded = tuple(f.dim for f in plan.folded_dims() if f.dim in dims)
    return ReductionSetup(dims, groups, data, folded)


def forward_check(model: nn.Module, sizes: Sequence[int], setup: ReductionSetup | None = None,
                  problems: list[Any] | None = None) -> tuple[str, str]:
    """One forward and backward of ``model`` (on meta, sharded or not) on fake tensors:
    ``("ran", what)``, ``("failed", the error)`` or ``("not checked", why)``. The model's
    tensors become fake ones: use it for nothing after. With ``setup``, the forward runs
    under the reduction check (:mod:`composer_par.reduction_check`), whose problems are
    appended to ``problems``; compiled blocks run eagerly for it (the check watches each
    op)."""
    import logging
    import warnings

    import torch
    from torch.distributed.tensor.parallel import loss_parallel

    from composer_par.plugin import torch_private
    from composer_par.ties import to_empty_keeping_ties

    # torch logs every exception a fake kernel raises, with its stack: the dry run reports
    # the failure itself, in one line.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        fake_mode = torch_private.fake_tensor_mode()(allow_non_fake_inputs=True)
        with warnings.catch_warnings(), fake_mode:
            # Fake tensors warn about what real ones would (FSDP2's view outputs): the
            # dry run reports only whether the step runs.
            warnings.simplefilter("ignore")
            inputs = example_inputs(model, sizes)
            if inputs is None:
                return ("not checked", f"no example input is known for {type(model).__name__} "
                        "(neither a Hugging Face main_input_name nor a first nn.Embedding "
                        "or nn.Linear)")
            to_empty_keeping_ties(model, torch.device("cpu"))
            model.train()
            # Inside loss parallel: vocabulary-sharded logits (TP loss_parallel) then take
            # their cross-entropy as a real step would; plain ones are unaffected.
            with loss_parallel():
                if setup is None or not setup.dims:
                    _scalar(model(**inputs)).backward()
                else:
                    _checked_step(model, inputs, setup, problems)
    except Exception as exc:
        return "failed", _failure(exc)
    finally:
        fake_log.setLevel(level)
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in inputs.items())
    return "ran", f"one forward and backward ran on fake tensors ({shapes})"


def _checked_step(model: nn.Module, inputs: dict[str, Any], setup: ReductionSetup,
                  problems: list[Any] | None) -> None:
    import torch

    from composer_par.reduction_check import check_reductions

    outputs: list[Any] = []
    with torch.compiler.set_stance("force_eager"):
        found = check_reductions(
            model, lambda: outputs.append(model(**inputs)), dims=setup.dims,
            groups=setup.groups, data_dims=setup.data_dims, inputs=list(inputs.values()),
            hooked_dims=setup.hooked_dims)
        _scalar(outputs[0]).backward()
    if problems is not None:
        problems.extend(found)


def _pipeline(plan: ParallelPlan, params: Sequence[ParamLayout]
              ) -> tuple[PipelineSplit | None, tuple[tuple[int, int, int], ...]]:
    """The plan's pipeline split, and the parameters and bytes of each local stage."""
    pipe = plan.pipeline
    if pipe is None:
        return None, ()
    split = PipelineSplit(pipe.dim, pipe.size, pipe.schedule, pipe.microbatches, pipe.split,
                          pipe.placement, pipe.stage_params)
    stages = []
    for part in pipe.parts:
        mine = [p for p in params
                if any(p.name.startswith(path + ".") for path in part.modules)]
        stages.append((part.stage, sum(_numel(p.local_shape) for p in mine),
                       sum(p.bytes for p in mine)))
    return split, tuple(stages)


def _forget_sharding_decisions() -> None:
    """DTensor caches its sharding decisions by mesh shape and dim names, with the process
    groups of the mesh they were made on: a later rank's fake world (other groups, the
    same shape) would reuse a former rank's groups. Each rank starts with none."""
    from composer_par.plugin import torch_private

    torch_private.clear_dtensor_caches()


def _fake_store() -> Any:
    """torch's fake process-group store; importing its module registers the backend."""
    from composer_par.plugin import torch_private

    try:
        return torch_private.fake_store()
    except torch_private.PrivateSymbolError as exc:  # a torch built without it
        raise DryRunError(f"this torch has no fake process-group backend: {exc}") from exc


def _quietly(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with the library's log events held back, and any structlog events
    captured, not printed: the dry run reports the applied steps and the findings itself,
    and stdout must stay the command's answer."""
    import structlog

    from composer_par.logging import library_events_held

    with library_events_held(), structlog.testing.capture_logs():
        return fn()


def _failure(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message}" + (f" (at {where})" if where else "")


def _param_layout(name: str, param: Any) -> ParamLayout:
    from torch.distributed.tensor import DTensor

    from composer_par.blocks import clean_name

    dtype = str(param.dtype).removeprefix("torch.")
    if isinstance(param, DTensor):
        local = param.to_local()
        names = param.device_mesh.mesh_dim_names or tuple(
            str(i) for i in range(param.device_mesh.ndim))
        placements = ", ".join(f"{n}:{p}" for n, p in zip(names, param.placements, strict=True))
    else:
        local, placements = param, ""
    return ParamLayout(clean_name(name), tuple(param.shape), tuple(local.shape), dtype,
                       local.numel() * local.element_size(), placements)


# -- text ------------------------------------------------------------------------------------

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def format_rank(layout: RankLayout, *, full: bool = False) -> str:
    """One rank's parameters as a table; blocks that hold identical shapes are collapsed
    into one line (``layers.*.attention.wq.weight x16``) unless ``full``."""
    from composer_par.estimate import format_bytes, format_count

    where = ", ".join(f"{k}={v}" for k, v in layout.coordinate.items())
    node = f"node {layout.node}, " if layout.node is not None else ""
    head = f"rank {layout.rank} ({node}{where})"
    if layout.failure is not None:
        return f"{head}: applying the plan FAILED: {layout.failure}"
    lines = [f"{head}: {format_count(layout.local_numel)} of "
             f"{format_count(layout.global_numel)} parameters, "
             f"{format_bytes(layout.local_bytes)}, applied in {layout.seconds:.2f} s"]
    for index, count, size in layout.stages:
        lines.append(f"  pipeline stage {index}: {format_count(count)} parameters, "
                     f"{format_bytes(size)} on this rank")
    for stage, plugin, detail in layout.steps:
        lines.append(f"  [{stage}] {plugin}: {detail}")
    if layout.forward is not None:
        status, detail = layout.forward
        label = {"ran": "first step", "failed": "first step FAILED",
                 "not checked": "first step not checked"}[status]
        lines.append(f"  {label}: {detail}")
        if status == "ran":
            lines.append("  gradient reductions: " + (
                f"{len(layout.reductions)} problem(s)" if layout.reductions else
                "every gradient gets the sums over mesh dims its forward needs"))
            lines.extend(f"    {message}" for message in layout.reductions)
    rows: list[tuple[str, ...]] = []
    groups: dict[tuple[Any, ...], list[ParamLayout]] = {}
    order: list[tuple[Any, ...]] = []
    for p in layout.params:
        key = (_INDEX.sub("*", p.name) if not full else p.name, p.global_shape, p.local_shape,
               p.dtype, p.placements)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(p)
    for key in order:
        members = groups[key]
        name = key[0] + (f" x{len(members)}" if len(members) > 1 else "")
        first = members[0]
        rows.append((name, _shape(first.global_shape), _shape(first.local_shape), first.dtype,
                     format_bytes(first.bytes * len(members)), first.placements or "-"))
    rows.append(("total", "", "", "", format_bytes(layout.local_bytes), ""))
    from composer_par.tables import table

    lines.append(table(
        rows, ("PARAMETER", "GLOBAL SHAPE", "LOCAL SHAPE", "DTYPE", "BYTES", "PLACEMENTS"),
        right=(4,), indent="  "))
    return "\n".join(lines)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def format_result(result: DryRunResult, *, full: bool = False) -> str:
    lines = [f"dry run of {result.world_size} ranks over torch's fake process-group backend "
             f"(no devices, no peers); model: {result.model}"]
    if not result.report.ok:
        lines.append("not applied: the plan has errors (above)")
        return "\n".join(lines)
    if result.pipeline is not None:
        lines.extend(format_pipeline(result.pipeline))
    for layout in result.ranks:
        lines.append(format_rank(layout, full=full))
    if result.pipeline is not None:
        lines.append(f"stopped before the first step: the {result.pipeline.schedule} schedule "
                     "needs its stages to exchange tensor shapes, which the fake process "
                     "group cannot carry")
    return "\n".join(lines)


def format_pipeline(pipe: PipelineSplit) -> list[str]:
    """Which modules each stage runs, on which pp rank, with its parameter count."""
    from composer_par.estimate import format_count

    rank_of = {s: r for r, stages in enumerate(pipe.placement) for s in stages}
    lines = [f"pipeline: {len(pipe.split)} stages over {pipe.dim}({pipe.size}), "
             f"{pipe.schedule} with {pipe.microbatches} microbatches per step"]
    for index, paths in enumerate(pipe.split):
        count = f", {format_count(pipe.stage_params[index])} parameters" if (
            pipe.stage_params) else ""
        lines.append(f"  stage {index} on {pipe.dim} rank {rank_of[index]}: "
                     f"{_collapse(paths)}{count}")
    return lines


def _collapse(paths: Sequence[str]) -> str:
    """``layers.0, layers.1, layers.2`` as ``layers.0-2``."""
    out: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if run:
            prefix, first = run[0]
            last = run[-1][1]
            out.append(f"{prefix}.{first}" + (f"-{last}" if last != first else ""))
            run.clear()

    for path in paths:
        prefix, _, tail = path.rpartition(".")
        if prefix and tail.isdigit():
            if run and (run[0][0] != prefix or run[-1][1] + 1 != int(tail)):
                flush()
            run.append((prefix, int(tail)))
            continue
        flush()
        out.append(path)
    flush()
    return ", ".join(out)
