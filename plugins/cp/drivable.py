"""Which attention of a model CP can run across ranks, and which it must refuse.

CP drives attention at one seam per model family:

* the project's Llama (``composer_par.models.llama``): each attention's ``core`` module
  (``CausalAttention``), swapped for :class:`~.attention.ContextAttention`;
* Hugging Face decoders whose attention goes through transformers' attention interface
  (``config._attn_implementation`` ``"sdpa"``): the model is pointed at CP's registered
  attention function (:mod:`.hf`).

Anything else that attends (eager-only attention, cross-attention, an encoder-decoder)
would see only its rank's part of the sequence and is refused before apply (CP823).
Static: reads module types and configs, calls nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch.nn as nn

LLAMA_CORE = ("composer_par.models.llama", "CausalAttention")
HF_IMPLEMENTATIONS = ("sdpa",)  # what CP's attention function replaces exactly
_ATTENTION_HINTS = ("Attention", "SelfAttn", "MultiheadAttention")


@attrs.frozen
class Drivable:
    """What CP found: the modules it swaps or points at its attention function, the head
    counts their queries and keys have where the math sees them, the modules it cannot
    drive, each with why, and whether some layers attend within a sliding window."""

    kind: str  # "llama", "hf" or "none"
    modules: tuple[str, ...] = ()
    heads: int | None = None
    kv_heads: int | None = None
    refused: tuple[tuple[str, str], ...] = ()
    sliding_window: bool = False


def _is_llama_core(module: Any) -> bool:
    cls = type(module)
    return (cls.__module__, cls.__name__) == LLAMA_CORE


def _hf_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    return config if hasattr(config, "_attn_implementation") else None


def find_attention(model: nn.Module) -> Drivable:
    """The attention CP would drive in ``model``, and what it refuses."""
    cores = [(p, m) for p, m in model.named_modules() if _is_llama_core(m)]
    if cores:
        heads = getattr(getattr(model, "config", None), "n_heads", None)
        # Keys and values reach the core repeated to the query head count.
        return Drivable("llama", tuple(p for p, _ in cores), heads, heads)
    config = _hf_config(model)
    if config is not None:
        return _hf_attention(model, config)
    attending = [p for p, m in model.named_modules()
                 if p and any(h in type(m).__name__ for h in _ATTENTION_HINTS)]
    return Drivable("none", refused=tuple(
        (p, "its attention has no seam CP can drive (neither the project's Llama "
            "CausalAttention nor a Hugging Face attention interface)") for p in attending))


def _hf_attention(model: Any, config: Any) -> Drivable:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = getattr(config, "_attn_implementation", None)
    attention = [(p, m) for p, m in model.named_modules()
                 if p and type(m).__name__.endswith("Attention") and hasattr(m, "config")]
    refused: list[tuple[str, str]] = []
    if getattr(config, "is_encoder_decoder", False):
        refused.append(("", f"{type(model).__name__} is an encoder-decoder: its "
                            "cross-attention attends to another sequence"))
    for path, module in attention:
        if getattr(module, "is_causal", True) is False:
            refused.append((path, "not causal (an encoder's or a cross-attention)"))
    if implementation not in HF_IMPLEMENTATIONS:
        refused += [(p, f"runs attn_implementation={implementation!r}; CP replaces "
                        "'sdpa' exactly") for p, _ in attention[:1]]
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return Drivable("hf", tuple(p for p, _ in attention), heads, kv_heads, tuple(refused),
                    _has_sliding_window(text))


def _has_sliding_window(config: Any) -> bool:
    """Whether some layers mask keys beyond a window: per layer where the config lists
    layer types (Gemma 3, Qwen 3), else wherever a window is set (Mistral)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return getattr(config, "sliding_window", None) is not None


__all__ = ["HF_IMPLEMENTATIONS", "LLAMA_CORE", "Drivable", "find_attention"]
