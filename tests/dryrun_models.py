"""Model factories for the dry-run, estimate and suggest tests (``tests.dryrun_models:NAME``).

The dry run builds them on the meta device, so even the 1B model costs no memory.
"""

from __future__ import annotations

from typing import Any

from composer_par.models.llama import Llama, LlamaConfig

# TinyLlama-1.1B's shape: 22 blocks, hidden 2048, 32 heads, 4 KV heads.
CONFIG_1B = LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                        ffn_hidden=5632, max_seq_len=2048)
SMALL = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=128, max_seq_len=16)


def llama_1b() -> Llama:
    return Llama(CONFIG_1B)


def small_llama() -> Llama:
    return Llama(SMALL)


def small_moe() -> Any:
    """The MoE Llama with 8 experts per block (Mixtral's count), 2 blocks of hidden 64."""
    from composer_par.models.moe_llama import MoELlama, MoELlamaConfig

    return MoELlama(MoELlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4,
                                   n_kv_heads=2, ffn_hidden=128, max_seq_len=16,
                                   num_experts=8, top_k=2, expert_hidden=64))


def not_a_module() -> Any:
    return {"weights": []}


def raises() -> Llama:
    raise RuntimeError("the factory broke")


NOT_CALLABLE = 42
