"""Per-rank memory, per-step communication and step time of a plan, before launch.

The estimate is analytic, from a :class:`ModelShape` (parameter counts, per block when
a model is given), a :class:`Workload` (sequence length, micro-batch, dtypes,
optimizer, activation checkpointing) and a :class:`Layout` (the mesh, the role and owner
of each mesh dim, which cross nodes, what the plugins say of how they run). It never
imports torch unless a model is measured (:meth:`ModelShape.from_module`).

The core knows no plugin. It asks the plan's plugins, in the order the plan applies
them, for what only they know (the hooks of :mod:`composer_par.plugin.hookspecs`): the
pipeline one cuts the model into, the model as the model-parallel ones leave a rank's
view of it, and every plugin's own terms (:class:`EstimatePart`: memory by category,
collectives per mesh dim and what they overlap, compute it adds); then it adds them to
its own accounting (printed with every estimate, :data:`ACCOUNTING`):

* **memory** (ZeRO, Rajbhandari et al. 2020): with 16-bit mixed precision, parameters
  and gradients 2 B each, the optimizer's fp32 master weights + AdamW's two moments
  12 B per parameter; in fp32, 4 + 4 + 8. Each is divided as the claims' roles shard
  parameters: by the shard dims and the dims data parallelism folds in (FSDP2 over
  ``dp_shard x cp``), and by the model-parallel dims on the tensors they split.
* **activations** (Korthikanti et al. 2022), per block and micro-batch, 16-bit:
  ``s*b*h*(34 + 5*a*s/h)`` bytes without TP; ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` with TP
  size t; everything divided by t with sequence parallelism; a Llama's blocks counted
  from their structure (:func:`activation_bytes`).
* **time**: each collective as a ring, rail optimized (:func:`split_bytes`); a step as
  compute (:mod:`.compute`: torchtitan's FLOP count; :mod:`.devices`: the throughput a
  device achieves) plus the communication nothing hides, over ``1 - bubble``
  (:mod:`.step_time`), giving tokens per second per device and MFU.

Its modules, one job each: ``units`` (parse and format counts, sizes, dtypes), ``errors``,
``model_shape``, ``moe_shape`` (a mixture-of-experts model's routed experts), ``presets``
(published model shapes), ``workload``, ``layout`` (mesh dims, roles, node crossing,
merged settings), ``collectives`` (one collective as a plugin states it), ``parts``
(what plugins state, and asking them), ``memory``, ``accumulation`` (the gradient memory
and reductions of each sync policy under gradient accumulation), ``pipeline`` (each
pipeline rank), ``timing`` (the ring time model), ``compute`` (FLOPs per step),
``devices`` (device kinds), ``step_time``, ``estimator`` (:func:`estimate`) and ``report``
(text).
"""

from composer_par.estimate.accumulation import SyncCost, sync_costs
from composer_par.estimate.collectives import KINDS, OVERLAPS, Collective
from composer_par.estimate.compute import StepFlops, flops_per_token, step_flops
from composer_par.estimate.devices import ACHIEVED_SHARE, DEVICES, Device, device
from composer_par.estimate.errors import EstimateError
from composer_par.estimate.estimator import Estimate, estimate, estimate_plan
from composer_par.estimate.layout import DimInfo, Layout, local_workload, run_nodes
from composer_par.estimate.memory import Memory, activation_bytes
from composer_par.estimate.model_shape import ModelShape, ParamGroup, TensorShape
from composer_par.estimate.moe_shape import MoEShape, moe_from_config
from composer_par.estimate.parts import (
    MEMORY_CATEGORIES,
    ComputeTerm,
    EstimatePart,
    EstimatePipeline,
    EstimateRank,
    EstimateSection,
    EstimateStage,
    MemoryTerm,
    runs_of,
)
from composer_par.estimate.pipeline import RankEstimate
from composer_par.estimate.presets import PRESETS, preset
from composer_par.estimate.report import ACCOUNTING, format_estimate
from composer_par.estimate.step_time import StepTime
from composer_par.estimate.timing import (
    DEFAULT_INTER_NODE_GBPS,
    DEFAULT_INTRA_NODE_GBPS,
    DimTraffic,
    split_bytes,
)
from composer_par.estimate.units import (
    DTYPE_BYTES,
    bytes_of,
    dtype_name,
    format_bytes,
    format_count,
    format_seconds,
    parse_bytes,
    parse_count,
)
from composer_par.estimate.workload import AC_MODES, ATTENTION, OPTIMIZERS, Workload

__all__ = [
    "ACCOUNTING",
    "ACHIEVED_SHARE",
    "AC_MODES",
    "ATTENTION",
    "DEFAULT_INTER_NODE_GBPS",
    "DEFAULT_INTRA_NODE_GBPS",
    "DEVICES",
    "DTYPE_BYTES",
    "KINDS",
    "MEMORY_CATEGORIES",
    "OPTIMIZERS",
    "OVERLAPS",
    "PRESETS",
    "Collective",
    "ComputeTerm",
    "Device",
    "DimInfo",
    "DimTraffic",
    "Estimate",
    "EstimateError",
    "EstimatePart",
    "EstimatePipeline",
    "EstimateRank",
    "EstimateSection",
    "EstimateStage",
    "Layout",
    "Memory",
    "MemoryTerm",
    "MoEShape",
    "ModelShape",
    "ParamGroup",
    "RankEstimate",
    "StepFlops",
    "StepTime",
    "SyncCost",
    "TensorShape",
    "Workload",
    "activation_bytes",
    "bytes_of",
    "device",
    "dtype_name",
    "estimate",
    "estimate_plan",
    "flops_per_token",
    "format_bytes",
    "format_count",
    "format_estimate",
    "format_seconds",
    "local_workload",
    "moe_from_config",
    "parse_bytes",
    "parse_count",
    "preset",
    "run_nodes",
    "runs_of",
    "split_bytes",
    "step_flops",
    "sync_costs",
]
