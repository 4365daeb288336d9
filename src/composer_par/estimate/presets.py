"""Published model shapes that ``estimate`` and ``suggest`` take by name (``--preset``),
so a well-known model needs neither its code nor a download. Each is the shape of its
Hugging Face config (sizes, experts, which blocks are MoE blocks); the parameter counts
it gives match the published totals (tests/test_estimate_ep.py). No torch."""

from __future__ import annotations

from collections.abc import Callable

from composer_par.estimate.errors import EstimateError
from composer_par.estimate.model_shape import ModelShape
from composer_par.estimate.moe_shape import MoEShape


def _llama3(layers: int, hidden: int, heads: int, ffn: int) -> Callable[[], ModelShape]:
    # meta-llama/Llama-3.1-{8B,70B,405B}: 8 K/V heads, vocabulary 128256, untied
    def build() -> ModelShape:
        return ModelShape.from_numbers(layers=layers, hidden=hidden, heads=heads, kv_heads=8,
                                       ffn_hidden=ffn, vocab=128256)

    return build


def _mixtral_8x7b() -> ModelShape:
    # mistralai/Mixtral-8x7B-v0.1: 46.7 B parameters, 12.9 B active
    return ModelShape.from_numbers(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
        moe=MoEShape(num_experts=8, top_k=2, expert_ffn=14336, layers=tuple(range(32))))


def _qwen3_30b_a3b() -> ModelShape:
    # Qwen/Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active; head dim 128 (not hidden /
    # heads) and RMSNorm on q and k
    hidden, heads, kv, head_dim = 2048, 32, 4, 128
    return ModelShape.from_numbers(
        layers=48, hidden=hidden, heads=heads, kv_heads=kv, vocab=151936,
        attention_params=hidden * head_dim * (2 * heads + 2 * kv) + 2 * head_dim,
        head_dim=head_dim,
        moe=MoEShape(num_experts=128, top_k=8, expert_ffn=768, layers=tuple(range(48))))


def _deepseek_v3() -> ModelShape:
    # deepseek-ai/DeepSeek-V3 (without its multi-token-prediction module): 671 B
    # parameters, 37 B active; multi-head latent attention (q_lora_rank 1536,
    # kv_lora_rank 512, 128 heads of qk 128 + rope 64, v 128); the first 3 blocks dense
    hidden, heads, q_rank, kv_rank, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    attention = (hidden * q_rank + q_rank + q_rank * heads * (nope + rope)
                 + hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
                 + heads * v * hidden)
    return ModelShape.from_numbers(
        layers=61, hidden=hidden, heads=heads, ffn_hidden=18432, vocab=129280,
        attention_params=attention, head_dim=(nope + rope + v) // 2,
        moe=MoEShape(num_experts=256, top_k=8, expert_ffn=2048, layers=tuple(range(3, 61)),
                     shared_ffn=2048))


PRESETS: dict[str, Callable[[], ModelShape]] = {
    "llama3-8b": _llama3(32, 4096, 32, 14336),
    "llama3-70b": _llama3(80, 8192, 64, 28672),
    "llama3-405b": _llama3(126, 16384, 128, 53248),
    "mixtral-8x7b": _mixtral_8x7b,
    "qwen3-30b-a3b": _qwen3_30b_a3b,
    "deepseek-v3": _deepseek_v3,
}


def preset(name: str) -> ModelShape:
    """The shape of the preset ``name`` (see :data:`PRESETS`)."""
    try:
        build = PRESETS[name.lower()]
    except KeyError:
        raise EstimateError(f"unknown preset {name!r}; one of {', '.join(PRESETS)}") from None
    return build()


__all__ = ["PRESETS", "preset"]
