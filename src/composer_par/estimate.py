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
  nodes with m ranks on each, 1/m of it leaves the node over the rank's own network link.
  Time = intra-node bytes / intra-node bandwidth + inter-node bytes / inter-node bandwidth
  (per device), summed over collectives: no overlap, no latency term.

Plugins may state their own terms through the ``composer_par_estimate`` hook
(:class:`EstimatePart`); otherwise the built-in estimator of the role of each mesh dim
they claim applies (shard: FSDP, replicate: HSDP/DDP, model parallel: TP).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.mesh import MeshSpec
from composer_par.plugin import Role, Stage
from composer_par.topology import Topology

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.blocks import BlockSpec
    from composer_par.plan import ParallelPlan

# Link bandwidths assumed when neither the topology nor a flag gives them (Gbit/s).
DEFAULT_INTRA_NODE_GBPS = 900.0
DEFAULT_INTER_NODE_GBPS = 100.0

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64"}
OPTIMIZERS = ("adamw", "adam", "sgd", "none")
AC_MODES = ("none", "selective", "full")
ATTENTION = ("sdpa", "eager")

ACCOUNTING: tuple[str, ...] = (
    "memory (ZeRO): 16-bit mixed precision = 2 B parameters + 2 B gradients + 12 B optimizer "
    "(fp32 master + AdamW m, v) per parameter; fp32 = 4 + 4 + 8; SGD keeps only the fp32 "
    "master (4 B, 0 in fp32); each divided by the shard dim and, for tensors it splits, the "
    "tensor-parallel dim",
    "activations (Korthikanti et al. 2022), per block, 16-bit: s*b*h*(34 + 5*a*s/h); with TP t: "
    "s*b*h*(10 + 24/t + 5*a*s/(h*t)); sequence parallel divides all by t; selective AC drops "
    "5*a*s/h; full AC keeps 2*s*b*h per block + one block's activations; fp32 doubles; the "
    "attention-score term 5*a*s/h counts only with eager attention (SDPA's flash and "
    "memory-efficient kernels keep no scores); + s*b*vocab*4 for fp32 logits",
    "FSDP: all-gather every parameter group (each block, then the root) in forward, again in "
    "backward when resharded after forward; reduce-scatter gradients. HSDP: all-reduce the "
    "gradient shard over the replicate dim (alone: the whole gradient). TP: 2 forward + 2 "
    "backward s*b*h activation collectives per block (+2 per recomputed block; without "
    "sequence parallel, one backward all-reduce per column-parallel Linear: 5 in a Llama "
    "block), +1 at the embedding and +1 at the output head each way, + the gathered logits "
    "without loss parallel. Bytes are logical payloads (all-gather: the gathered output; "
    "reduce-scatter: the full input; all-reduce: the tensor)",
    "time: ring collectives (NCCL's), rail optimized: a rank sends X*(n-1)/n for an "
    "all-gather or reduce-scatter of X bytes over n ranks (an all-reduce twice that); when the "
    "group spans k > 1 nodes with m ranks on each, 1/m of that leaves the node through the "
    "rank's own network link, the rest stays inside; seconds = intra bytes / intra-node "
    "bandwidth + inter bytes / inter-node bandwidth (per device), summed over collectives: "
    "no overlap with each other or with compute, no latency term",
)


class EstimateError(ValueError):
    """The inputs cannot give an estimate; the message says which and why."""


# -- units -------------------------------------------------------------------------------

_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_BYTE_UNITS = {
    "": 2**30, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_count(text: str | int | float) -> int:
    """``"13e9"``, ``"1.3B"``, ``"350M"``, ``"7b"`` -> an int count."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
        suffix = ""
    else:
        match = _NUMBER.match(str(text))
        if not match or match.group(2).lower() not in _COUNT_SUFFIX:
            raise EstimateError(f"expected a count like 13e9, 1.3B or 350M; got {text!r}")
        value, suffix = float(match.group(1)), match.group(2).lower()
    count = round(value * _COUNT_SUFFIX[suffix])
    if count < 1:
        raise EstimateError(f"expected a positive count; got {text!r}")
    return count


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"80GB"`` (1e9), ``"512MiB"``; a bare number is GiB."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _NUMBER.match(str(text))
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise EstimateError(f"expected a size like 80GiB, 80GB or 512MiB; got {text!r}")
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _BYTE_UNITS[unit])
    if size < 1:
        raise EstimateError(f"expected a positive size; got {text!r}")
    return size


def dtype_name(value: Any) -> str:
    """``"bf16"``, ``torch.bfloat16``, ``"bfloat16"`` -> ``"bfloat16"``."""
    name = str(value).removeprefix("torch.").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise EstimateError(f"dtype must be one of {sorted(DTYPE_BYTES)} (or bf16, fp16, fp32); "
                            f"got {value!r}")
    return name


def format_bytes(size: float) -> str:
    """``1.5 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def format_count(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.2f} {unit}"
    return str(int(count))


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


# -- the model -----------------------------------------------------------------------------


@attrs.frozen
class TensorShape:
    """One parameter: its shape, and whether TP splits it (tensors of >= 2 tensor dims)."""

    name: str
    shape: tuple[int, ...]
    tp: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, tp: int, shard: int) -> int:
        """Elements one rank holds: split by ``tp`` (on tensor dim 0, for TP tensors), then
        by ``shard`` with tensor dim 0 padded to a multiple of it (as FSDP2 pads)."""
        if not self.shape:
            return 1  # a scalar: every rank holds it (FSDP2 pads it to one element each)
        rows, rest = self.shape[0], math.prod(self.shape[1:])
        if self.tp and tp > 1:
            rows = -(-rows // tp)
        return -(-rows // shard) * rest

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "tp": self.tp}


@attrs.frozen
class ParamGroup:
    """The parameters one FSDP group holds: a block's, or the root's own."""

    name: str
    tensors: tuple[TensorShape, ...]
    block: bool = True
    count: int = 1  # identical groups (the blocks of an analytic model)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def local_numel(self, tp: int, shard: int) -> int:
        return sum(t.local_numel(tp, shard) for t in self.tensors)

    def padded_numel(self, tp: int, shard: int) -> int:
        """Elements of the group's all-gather output on one TP rank (padding included)."""
        return self.local_numel(tp, shard) * shard

    def untouched_numel(self) -> int:
        """Elements of tensors TP does not split (norm weights, biases of 1 tensor dim)."""
        return sum(t.numel for t in self.tensors if not t.tp)


_CONFIG_KEYS = {
    "hidden": ("hidden_size", "dim", "d_model", "n_embd", "embed_dim"),
    "heads": ("num_attention_heads", "n_heads", "n_head", "num_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads"),
    "ffn_hidden": ("intermediate_size", "ffn_hidden", "ffn_dim", "n_inner", "dim_feedforward"),
    "vocab": ("vocab_size",),
}


@attrs.frozen
class ModelShape:
    """What the estimator needs of a model: sizes, and its parameter groups."""

    params: int
    layers: int
    hidden: int
    heads: int | None = None
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab: int | None = None
    groups: tuple[ParamGroup, ...] = ()
    dtype: str | None = None  # the parameters' own dtype, when known
    matrices_per_block: int | None = None  # tensors of >= 2 tensor dims in one block
    source: str = ""
    assumed: tuple[str, ...] = ()  # what was not given and had to be assumed

    @classmethod
    def from_numbers(
        cls,
        *,
        params: int | None = None,
        layers: int | None = None,
        hidden: int | None = None,
        heads: int | None = None,
        kv_heads: int | None = None,
        ffn_hidden: int | None = None,
        vocab: int | None = None,
    ) -> ModelShape:
        """An analytic transformer: ``layers`` identical blocks plus the rest (embeddings,
        output head). Missing sizes are derived, and listed in ``assumed``:

        * hidden and layers from params with GPT-3's aspect (hidden ~ 128 * layers);
        * heads = hidden / 128; per-block parameters 12 * hidden**2 (4 for attention, 8 for
          a 4x MLP) or, given heads / kv_heads / ffn_hidden, the Llama count;
        * params from the shape when not given.
        """
        assumed: list[str] = []
        for name, value in (("params", params), ("layers", layers), ("hidden", hidden),
                            ("heads", heads), ("kv_heads", kv_heads),
                            ("ffn_hidden", ffn_hidden), ("vocab", vocab)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise EstimateError(f"{name} must be a positive int; got {value!r}")
        if params is None and (layers is None or hidden is None):
            raise EstimateError("give the parameter count (--params), or the layers and the "
                                "hidden size (--layers, --hidden)")
        if hidden is None:
            assert params is not None  # checked above
            if layers is not None:
                hidden = max(128, round(math.sqrt(params / (12 * layers)) / 128) * 128)
            else:
                hidden = max(128, round((128 * params / 12) ** (1 / 3) / 128) * 128)
            assumed.append(f"hidden {hidden}")
        if layers is None:
            assert params is not None
            layers = max(1, round(params / (12 * hidden * hidden)))
            assumed.append(f"layers {layers}")
        if heads is None:
            heads = max(1, hidden // 128)
            assumed.append(f"heads {heads} (head dim 128)")
        if hidden % heads:
            raise EstimateError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        kv = kv_heads if kv_heads is not None else heads
        head_dim = hidden // heads
        attention = hidden * head_dim * (2 * heads + 2 * kv)
        mlp = 3 * hidden * ffn_hidden if ffn_hidden else 8 * hidden * hidden
        per_block = attention + mlp + 2 * hidden
        embeddings = 2 * vocab * hidden + hidden if vocab else 0
        if params is None:
            params = layers * per_block + embeddings
        elif layers * per_block > params:
            per_block = params // layers
        root = max(0, params - layers * per_block)
        block_tensors = (
            TensorShape("block.matrices", (max(1, (per_block - 2 * hidden) // hidden), hidden)),
            TensorShape("block.norms", (2 * hidden,), tp=False),
        ) if per_block > 2 * hidden else (TensorShape("block", (per_block,)),)
        groups = [ParamGroup("blocks", block_tensors, block=True, count=layers)]
        if root:
            groups.append(ParamGroup("root", (TensorShape("root", (-(-root // hidden), hidden)),),
                                     block=False))
        return cls(params=params, layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                   ffn_hidden=ffn_hidden, vocab=vocab, groups=tuple(groups),
                   source="numbers", assumed=tuple(assumed))

    @classmethod
    def from_module(
        cls, model: nn.Module, block_spec: BlockSpec | None = None, *, source: str = "",
        **overrides: int | None,
    ) -> ModelShape:
        """Measure a model (ideally built on meta): its blocks as the shared block finder
        sees them, each block's and the root's own parameters, and the sizes from its
        ``config`` (Hugging Face and Llama names) or its modules."""
        import torch.nn as nn

        from composer_par.blocks import clean_name, find_blocks

        blocks = find_blocks(model, block_spec)
        seen: set[int] = set()
        groups: list[ParamGroup] = []
        for path, block in blocks:
            tensors = []
            for name, p in block.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    tensors.append(TensorShape(clean_name(f"{path}.{name}"), tuple(p.shape),
                                               tp=p.dim() >= 2))
            groups.append(ParamGroup(clean_name(path), tuple(tensors), block=True))
        root = []
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                root.append(TensorShape(clean_name(name), tuple(p.shape), tp=p.dim() >= 2))
        if root:
            groups.append(ParamGroup("root", tuple(root), block=False))
        config = getattr(model, "config", None)
        found: dict[str, int | None] = {}
        for key, names in _CONFIG_KEYS.items():
            found[key] = next((int(getattr(config, n)) for n in names
                               if isinstance(getattr(config, n, None), int)), None)
        assumed = []
        if found["vocab"] is None:
            embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
            if embeddings:
                found["vocab"] = max(e.num_embeddings for e in embeddings)
                if found["hidden"] is None:
                    found["hidden"] = embeddings[0].embedding_dim
        if found["heads"] is None:
            for module in model.modules():
                heads = getattr(module, "num_heads", getattr(module, "n_heads", None))
                if isinstance(heads, int):
                    found["heads"] = heads
                    kv = getattr(module, "n_kv_heads", getattr(module, "num_key_value_heads",
                                                                None))
                    if isinstance(kv, int) and found["kv_heads"] is None:
                        found["kv_heads"] = kv
                    break
        if found["hidden"] is None:
            linear = next((m for _, b in blocks for m in b.modules() if isinstance(m, nn.Linear)),
                          None)
            if linear is None:
                linear = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
            found["hidden"] = linear.in_features if linear is not None else 1
            assumed.append(f"hidden {found['hidden']} (the first Linear's in_features)")
        for key, value in overrides.items():
            if value is not None:
                found[key] = value
        dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
        params = sum(g.numel for g in groups)
        matrices = (sum(1 for t in groups[0].tensors if t.tp) if blocks else None)
        return cls(params=params, layers=len(blocks), hidden=int(found["hidden"] or 1),
                   heads=found["heads"], kv_heads=found["kv_heads"] or found["heads"],
                   ffn_hidden=found["ffn_hidden"], vocab=found["vocab"], groups=tuple(groups),
                   dtype=dtypes.pop() if len(dtypes) == 1 else None, matrices_per_block=matrices,
                   source=source or "model",
                   assumed=tuple(assumed))

    @property
    def block_groups(self) -> list[ParamGroup]:
        return [g for g in self.groups if g.block]

    def describe(self) -> str:
        parts = [f"{format_count(self.params)} parameters", f"{self.layers} block(s)",
                 f"hidden {self.hidden}"]
        if self.heads:
            kv = f" ({self.kv_heads} kv)" if self.kv_heads and self.kv_heads != self.heads else ""
            parts.append(f"{self.heads} heads{kv}")
        if self.vocab:
            parts.append(f"vocab {self.vocab}")
        text = ", ".join(parts)
        if self.assumed:
            text += f" (assumed: {', '.join(self.assumed)})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": self.params, "layers": self.layers, "hidden": self.hidden,
            "heads": self.heads, "kv_heads": self.kv_heads, "ffn_hidden": self.ffn_hidden,
            "vocab": self.vocab, "dtype": self.dtype, "source": self.source,
            "assumed": list(self.assumed),
            "groups": [{"name": g.name, "params": g.numel, "count": g.count, "block": g.block}
                       for g in self.groups],
        }


# -- the workload ----------------------------------------------------------------------------


def _optional_dtype(value: Any) -> str | None:
    return None if value is None else dtype_name(value)


def _positive_int(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimateError(f"{attribute.name} must be a positive int; got {value!r}")


@attrs.frozen
class Workload:
    """One training step: ``grad_accum`` micro-batches of ``micro_batch`` sequences of
    ``seq`` tokens per data-parallel rank. ``dtype`` None takes the plan's mixed
    precision, else the model's dtype, else float32; ``activation_checkpoint`` None takes
    the plan's activation checkpointing plugin, else none."""

    seq: int = attrs.field(validator=_positive_int)
    micro_batch: int = attrs.field(default=1, validator=_positive_int)
    dtype: str | None = attrs.field(default=None, converter=_optional_dtype)
    reduce_dtype: str | None = attrs.field(default=None, converter=_optional_dtype)
    optimizer: str = attrs.field(default="adamw", validator=attrs.validators.in_(OPTIMIZERS))
    activation_checkpoint: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(AC_MODES)))
    grad_accum: int = attrs.field(default=1, validator=_positive_int)
    attention: str = attrs.field(default="sdpa", validator=attrs.validators.in_(ATTENTION))

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


# -- the layout ------------------------------------------------------------------------------


@attrs.frozen
class DimInfo:
    """One mesh dim as the estimator sees it."""

    name: str
    size: int
    role: Role | None
    plugin: str | None
    nodes: int  # nodes its widest group spans (1 without a topology)
    known: bool  # whether a topology says where it lies

    @property
    def crosses_nodes(self) -> bool | None:
        return self.nodes > 1 if self.known else None


@attrs.frozen
class Layout:
    """The mesh with a role for each mesh dim, and the options that change the estimate."""

    mesh: MeshSpec
    topology: Topology | None
    dims: tuple[DimInfo, ...]
    reshard_after_forward: bool | int | None = None
    param_dtype: str | None = None  # the data-parallel plugin's mixed precision
    reduce_dtype: str | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    activation_checkpoint: str | None = None
    checkpoint_every: int = 1
    plugins: tuple[str, ...] = ()

    @classmethod
    def build(
        cls, mesh: MeshSpec, topology: Topology | None, roles: Mapping[str, Role],
        owners: Mapping[str, str] | None = None, **options: Any,
    ) -> Layout:
        """A layout from a resolved mesh and ``{dim: role}`` (what :func:`suggest` builds)."""
        if not mesh.is_resolved:
            raise EstimateError(f"{mesh.equation()}: give the world size to resolve the mesh")
        known = topology is not None and topology.world_size == mesh.world_size
        dims = []
        for name, size in mesh.dims:
            nodes = topology.nodes_spanned(mesh, name) if known and topology else 1
            dims.append(DimInfo(name, size, roles.get(name), (owners or {}).get(name), nodes,
                                known))
        return cls(mesh, topology if known else None, tuple(dims), **options)

    @classmethod
    def from_plan(cls, plan: ParallelPlan, world_size: int | None = None) -> Layout:
        """The layout a plan makes: roles from the plugins' claims, FSDP options from the
        plugin with the shard role, sequence/loss parallel from the model-parallel one,
        activation checkpointing from the plugin that implements that stage."""
        from composer_par.hooks import Hooks

        world = world_size if world_size is not None else plan.world_size()
        if world is None:
            raise EstimateError(f"{plan.mesh.equation()}: the world size is unknown; give "
                                "--world-size or --nodes/--devices-per-node")
        problem = plan.mesh.check_world_size(world)
        if problem:
            raise EstimateError(problem)
        mesh = plan.mesh.resolve(world)
        hooks = Hooks(plan.plugins)
        by_name = {hooks.name_of(p): p for p in plan.plugins}
        roles: dict[str, Role] = {}
        owners: dict[str, str] = {}
        for decl in hooks.declarations():
            for claim in decl.claims:
                if claim.dim in mesh and claim.dim not in roles:
                    roles[claim.dim] = claim.role
                    owners[claim.dim] = decl.plugin
        options: dict[str, Any] = {"plugins": tuple(by_name)}
        for dim, role in roles.items():
            plugin = by_name.get(owners[dim])
            if role is Role.SHARD and plugin is not None:
                options["reshard_after_forward"] = getattr(plugin, "reshard_after_forward", None)
                mp = getattr(plugin, "mixed_precision", None)
                options["param_dtype"] = _optional_dtype(getattr(mp, "param_dtype", None))
                options["reduce_dtype"] = _optional_dtype(getattr(mp, "reduce_dtype", None))
            if role is Role.MODEL_PARALLEL and plugin is not None:
                options["sequence_parallel"] = bool(getattr(plugin, "sequence_parallel", False))
                options["loss_parallel"] = bool(getattr(plugin, "loss_parallel", False))
        for plugin in plan.plugins:
            if Stage.ACTIVATION_CHECKPOINT in plugin.stages():
                mode = str(getattr(plugin, "mode", "full"))
                options["activation_checkpoint"] = "selective" if "selective" in mode else "full"
                every = getattr(plugin, "every", 1)
                options["checkpoint_every"] = every if isinstance(every, int) and every > 0 else 1
        return cls.build(mesh, plan.effective_topology(), roles, owners, **options)

    def dims_with(self, role: Role) -> list[DimInfo]:
        return [d for d in self.dims if d.role is role and d.size > 1]

    def size_of(self, role: Role) -> int:
        return math.prod(d.size for d in self.dims_with(role))

    def describe(self) -> str:
        return self.mesh.equation() + (f" on {self.topology.describe()}" if self.topology else "")


# -- results ---------------------------------------------------------------------------------


@attrs.frozen
class Collective:
    """Collectives of one kind on one mesh dim per step: ``calls`` of them, ``payload``
    logical bytes in all (see :mod:`composer_par.testing.comm_count`).

    ``group_size``/``nodes`` override the mesh dim's group (FSDP2's sub-groups for an
    int ``reshard_after_forward``)."""

    dim: str
    kind: str  # all_gather, reduce_scatter, all_reduce, broadcast, all_to_all
    payload: int
    calls: int
    why: str
    group_size: int | None = None
    nodes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


@attrs.frozen
class EstimatePart:
    """What a plugin's ``composer_par_estimate`` hook returns.

    ``collectives``: when not None, replaces the built-in estimate of the mesh dims this
    plugin claims (an empty tuple: no communication there). ``memory``: extra per-rank
    bytes by name (e.g. a plugin's own buffers). ``activation_checkpoint``: the
    activation policy the plugin applies ("none", "selective" or "full"), if it decides it.
    """

    collectives: tuple[Collective, ...] | None = None
    memory: Mapping[str, int] = attrs.field(factory=dict)
    activation_checkpoint: str | None = None


@attrs.frozen
class DimTraffic:
    """One mesh dim's communication per step and rank."""

    dim: DimInfo
    collectives: tuple[Collective, ...]
    payload: int
    intra_bytes: float
    inter_bytes: float
    seconds: float

    def calls(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + c.calls
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "dim": self.dim.name, "size": self.dim.size,
            "role": self.dim.role.value if self.dim.role else None,
            "plugin": self.dim.plugin, "nodes_spanned": self.dim.nodes,
            "crosses_nodes": self.dim.crosses_nodes, "payload_bytes": self.payload,
            "calls": self.calls(), "intra_node_bytes": round(self.intra_bytes),
            "inter_node_bytes": round(self.inter_bytes), "seconds": self.seconds,
            "collectives": [c.to_dict() for c in self.collectives],
        }


@attrs.frozen
class Memory:
    """Per-rank bytes at peak, by component; ``activations_by_mode`` gives the
    activations with each activation-checkpointing mode for comparison."""

    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    activations_by_mode: Mapping[str, int]
    extra: Mapping[str, int] = attrs.field(factory=dict)
    local_params: int = 0  # elements of parameters one rank holds

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations
                + self.comm_buffers + sum(self.extra.values()))

    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "comm_buffers": self.comm_buffers,
                "extra": dict(self.extra), "total": self.total,
                "activations_by_mode": dict(self.activations_by_mode),
                "local_params": self.local_params}


@attrs.frozen
class Estimate:
    layout: Layout
    model: ModelShape
    workload: Workload
    dtype: str
    reduce_dtype: str
    activation_checkpoint: str
    memory: Memory
    traffic: tuple[DimTraffic, ...]
    intra_node_gbps: float
    inter_node_gbps: float
    bandwidth_assumed: tuple[str, ...]
    notes: tuple[str, ...] = ()
    device_memory: int | None = None

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.traffic)

    @property
    def payload(self) -> int:
        return sum(t.payload for t in self.traffic)

    @property
    def inter_bytes(self) -> float:
        return sum(t.inter_bytes for t in self.traffic)

    def payload_by_dim(self) -> dict[str, int]:
        return {t.dim.name: t.payload for t in self.traffic}

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.memory.total <= self.device_memory

    def to_dict(self) -> dict[str, Any]:
        topology = self.layout.topology
        return {
            "mesh": self.layout.mesh.to_dict(),
            "topology": topology.to_dict() if topology else None,
            "model": self.model.to_dict(),
            "workload": {**self.workload.to_dict(), "dtype": self.dtype,
                         "reduce_dtype": self.reduce_dtype,
                         "activation_checkpoint": self.activation_checkpoint},
            "memory": self.memory.to_dict(),
            "device_memory": self.device_memory,
            "fits": self.fits,
            "communication": [t.to_dict() for t in self.traffic],
            "communication_seconds": self.seconds,
            "bandwidth_gbps": {"intra_node": self.intra_node_gbps,
                               "inter_node": self.inter_node_gbps,
                               "assumed": list(self.bandwidth_assumed)},
            "accounting": list(ACCOUNTING),
            "notes": list(self.notes),
        }

    def format(self, paint: Any = None) -> str:
        return format_estimate(self, paint)


# -- the estimator ---------------------------------------------------------------------------


def split_bytes(kind: str, payload: float, group: int, nodes: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends for a collective of ``payload``
    logical bytes over ``group`` ranks on ``nodes`` nodes.

    Ring collectives (NCCL's algorithm for all-gather and reduce-scatter), rail
    optimized: a rank sends ``X*(n-1)/n`` for an all-gather or reduce-scatter of X bytes
    over n ranks, twice that for an all-reduce; when the group spans k > 1 nodes with m
    ranks on each, NCCL spreads the ring's node crossings over the m ranks' own network
    links, so 1/m of it leaves the node and the rest stays on intra-node links.
    """
    if group <= 1 or payload <= 0:
        return 0.0, 0.0
    nodes = max(1, min(nodes, group))
    wire = payload * (group - 1) / group
    if kind == "all_reduce":
        wire *= 2
    if nodes == 1:
        return wire, 0.0
    per_node = group / nodes
    return wire * (per_node - 1) / per_node, wire / per_node


def _bytes_of(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def activation_bytes(
    model: ModelShape, workload: Workload, dtype: str, *, tp: int, sequence_parallel: bool,
    loss_parallel: bool, mode: str, every: int = 1,
) -> int:
    """Per-rank activation bytes of one micro-batch (Korthikanti et al. 2022)."""
    s, b, h = workload.seq, workload.micro_batch, model.hidden
    sbh = s * b * h
    eager = workload.attention == "eager" and model.heads
    attention = 5 * model.heads * s / h if eager else 0.0  # type: ignore[operator]
    if tp > 1 and sequence_parallel:
        full_block = sbh * (34 + attention) / tp
        selective_block = sbh * 34 / tp
        kept = 2 * sbh / tp
    elif tp > 1:
        full_block = sbh * (10 + 24 / tp + attention / tp)
        selective_block = sbh * (10 + 24 / tp)
        kept = 2 * sbh
    else:
        full_block = sbh * (34 + attention)
        selective_block = sbh * 34
        kept = 2 * sbh
    layers = model.layers
    if mode == "none":
        total = layers * full_block
    elif mode == "selective":
        checkpointed = layers // every
        total = checkpointed * selective_block + (layers - checkpointed) * full_block
    else:
        checkpointed = layers // every
        total = checkpointed * kept + (layers - checkpointed) * full_block
        if checkpointed:
            total += full_block  # one block's activations while it is recomputed
    scale = _bytes_of(dtype) / 2  # the coefficients are for 16-bit activations
    logits = 0.0
    if model.vocab:
        logits = s * b * model.vocab * 4 / (tp if loss_parallel and tp > 1 else 1)
    return int(total * scale + logits)


def _optimizer_bytes(optimizer: str, mixed: bool) -> int:
    if optimizer in ("adamw", "adam"):
        return 12 if mixed else 8
    if optimizer == "sgd":
        return 4 if mixed else 0
    return 0


def _fsdp_collectives(
    layout: Layout, model: ModelShape, dim: DimInfo, tp: int, ag_bytes: int, rs_bytes: int,
    micro: int,
) -> list[Collective]:
    """FSDP2 over ``dim``: which groups all-gather and reduce-scatter, with padding."""
    f = dim.size
    reshard = layout.reshard_after_forward
    out: list[Collective] = []
    groups = [g for g in model.groups if g.numel]
    ag_fwd = sum(g.padded_numel(tp, f) * g.count for g in groups) * ag_bytes
    calls = sum(g.count for g in groups)
    out.append(Collective(dim.name, "all_gather", ag_fwd * micro, calls * micro,
                          "parameters, forward (every group)"))
    # Which groups are resharded after forward, so all-gathered again in backward.
    # None (torch's default): every group but the root's; True / an int: every group.
    again = [g for g in groups if reshard is not False and (g.block or reshard is not None)]
    if isinstance(reshard, int) and not isinstance(reshard, bool) and reshard < f:
        if reshard > 1:
            nodes = _run_nodes(layout, dim.name, reshard)
            payload = sum(g.padded_numel(tp, f) * g.count for g in again) * ag_bytes
            out.append(Collective(dim.name, "all_gather", payload * micro,
                                  sum(g.count for g in again) * micro,
                                  f"parameters, backward (resharded to groups of {reshard})",
                                  group_size=reshard, nodes=nodes))
    elif again:
        payload = sum(g.padded_numel(tp, f) * g.count for g in again) * ag_bytes
        out.append(Collective(dim.name, "all_gather", payload * micro,
                              sum(g.count for g in again) * micro,
                              "parameters, backward (groups resharded after forward)"))
    rs = sum(g.padded_numel(tp, f) * g.count for g in groups) * rs_bytes
    out.append(Collective(dim.name, "reduce_scatter", rs * micro, calls * micro,
                          "gradients, backward (every group)"))
    return out


def _run_nodes(layout: Layout, dim: str, run: int) -> int:
    """Nodes spanned by FSDP2's post-forward groups: runs of ``run`` consecutive members
    of each group of ``dim``."""
    if layout.topology is None:
        return 1
    widest = 1
    for group in layout.mesh.rank_groups(dim):
        for i in range(0, len(group), run):
            widest = max(widest, len({layout.topology.node_of(r) for r in group[i:i + run]}))
    return widest


def _replicate_collectives(
    model: ModelShape, dim: DimInfo, tp: int, shard: int, rs_bytes: int, micro: int,
    with_shard: bool,
) -> list[Collective]:
    groups = [g for g in model.groups if g.numel]
    payload = sum(g.local_numel(tp, shard) * g.count for g in groups) * rs_bytes
    calls = sum(g.count for g in groups)
    why = ("gradient shards after the reduce-scatter (HSDP)" if with_shard
           else "gradients, per group (replicate alone, DDP-like)")
    return [Collective(dim.name, "all_reduce", payload * micro, calls * micro, why)]


def _tp_collectives(
    layout: Layout, model: ModelShape, workload: Workload, dim: DimInfo, act_bytes: int,
    grad_bytes: int, mode: str, micro: int, shard: int,
) -> list[Collective]:
    x = workload.seq * workload.micro_batch * model.hidden * act_bytes
    layers = model.layers
    recomputed = layers // layout.checkpoint_every if mode == "full" else 0
    has_root = any(not g.block and g.numel for g in model.groups)
    root = 1 if has_root else 0
    out: list[Collective] = []
    if layout.sequence_parallel:
        # per block and direction: gather the attention and the MLP input, reduce-scatter
        # their outputs; the embedding scatters (forward) and the head gathers its input
        calls = 2 * (2 * layers + root) + 2 * recomputed
        out.append(Collective(dim.name, "all_gather", calls * x * micro, calls * micro,
                              "activations (sequence parallel): attention/MLP inputs"))
        out.append(Collective(dim.name, "reduce_scatter", calls * x * micro, calls * micro,
                              "activations (sequence parallel): attention/MLP outputs"))
        if shard > 1:
            # the sequence-parallel norms' gradients are partial sums over tp; FSDP2
            # all-reduces them to the parameters' placement before reduce-scattering
            norms = sum(g.untouched_numel() * g.count for g in model.groups)
            if norms:
                count = sum(sum(1 for t in g.tensors if not t.tp) * g.count
                            for g in model.groups)
                out.append(Collective(dim.name, "all_reduce", norms * grad_bytes * micro,
                                      count * micro, "gradients of sequence-parallel norms"))
    else:
        # forward: the row-parallel outputs (2 per block) and the embedding; backward: the
        # input gradient of every column-parallel Linear that takes a replicated input
        # (torch's ColwiseParallel reduces each separately) and of the output head
        colwise = max(2, model.matrices_per_block - 2) if model.matrices_per_block else 2
        calls = (2 * layers + root + 2 * recomputed) + (colwise * layers + root)
        out.append(Collective(dim.name, "all_reduce", calls * x * micro, calls * micro,
                              f"activations: forward 2 per block, backward {colwise} per block "
                              "(one per column-parallel input), +1 each way at the "
                              "embedding / output head"))
    if model.vocab and has_root and not layout.loss_parallel:
        logits = workload.seq * workload.micro_batch * model.vocab * act_bytes
        out.append(Collective(dim.name, "all_gather", logits * micro, micro,
                              "logits gathered from the vocabulary-split output head"))
    return out


def estimate(
    layout: Layout,
    model: ModelShape,
    workload: Workload,
    *,
    plan: ParallelPlan | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    device_memory: int | None = None,
) -> Estimate:
    """Per-rank memory and per-step communication of ``layout`` training ``model``.

    Bandwidths: the arguments, else the layout's topology, else the defaults
    (:data:`DEFAULT_INTRA_NODE_GBPS`, :data:`DEFAULT_INTER_NODE_GBPS`), reported as
    assumed. With ``plan``, its plugins' ``composer_par_estimate`` hooks are asked.
    """
    notes: list[str] = []
    parts: list[tuple[str, EstimatePart]] = []
    if plan is not None:
        parts = _plugin_parts(plan, layout, model, workload)
    # dtypes: the workload's, else the plan's mixed precision, else the model's, else fp32
    dtype = workload.dtype or layout.param_dtype or model.dtype
    if dtype is None:
        dtype = "float32"
        notes.append("dtype float32: neither --dtype nor the plan's mixed precision says "
                     "otherwise (pass --dtype bf16 for 16-bit mixed precision)")
    reduce_dtype = workload.reduce_dtype or (layout.reduce_dtype if workload.dtype is None
                                              else None) or dtype
    mixed = _bytes_of(dtype) == 2
    mode = workload.activation_checkpoint or layout.activation_checkpoint or "none"
    for who, part in parts:
        if part.activation_checkpoint and workload.activation_checkpoint is None:
            mode = part.activation_checkpoint
            notes.append(f"activation checkpointing {mode}: stated by {who}")
    every = layout.checkpoint_every if workload.activation_checkpoint is None else 1
    layout = attrs.evolve(layout, checkpoint_every=every)
    tp = layout.size_of(Role.MODEL_PARALLEL)
    shard_dims = layout.dims_with(Role.SHARD)
    replicate_dims = layout.dims_with(Role.REPLICATE)
    shard = math.prod(d.size for d in shard_dims)
    micro = workload.grad_accum
    pbytes, abytes = _bytes_of(dtype), _bytes_of(dtype)
    ag_bytes, rs_bytes = _bytes_of(dtype), _bytes_of(reduce_dtype)

    # memory ------------------------------------------------------------------------------
    local = sum(g.local_numel(tp, shard) * g.count for g in model.groups)
    params_b = local * (2 if mixed else pbytes)
    grads_b = local * (2 if mixed else pbytes)
    optim_b = local * _optimizer_bytes(workload.optimizer, mixed)
    by_mode = {m: activation_bytes(model, workload, dtype, tp=tp,
                                   sequence_parallel=layout.sequence_parallel,
                                   loss_parallel=layout.loss_parallel, mode=m,
                                   every=every if m == mode else 1)
               for m in AC_MODES}
    buffers = 0
    blocks = [g for g in model.groups if g.block and g.numel]
    largest = max((g.padded_numel(tp, shard) for g in blocks), default=0)
    if shard > 1:
        # the unsharded parameters of the current and the prefetched group, and the
        # unsharded gradients of one group before its reduce-scatter
        buffers += 2 * largest * ag_bytes + largest * rs_bytes
        root = [g for g in model.groups if not g.block and g.numel]
        if root and layout.reshard_after_forward is None:
            buffers += root[0].padded_numel(tp, shard) * ag_bytes  # the root stays unsharded
    elif replicate_dims:
        buffers += largest * rs_bytes
    if tp > 1:
        buffers += 2 * workload.seq * workload.micro_batch * model.hidden * abytes
    extra: dict[str, int] = {}
    for who, part in parts:
        for name, size in part.memory.items():
            extra[f"{who}: {name}"] = int(size)
    memory = Memory(params_b, grads_b, optim_b, by_mode[mode], buffers, by_mode, extra, local)

    # communication -----------------------------------------------------------------------
    replaced = {d for who, part in parts if part.collectives is not None
                for d in _claimed_dims(layout, who)}
    collectives: list[Collective] = []
    for _, part in parts:
        if part.collectives is not None:
            collectives.extend(part.collectives)
    for dim in layout.dims:
        if dim.size <= 1 or dim.name in replaced:
            continue
        if dim.role is Role.SHARD:
            collectives += _fsdp_collectives(layout, model, dim, tp, ag_bytes, rs_bytes, micro)
        elif dim.role is Role.REPLICATE:
            collectives += _replicate_collectives(model, dim, tp, shard, rs_bytes, micro,
                                                  with_shard=shard > 1)
        elif dim.role is Role.MODEL_PARALLEL:
            collectives += _tp_collectives(layout, model, workload, dim, abytes, ag_bytes,
                                           mode, micro, shard)
        elif dim.role is Role.OTHER:
            notes.append(f"{dim.name}: {dim.plugin} states no estimate (role 'other')")

    intra_gbps, inter_gbps, assumed = _bandwidths(layout.topology, intra_node_gbps,
                                                  inter_node_gbps)
    traffic = []
    for dim in layout.dims:
        mine = tuple(c for c in collectives if c.dim == dim.name)
        if not mine:
            continue
        intra = inter = 0.0
        for c in mine:
            group = c.group_size or dim.size
            nodes = c.nodes if c.nodes is not None else dim.nodes
            a, e = split_bytes(c.kind, c.payload, group, nodes)
            intra, inter = intra + a, inter + e
        seconds = intra / (intra_gbps * 1e9 / 8) + inter / (inter_gbps * 1e9 / 8)
        traffic.append(DimTraffic(dim, mine, sum(c.payload for c in mine), intra, inter,
                                  seconds))
    if layout.topology is None and any(d.size > 1 for d in layout.dims):
        notes.append("no topology: every mesh dim is counted as inside a node (give "
                     "--nodes/--devices-per-node)")
    return Estimate(layout, model, workload, dtype, reduce_dtype, mode, memory,
                    tuple(traffic), intra_gbps, inter_gbps, assumed, tuple(notes),
                    device_memory)


def _claimed_dims(layout: Layout, plugin: str) -> set[str]:
    return {d.name for d in layout.dims if d.plugin == plugin}


def _bandwidths(
    topology: Topology | None, intra: float | None, inter: float | None
) -> tuple[float, float, tuple[str, ...]]:
    assumed = []
    if intra is None:
        intra = topology.intra_node_gbps if topology is not None else None
    if intra is None:
        intra = DEFAULT_INTRA_NODE_GBPS
        assumed.append("intra_node")
    if inter is None:
        inter = topology.inter_node_gbps if topology is not None else None
    if inter is None:
        inter = DEFAULT_INTER_NODE_GBPS
        assumed.append("inter_node")
    return float(intra), float(inter), tuple(assumed)


def _plugin_parts(
    plan: ParallelPlan, layout: Layout, model: ModelShape, workload: Workload
) -> list[tuple[str, EstimatePart]]:
    from composer_par.hooks import Hooks

    out = []
    for name, part in Hooks(plan.plugins).estimate_parts(plan, layout, model, workload):
        if not isinstance(part, EstimatePart):
            raise EstimateError(f"plugin {name!r}: composer_par_estimate must return an "
                                f"EstimatePart or None; got {type(part).__name__}")
        out.append((name, part))
    return out


def estimate_plan(
    plan: ParallelPlan,
    model: ModelShape,
    workload: Workload,
    *,
    world_size: int | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    device_memory: int | None = None,
) -> Estimate:
    """:func:`estimate` for a plan: its layout, and its plugins' own terms."""
    layout = Layout.from_plan(plan, world_size)
    return estimate(layout, model, workload, plan=plan, intra_node_gbps=intra_node_gbps,
                    inter_node_gbps=inter_node_gbps, device_memory=device_memory)


# -- text ----------------------------------------------------------------------------------


def _table(rows: Sequence[Sequence[str]], header: Sequence[str],
           right: Iterable[int] = ()) -> list[str]:
    right = set(right)
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, *rows):
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return lines


def format_estimate(est: Estimate, paint: Any = None) -> str:
    """The estimate as text; ``paint(text, style)`` colors (the CLI's Output.paint)."""
    paint = paint or (lambda text, style: text)
    mem, work, layout = est.memory, est.workload, est.layout
    lines = [f"layout: {layout.describe()}", f"model: {est.model.describe()}"]
    mixed = _bytes_of(est.dtype) == 2
    precision = (f"{est.dtype} mixed precision (gradients reduced in {est.reduce_dtype})"
                 if mixed else est.dtype)
    ac = est.activation_checkpoint + (f" (every {layout.checkpoint_every} blocks)"
                                      if layout.checkpoint_every > 1 else "")
    lines.append(f"workload: seq {work.seq}, micro-batch {work.micro_batch}"
                 + (f" x {work.grad_accum} accumulated" if work.grad_accum > 1 else "")
                 + f", {precision}, {work.optimizer}, activation checkpointing {ac}, "
                 f"attention {work.attention}")
    tp = layout.size_of(Role.MODEL_PARALLEL)
    shard = layout.size_of(Role.SHARD)
    divided = " / ".join(f"{d.name}({d.size})" for d in layout.dims
                         if d.size > 1 and d.role in (Role.SHARD, Role.MODEL_PARALLEL))
    lines += ["", "memory per rank:"]
    pb = 2 if mixed else _bytes_of(est.dtype)
    ob = _optimizer_bytes(work.optimizer, mixed)
    rows: list[tuple[str, ...]] = [
        ("parameters", format_bytes(mem.params),
         f"{format_count(mem.local_params)} of {format_count(est.model.params)} params here"
         + (f" (divided by {divided})" if divided else "") + f", {pb} B each"),
        ("gradients", format_bytes(mem.grads), f"{pb} B per parameter"),
        ("optimizer states", format_bytes(mem.optimizer),
         f"{work.optimizer}: {ob} B per parameter"),
        ("activations", format_bytes(mem.activations),
         "AC " + ", ".join(f"{m}: {format_bytes(v)}" for m, v in mem.activations_by_mode.items())),
        ("communication buffers", format_bytes(mem.comm_buffers),
         "unsharded groups in flight" if shard > 1 else ("activation buffers" if tp > 1 else "")),
    ]
    rows += [(name, format_bytes(size), "") for name, size in mem.extra.items()]
    total = format_bytes(mem.total)
    verdict = ""
    if est.device_memory is not None:
        verdict = (paint(f"fits in {format_bytes(est.device_memory)}", "ok") if est.fits
                   else paint(f"does NOT fit in {format_bytes(est.device_memory)}", "ERROR"))
    rows.append(("total", total, verdict))
    lines += ["  " + line for line in _table(rows, ("COMPONENT", "BYTES", "HOW"), right=(1,))]
    lines += ["", "communication per step and rank:"]
    if est.traffic:
        rows = []
        for t in est.traffic:
            where = ("crosses nodes" if t.dim.crosses_nodes
                     else "inside a node" if t.dim.crosses_nodes is False else "?")
            calls = ", ".join(f"{k} x{v}" for k, v in t.calls().items())
            rows.append((f"{t.dim.name}({t.dim.size})", t.dim.role.value if t.dim.role else "-",
                         where, calls, format_bytes(t.payload), format_bytes(t.intra_bytes),
                         format_bytes(t.inter_bytes), format_seconds(t.seconds)))
        rows.append(("total", "", "", "", format_bytes(est.payload),
                     format_bytes(sum(t.intra_bytes for t in est.traffic)),
                     format_bytes(est.inter_bytes), format_seconds(est.seconds)))
        lines += ["  " + line for line in _table(
            rows, ("MESH DIM", "ROLE", "WHERE", "COLLECTIVES", "PAYLOAD", "INTRA-NODE",
                   "INTER-NODE", "TIME"), right=(4, 5, 6, 7))]
    else:
        lines.append("  none (a single rank, or no mesh dim of size > 1)")
    assumed = set(est.bandwidth_assumed)
    lines.append(f"  bandwidth per device: intra-node {est.intra_node_gbps:g} Gbit/s"
                 + (" (assumed)" if "intra_node" in assumed else "")
                 + f", inter-node {est.inter_node_gbps:g} Gbit/s"
                 + (" (assumed)" if "inter_node" in assumed else ""))
    lines += ["", "accounting:"] + [f"  - {a}" for a in ACCOUNTING]
    if est.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in est.notes]
    return "\n".join(lines)


__all__ = [
    "ACCOUNTING",
    "Collective",
    "DimTraffic",
    "Estimate",
    "EstimateError",
    "EstimatePart",
    "Layout",
    "Memory",
    "ModelShape",
    "TensorShape",
    "Workload",
    "estimate",
    "estimate_plan",
    "parse_bytes",
    "parse_count",
]
