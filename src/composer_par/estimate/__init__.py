"""Per-rank memory and per-step communication of a plan, before launch.

The estimate is analytic, from a :class:`ModelShape` (parameter counts, per block when
a model is given), a :class:`Workload` (sequence length, micro-batch, dtypes,
optimizer, activation checkpointing) and a :class:`Layout` (the mesh, the role of each
mesh dim, which cross nodes). It never imports torch unless a model is measured
(:meth:`ModelShape.from_module`).

The accounting (also printed with every estimate, :data:`ACCOUNTING`):

* **memory** (ZeRO, Rajbhandari et al. 2020): with 16-bit mixed precision, parameters
  and gradients 2 B each, the optimizer's fp32 master weights + AdamW's two moments
  12 B per parameter; in fp32, 4 + 4 + 8. Each is divided as the plan shards
  parameters: by the shard dim (FSDP) and the model-parallel dim (TP, on the tensors it
  splits: every tensor of two or more tensor dims), never by replicate dims.
* **activations** (Korthikanti et al. 2022), per block and micro-batch, 16-bit:
  ``s*b*h*(34 + 5*a*s/h)`` bytes without TP; ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` with TP
  size t; everything divided by t with sequence parallelism. Selective checkpointing
  drops the ``5*a*s/h`` attention term; full checkpointing keeps ``2*s*b*h`` per block
  plus one block's activations while it is recomputed. fp32 doubles them. The
  attention-score term counts only with ``attention="eager"``: SDPA's flash and
  memory-efficient kernels (the default) keep no scores.
* **communication**, logical payload bytes per rank and step (the unit of
  :mod:`composer_par.testing.comm_count`): FSDP all-gathers each parameter group
  (every block, then the root's own parameters) in forward, again in backward when the
  group was resharded after forward, and reduce-scatters its gradients; HSDP then
  all-reduces the reduce-scattered shard over the replicate dim (alone, it all-reduces
  whole gradients); TP moves ``s*b*h`` activations twice per block in forward and twice
  in backward (all-gather + reduce-scatter pairs with sequence parallelism: Megatron's
  count, the input gathered once per attention and once per MLP; without it all-reduces,
  and backward all-reduces the input gradient of every column-parallel Linear: 5 in a
  Llama block), once more at the embedding and at the output head, plus the gathered
  logits unless loss parallelism keeps them sharded; full checkpointing repeats a
  block's forward collectives.
* **time**: ring collectives, as NCCL runs all-gather and reduce-scatter, rail optimized
  (:func:`split_bytes`): a rank sends ``X*(n-1)/n`` for an all-gather or reduce-scatter
  of X bytes over n ranks, twice that for an all-reduce; when the group spans k > 1
  nodes with m ranks on each, 1/m of it leaves the node over the rank's own network link;
  an all-to-all sends X/n to each other rank directly, ``(n-m)/n`` of X across nodes.
  Time = intra-node bytes / intra-node bandwidth + inter-node bytes / inter-node bandwidth
  (per device), summed over collectives: no overlap, no latency term.

Plugins may state their own terms through the ``composer_par_estimate`` hook
(:class:`EstimatePart`); otherwise the built-in estimator of the role of each mesh dim
they claim applies (shard: FSDP, replicate: HSDP/DDP, model parallel: TP). A plugin that
cuts the model into pipeline stages states what each coordinate of its mesh dim holds,
runs and sends (:class:`EstimatePipeline`); each is then estimated on its own
(:mod:`.pipeline`) and the fullest and slowest are reported.

Its modules, one job each: ``units`` (parse and format counts, sizes, dtypes), ``errors``,
``model_shape``, ``moe_shape`` (a mixture-of-experts model's routed experts), ``presets``
(published model shapes), ``experts`` (the experts as expert parallelism holds them),
``workload``, ``layout`` (mesh dims, roles, node crossing), ``memory``,
``collectives`` (the built-in estimator of each role), ``accumulation`` (the gradient
memory and reductions of each sync policy under gradient accumulation), ``parts`` (what
plugins state),
``pipeline`` (each pipeline rank), ``timing`` (the ring time model), ``estimator``
(:func:`estimate`) and ``report`` (text).
"""

from composer_par.estimate.accumulation import SyncCost, sync_costs
from composer_par.estimate.collectives import Collective
from composer_par.estimate.errors import EstimateError
from composer_par.estimate.estimator import Estimate, estimate, estimate_plan
from composer_par.estimate.experts import ExpertRow, ExpertsSummary
from composer_par.estimate.layout import DimInfo, Layout
from composer_par.estimate.memory import Memory, activation_bytes
from composer_par.estimate.model_shape import ModelShape, ParamGroup, TensorShape
from composer_par.estimate.moe_shape import MoEShape, moe_from_config
from composer_par.estimate.parts import (
    EstimatePart,
    EstimatePipeline,
    EstimateRank,
    EstimateStage,
)
from composer_par.estimate.pipeline import RankEstimate
from composer_par.estimate.presets import PRESETS, preset
from composer_par.estimate.report import ACCOUNTING, format_estimate
from composer_par.estimate.timing import (
    DEFAULT_INTER_NODE_GBPS,
    DEFAULT_INTRA_NODE_GBPS,
    DimTraffic,
    split_bytes,
)
from composer_par.estimate.units import (
    DTYPE_BYTES,
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
    "AC_MODES",
    "ATTENTION",
    "DEFAULT_INTER_NODE_GBPS",
    "DEFAULT_INTRA_NODE_GBPS",
    "DTYPE_BYTES",
    "OPTIMIZERS",
    "PRESETS",
    "Collective",
    "DimInfo",
    "DimTraffic",
    "Estimate",
    "EstimateError",
    "EstimatePart",
    "EstimatePipeline",
    "EstimateRank",
    "EstimateStage",
    "ExpertRow",
    "ExpertsSummary",
    "Layout",
    "Memory",
    "MoEShape",
    "ModelShape",
    "ParamGroup",
    "RankEstimate",
    "SyncCost",
    "TensorShape",
    "Workload",
    "activation_bytes",
    "dtype_name",
    "estimate",
    "estimate_plan",
    "format_bytes",
    "format_count",
    "format_estimate",
    "format_seconds",
    "moe_from_config",
    "parse_bytes",
    "parse_count",
    "preset",
    "split_bytes",
    "sync_costs",
]
