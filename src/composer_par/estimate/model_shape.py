"""What the estimator needs of a model: its sizes and parameter groups, measured from a
model (ideally built on meta) or derived from numbers (params, layers, hidden, ...)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.errors import EstimateError
from composer_par.estimate.moe_shape import MoEShape, moe_from_config
from composer_par.estimate.units import format_count

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.blocks import BlockSpec


@attrs.frozen
class TensorShape:
    """One parameter: its shape, and whether TP splits it (tensors of >= 2 tensor dims)."""

    name: str
    shape: tuple[int, ...]
    tp: bool = True
    # For a tensor outside the blocks of a measured model: how many blocks come before it
    # in the model's parameter order (0: before the first, e.g. the embedding; the block
    # count: after the last, e.g. the output head). None when not known.
    position: int | None = None
    # Routed experts fused on tensor dim 0 ([num_experts, ...]): expert parallelism
    # splits that dim; TP leaves the tensor whole unless its plan splits every expert
    # (then ``tp``, and a rank holds 1/tp of it).
    experts: bool = False
    # Bytes per element data parallelism's all-gathers move for this tensor when a plugin
    # gathers it narrower than the parameters (float8's weights: one byte); None: the
    # parameters' dtype.
    gather_bytes: int | None = None
    # A MoE block's router ([num_experts, hidden]) in a measured model: no TP plan splits
    # it, and where TP splits the block's experts its gradient is a sum over the tp ranks.
    router: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, tp: int, shard: int) -> int:
        """Elements one rank holds: split by ``tp`` (on tensor dim 0, for TP tensors; each
        expert's weights, for routed experts TP splits), then by ``shard`` with tensor
        dim 0 padded to a multiple of it (as FSDP2 pads); a tensor with fewer rows than
        shards is split on tensor dim 1 instead where that splits evenly, as the fsdp2
        plugin has FSDP2 do then."""
        if not self.shape:
            return 1  # a scalar: every rank holds it (FSDP2 pads it to one element each)
        rows, rest = self.shape[0], math.prod(self.shape[1:])
        if self.tp and tp > 1 and self.experts:
            rest = -(-rest // tp)  # each expert split, not the experts dealt out
        elif self.tp and tp > 1:
            rows = -(-rows // tp)
        if rows < shard and len(self.shape) > 1 and self.shape[1] % shard == 0:
            return rows * rest // shard
        return -(-rows // shard) * rest

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "tp": self.tp}
        if self.position is not None:
            out["position"] = self.position
        if self.experts:
            out["experts"] = True
        if self.gather_bytes is not None:
            out["gather_bytes"] = self.gather_bytes
        if self.router:
            out["router"] = True
        return out


@attrs.frozen
class ParamGroup:
    """The parameters one FSDP group holds: a block's, or the root's own."""

    name: str
    tensors: tuple[TensorShape, ...]
    block: bool = True
    count: int = 1  # identical groups (the blocks of an analytic model)
    # Mesh dims the group's parameters differ along (routed experts held apart, each rank
    # its own): data parallelism shards or replicates it over its dims without these;
    # ``parent``: the group they were set apart from (its block).
    apart: tuple[str, ...] = ()
    parent: str | None = None

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def local_numel(self, tp: int, shard: int) -> int:
        return sum(t.local_numel(tp, shard) for t in self.tensors)

    def padded_numel(self, tp: int, shard: int) -> int:
        """Elements of the group's all-gather output on one TP rank (padding included)."""
        return self.local_numel(tp, shard) * shard

    def gathered_bytes(self, tp: int, shard: int, width: int) -> int:
        """Bytes of the group's all-gather output on one TP rank: ``width`` bytes per
        element, or a tensor's own ``gather_bytes`` where a plugin set it."""
        return sum(t.local_numel(tp, shard) * shard
                   * (width if t.gather_bytes is None else t.gather_bytes)
                   for t in self.tensors)

    @property
    def experts_numel(self) -> int:
        """Elements of its routed experts' tensors."""
        return sum(t.numel for t in self.tensors if t.experts)


_CONFIG_KEYS = {
    "hidden": ("hidden_size", "dim", "d_model", "n_embd", "embed_dim"),
    "heads": ("num_attention_heads", "n_heads", "n_head", "num_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads"),
    "ffn_hidden": ("intermediate_size", "ffn_hidden", "ffn_dim", "n_inner", "dim_feedforward"),
    "vocab": ("vocab_size",),
    "head_dim": ("head_dim",),
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
    # The attention kernel the model says it runs (a Hugging Face config's
    # _attn_implementation: "eager", "sdpa", "flash_attention_2", ...), when it says.
    attention: str | None = None
    # A mixture-of-experts model's routed experts (None: a dense model).
    moe: MoEShape | None = None
    # Attention's width per head when not hidden / heads (a head dim of its own; latent
    # attention: the mean of its query-key and value widths, what its score and value
    # products cost).
    head_dim: int | None = None
    # The module it was measured from (on meta), for a plugin whose view of one rank's
    # part depends on the module's own plans (``composer_par_estimate_shape``); None for
    # a shape from numbers.
    module: Any = attrs.field(default=None, eq=False, repr=False)

    @property
    def attention_head_dim(self) -> int:
        """The width per head that attention's products run over."""
        if self.head_dim:
            return self.head_dim
        return self.hidden // self.heads if self.heads else self.hidden

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding (``vocab x hidden``; 0 without a vocabulary):
        what FLOP counts leave out, as a lookup does no multiplication."""
        return self.vocab * self.hidden if self.vocab else 0

    @property
    def moe_blocks(self) -> int:
        """The blocks with routed experts in this shape (a pipeline stage's own; 0 for a
        dense model): those holding experts tensors, or whose experts were set apart."""
        if self.moe is None:
            return 0
        if not any(g.experts_numel for g in self.groups):
            return min(self.moe.moe_layers, self.layers)  # a shape that names no tensors
        return sum(g.count for g in self.groups if g.block and g.experts_numel)

    @property
    def dispatched(self) -> bool:
        """Whether routed experts are held apart from their blocks on other ranks, so each
        routed (token, slot) pair travels to its expert and back."""
        return any(g.apart and g.experts_numel for g in self.groups)

    @property
    def experts_params(self) -> int:
        """Parameters of the routed experts, every MoE block's."""
        return sum(g.experts_numel * g.count for g in self.groups)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: all but the routed experts it is not sent
        to (``top_k`` of ``num_experts`` per MoE block)."""
        if self.moe is None or not self.experts_params:
            return self.params
        experts = self.experts_params
        return self.params - experts + experts * self.moe.top_k // self.moe.num_experts

    @property
    def attention_kind(self) -> str | None:
        """The estimator's attention kinds: "eager" materializes the attention scores and
        keeps them for backward; every other kernel (SDPA, flash, flex) keeps none."""
        if self.attention is None:
            return None
        return "eager" if self.attention == "eager" else "sdpa"

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
        moe: MoEShape | None = None,
        attention_params: int | None = None,
        tied_embeddings: bool = False,
        head_dim: int | None = None,
    ) -> ModelShape:
        """An analytic transformer: ``layers`` identical blocks plus the rest (embeddings,
        output head). Missing sizes are derived, and listed in ``assumed``:

        * hidden and layers from params with GPT-3's aspect (hidden ~ 128 * layers);
        * heads = hidden / 128; per-block parameters 12 * hidden**2 (4 for attention, 8 for
          a 4x MLP) or, given heads / kv_heads / ffn_hidden, the Llama count;
        * params from the shape when not given.

        ``attention_params``: one block's attention parameters when the count from the
        heads is not theirs (a head dim other than hidden / heads, latent attention);
        ``head_dim``: attention's width per head then (see the field).
        ``moe``: the blocks ``moe.layers`` hold a router, ``moe.num_experts`` routed
        experts (fused as one ``[num_experts, ...]`` tensor) and the shared expert in
        place of the dense MLP of ``ffn_hidden``; ``layers`` and ``hidden`` are then
        required.
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
        if moe is not None:
            if layers is None or hidden is None:
                raise EstimateError("a mixture-of-experts model needs its layers and hidden "
                                    "size (--layers, --hidden)")
            return attrs.evolve(cls._moe_numbers(
                layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                ffn_hidden=ffn_hidden, vocab=vocab, moe=moe, attention_params=attention_params,
                tied_embeddings=tied_embeddings), head_dim=head_dim)
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
        per_head = hidden // heads
        attention = (attention_params if attention_params is not None
                     else hidden * per_head * (2 * heads + 2 * kv))
        mlp = 3 * hidden * ffn_hidden if ffn_hidden else 8 * hidden * hidden
        per_block = attention + mlp + 2 * hidden
        embeddings = (1 if tied_embeddings else 2) * vocab * hidden + hidden if vocab else 0
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
                   source="numbers", assumed=tuple(assumed), head_dim=head_dim)

    @classmethod
    def _moe_numbers(
        cls, *, layers: int, hidden: int, heads: int | None, kv_heads: int | None,
        ffn_hidden: int | None, vocab: int | None, moe: MoEShape,
        attention_params: int | None, tied_embeddings: bool,
    ) -> ModelShape:
        """:meth:`from_numbers` of a mixture-of-experts transformer: dense blocks (the
        blocks not in ``moe.layers``) and MoE blocks as two groups of identical blocks."""
        assumed: list[str] = []
        if heads is None:
            heads = max(1, hidden // 128)
            assumed.append(f"heads {heads} (head dim 128)")
        if hidden % heads:
            raise EstimateError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        if any(i < 0 or i >= layers for i in moe.layers):
            raise EstimateError(f"MoE blocks {list(moe.layers)} outside the {layers} blocks")
        kv = kv_heads if kv_heads is not None else heads
        attention = (attention_params if attention_params is not None
                     else hidden * (hidden // heads) * (2 * heads + 2 * kv))
        norms = TensorShape("block.norms", (2 * hidden,), tp=False)
        groups = []
        dense = layers - moe.moe_layers
        if dense:
            mlp = 3 * hidden * ffn_hidden if ffn_hidden else 8 * hidden * hidden
            groups.append(ParamGroup("blocks", (
                TensorShape("block.matrices", (-(-(attention + mlp) // hidden), hidden)),
                norms), count=dense))
        if moe.moe_layers:
            # attention, the router and the shared expert: what TP may split
            matrices = attention + moe.num_experts * hidden + 3 * hidden * moe.shared_ffn
            per_expert = moe.expert_size(hidden)
            experts = ((moe.num_experts, per_expert // hidden, hidden)
                       if per_expert % hidden == 0 else (moe.num_experts, per_expert))
            groups.append(ParamGroup("moe blocks", (
                TensorShape("block.matrices", (-(-matrices // hidden), hidden)),
                TensorShape("block.experts", experts, tp=False, experts=True),
                norms), count=moe.moe_layers))
        if vocab:
            rows = (1 if tied_embeddings else 2) * vocab + 1
            groups.append(ParamGroup("root", (TensorShape("root", (rows, hidden)),),
                                     block=False))
        params = sum(g.numel * g.count for g in groups)
        return cls(params=params, layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                   ffn_hidden=ffn_hidden, vocab=vocab, groups=tuple(groups),
                   source="numbers", assumed=tuple(assumed), moe=moe)

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
        config = getattr(model, "config", None)
        moe = moe_from_config(config, len(blocks)) if config is not None else None
        experts = _experts_tensors(model, moe.num_experts) if moe is not None else set()
        seen: set[int] = set()
        groups: list[ParamGroup] = []
        for path, block in blocks:
            tensors = []
            moe_block = any(id(p) in experts for p in block.parameters())
            for name, p in block.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    routed = id(p) in experts
                    router = (moe_block and not routed and p.dim() == 2 and moe is not None
                              and p.shape[0] == moe.num_experts)
                    tensors.append(TensorShape(clean_name(f"{path}.{name}"), tuple(p.shape),
                                               tp=p.dim() >= 2 and not routed and not router,
                                               experts=routed, router=router))
            groups.append(ParamGroup(clean_name(path), tuple(tensors), block=True))
        block_of = {id(p): index for index, (_, block) in enumerate(blocks)
                    for p in block.parameters()}
        root = []
        passed = 0  # blocks met so far in parameter order
        for name, p in model.named_parameters():
            if id(p) in block_of:
                passed = max(passed, block_of[id(p)] + 1)
            if id(p) not in seen:
                seen.add(id(p))
                root.append(TensorShape(clean_name(name), tuple(p.shape), tp=p.dim() >= 2,
                                        position=passed))
        if root:
            groups.append(ParamGroup("root", tuple(root), block=False))
        if moe is not None:
            # the blocks that hold routed experts, and one expert's elements, as measured
            layers_with = tuple(i for i, g in enumerate(groups[:len(blocks)])
                                if g.experts_numel)
            per_expert = next((g.experts_numel // moe.num_experts for g in groups
                               if g.experts_numel), None)
            moe = (attrs.evolve(moe, layers=layers_with, expert_numel=per_expert)
                   if layers_with else None)
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
        implementation = getattr(config, "_attn_implementation", None)
        params = sum(g.numel for g in groups)
        matrices = (sum(1 for t in groups[0].tensors if t.tp) if blocks else None)
        return cls(params=params, layers=len(blocks), hidden=int(found["hidden"] or 1),
                   heads=found["heads"], kv_heads=found["kv_heads"] or found["heads"],
                   ffn_hidden=found["ffn_hidden"], vocab=found["vocab"], groups=tuple(groups),
                   dtype=dtypes.pop() if len(dtypes) == 1 else None, matrices_per_block=matrices,
                   source=source or "model",
                   assumed=tuple(assumed),
                   attention=implementation if isinstance(implementation, str) else None,
                   moe=moe, head_dim=found["head_dim"], module=model)

    def with_units(self, entries: Sequence[str | tuple[str, ...]]
                   ) -> tuple[ModelShape, list[str]]:
        """The shape with the root group's tensors under each entry (a module path, or the
        paths of modules sharded together, as FSDP units of their own) moved to a group
        of their own named ``"a + b"``, before the root's; and the paths no root tensor
        lies under (an analytic model names none)."""
        if not entries:
            return self, []
        groups = list(self.groups)
        root = next((i for i, g in enumerate(groups) if g.name == "root" and not g.block),
                    None)
        every = [p for e in entries for p in ((e,) if isinstance(e, str) else e)]
        if root is None:
            return self, every
        missing = []
        rest = list(groups[root].tensors)
        units = []
        for entry in entries:
            paths = (entry,) if isinstance(entry, str) else tuple(entry)
            missing += [p for p in paths
                        if not any(t.name.startswith(p + ".") for t in rest)]
            mine = tuple(t for t in rest if any(t.name.startswith(p + ".") for p in paths))
            if mine:
                rest = [t for t in rest if t not in mine]
                units.append(ParamGroup(" + ".join(paths), mine, block=False))
        tail = [ParamGroup("root", tuple(rest), block=False)] if rest else []
        groups[root:root + 1] = [*units, *tail]
        return attrs.evolve(self, groups=tuple(groups)), missing

    def describe(self) -> str:
        parts = [f"{format_count(self.params)} parameters", f"{self.layers} block(s)",
                 f"hidden {self.hidden}"]
        if self.heads:
            kv = f" ({self.kv_heads} kv)" if self.kv_heads and self.kv_heads != self.heads else ""
            parts.append(f"{self.heads} heads{kv}")
        if self.vocab:
            parts.append(f"vocab {self.vocab}")
        if self.attention:
            parts.append(f"attention {self.attention} (its config)")
        if self.moe is not None:
            parts.append(f"{self.moe.describe()}, {format_count(self.active_params)} active "
                         "per token")
        text = ", ".join(parts)
        if self.assumed:
            text += f" (assumed: {', '.join(self.assumed)})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": self.params, "layers": self.layers, "hidden": self.hidden,
            "heads": self.heads, "kv_heads": self.kv_heads, "ffn_hidden": self.ffn_hidden,
            "vocab": self.vocab, "dtype": self.dtype, "source": self.source,
            "attention": self.attention, "head_dim": self.attention_head_dim,
            "moe": None if self.moe is None else {
                **self.moe.to_dict(), "experts_params": self.experts_params,
                "active_params": self.active_params},
            "assumed": list(self.assumed),
            "groups": [{"name": g.name, "params": g.numel, "count": g.count, "block": g.block}
                       for g in self.groups],
        }


def _experts_tensors(model: nn.Module, num_experts: int) -> set[int]:
    """The ids of the routed experts' tensors: the parameters of each module whose own
    parameters all lead with the expert count (``[num_experts, ...]``), at least one of
    them 3-D (transformers 5.x's and the MoE Llama's fused experts)."""
    out: set[int] = set()
    for module in model.modules():
        own = [p for _, p in module.named_parameters(recurse=False)]
        if (own and any(p.dim() == 3 for p in own)
                and all(p.dim() >= 2 and p.shape[0] == num_experts for p in own)):
            out.update(id(p) for p in own)
    return out
