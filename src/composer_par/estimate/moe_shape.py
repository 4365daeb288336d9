"""What the estimator needs of a mixture-of-experts model: how many routed experts each
MoE block holds, how many a token picks, how wide each is, the shared expert beside
them, and which blocks are MoE blocks; read from a Hugging Face config (Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, OLMoE, gpt-oss) or the project's MoELlamaConfig.
No torch."""

from __future__ import annotations

from typing import Any

import attrs

from composer_par.estimate.errors import EstimateError

# Config attribute names, first found wins (transformers 5.x and MoELlamaConfig).
_EXPERTS = ("n_routed_experts", "num_local_experts", "num_experts")
_TOP_K = ("num_experts_per_tok", "experts_per_token", "top_k")
_EXPERT_FFN = ("moe_intermediate_size", "expert_hidden")
_DENSE_FFN = ("intermediate_size", "ffn_hidden")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimateError(f"{name} must be a positive int; got {value!r}")


@attrs.frozen
class MoEShape:
    """The routed experts of a model.

    ``num_experts``: routed experts per MoE block; ``top_k``: experts each token is sent
    to; ``expert_ffn``: one expert's intermediate size; ``layers``: the indices of the
    blocks with routed experts (the others have a dense MLP); ``shared_ffn``: the
    intermediate size of the shared expert(s) every token also passes through (0: none);
    ``expert_numel``: elements of one expert of one block (default ``3 * hidden *
    expert_ffn``, a gated MLP; measured when the model is)."""

    num_experts: int
    top_k: int
    expert_ffn: int
    layers: tuple[int, ...]
    shared_ffn: int = 0
    expert_numel: int | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_ffn"):
            _positive(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise EstimateError(f"top_k ({self.top_k}) exceeds num_experts "
                                f"({self.num_experts})")

    @property
    def moe_layers(self) -> int:
        return len(self.layers)

    def expert_size(self, hidden: int) -> int:
        """Elements of one expert of one block."""
        return self.expert_numel if self.expert_numel is not None else 3 * hidden * self.expert_ffn

    def describe(self) -> str:
        shared = f" + shared expert {self.shared_ffn}" if self.shared_ffn else ""
        return (f"top-{self.top_k} of {self.num_experts} experts (ffn {self.expert_ffn}"
                f"{shared}) in {self.moe_layers} block(s)")

    def to_dict(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "top_k": self.top_k,
                "expert_ffn": self.expert_ffn, "shared_ffn": self.shared_ffn,
                "moe_layers": self.moe_layers, "layers": list(self.layers),
                "expert_numel": self.expert_numel}


def _first_int(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def moe_layer_indices(config: Any, layers: int) -> tuple[int, ...]:
    """The blocks with routed experts: DeepSeek's ``first_k_dense_replace`` (the first k
    are dense) and ``moe_layer_freq``; Qwen-MoE's ``decoder_sparse_step`` and
    ``mlp_only_layers``; every block otherwise."""
    first = getattr(config, "first_k_dense_replace", None)
    freq = getattr(config, "moe_layer_freq", None)
    step = getattr(config, "decoder_sparse_step", None)
    only = set(getattr(config, "mlp_only_layers", None) or ())
    out = []
    for i in range(layers):
        if isinstance(first, int) and i < first:
            continue
        if isinstance(freq, int) and freq > 1 and (i - (first or 0)) % freq:
            continue
        if isinstance(step, int) and step > 1 and (i + 1) % step:
            continue
        if i in only:
            continue
        out.append(i)
    return tuple(out)


def moe_from_config(config: Any, layers: int) -> MoEShape | None:
    """The routed experts a config describes, or None for a dense model."""
    experts = _first_int(config, _EXPERTS)
    top_k = _first_int(config, _TOP_K)
    if not experts or experts < 2 or not top_k:
        return None
    expert_ffn = _first_int(config, _EXPERT_FFN) or _first_int(config, _DENSE_FFN)
    if not expert_ffn:
        return None
    shared = _first_int(config, ("shared_expert_intermediate_size",)) or 0
    if not shared:
        count = _first_int(config, ("n_shared_experts",)) or 0
        shared = count * (_first_int(config, _EXPERT_FFN) or 0)
    if not shared and getattr(config, "shared_expert", False) is True:
        # MoELlamaConfig: the dense MLP's width is the shared expert's
        shared = _first_int(config, ("ffn_hidden",)) or 0
    return MoEShape(num_experts=experts, top_k=top_k, expert_ffn=expert_ffn,
                    layers=moe_layer_indices(config, layers), shared_ffn=shared)


__all__ = ["MoEShape", "moe_from_config", "moe_layer_indices"]
