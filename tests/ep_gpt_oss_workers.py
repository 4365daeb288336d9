"""Tasks of tests/test_ep_gpt_oss.py: gpt-oss from a tiny config (built on meta,
nothing downloaded) with its router's auxiliary loss in the loss.

gpt-oss's experts differ from the other families' in what EP's dispatch must carry
through: a bias per expert on both projections (``gate_up_proj_bias``,
``down_proj_bias``: 2-D ``[num_experts, ...]`` parameters beside the 3-D weights),
weights stored transposed (``[num_experts, hidden, 2 * intermediate]``), gate and up
interleaved, and a clamped SwiGLU. Its router has a bias and softmaxes the top-k logits.
Its attention has sinks and runs eager (it offers no sdpa).
"""

from __future__ import annotations

from typing import Any

import attrs

# Over tests/hf_workers.py's COMMON: 4 experts, top-2, an intermediate size that is not
# the hidden size (the transposed layout shows), a sliding window shorter than the
# sequence on the sliding layers, a router loss that counts, and a swiglu_limit low
# enough that the clamp cuts some activations of these small weights.
GPT_OSS: dict[str, Any] = {
    "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
    "sliding_window": 4, "router_aux_loss_coef": 0.1, "initializer_range": 0.2,
    "swiglu_limit": 0.5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def config(experts: str = "grouped_mm", **overrides: Any) -> Any:
    """The tiny config; ``experts``: transformers' experts kernel (``grouped_mm``, its
    default, ``batched_mm``, or ``eager``: the class's own per-expert loop)."""
    import transformers

    from tests import hf_workers

    cfg = transformers.GptOssConfig(**{**hf_workers.COMMON, **GPT_OSS, **overrides})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = experts
    return cfg


@attrs.frozen
class GptOssTask:
    """gpt-oss's causal-LM loss plus ``router_aux_loss_coef`` times its router loss."""

    experts: str = "grouped_mm"
    global_batch: int = 4
    seq_len: int = 8
    data_seed: int = 5

    def build(self) -> Any:
        import transformers

        return transformers.GptOssForCausalLM(config(self.experts))

    def batch(self, step: int) -> Any:
        import torch

        gen = torch.Generator().manual_seed(self.data_seed + step)
        return torch.randint(3, 128, (self.global_batch, self.seq_len), generator=gen)

    def loss(self, model: Any, batch: Any) -> Any:
        out = model(input_ids=batch, labels=batch, output_router_logits=True)
        assert out.aux_loss is not None
        return out.loss


gpt_oss = GptOssTask()
gpt_oss_eager = GptOssTask(experts="eager")
