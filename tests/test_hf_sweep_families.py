"""Two families of the wider Hugging Face sweep that need more than the matrix's code
paths (tiny configs, built on meta, 3 steps of SGD on real gloo ranks, every rank's
parameter parts against the single-process reference, as in test_hf_models):

- StableLm under FSDP2 x TP(auto): it has no tp plan of its own, the Llama-name fallback
  splits q, k and v, and its attention reshapes by its own head counts, which TP sets to
  the local ones; with per-head q/k norms it is refused (CP431).
"""

from __future__ import annotations

from typing import Any

import pytest

from composer_par import TP, MeshSpec, MetaInit, ParallelPlan
from composer_par.testing.distributed import run_ranks
from tests import hf_workers

pytest.importorskip("transformers")


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_stablelm_trains_at_parity_under_fsdp2_x_tp_auto() -> None:
    cases = [("stablelm", "fsdp2_tp")]
    results = run_ranks(hf_workers.train_cases, 4, args=(cases,), timeout=540)
    assert not hf_workers.problems(results, cases), "\n".join(
        hf_workers.problems(results, cases))
    assert all(rows[0]["applied"] for rows in results)


def test_stablelm_attention_head_counts_become_local_after_the_split() -> None:
    from composer_par.plugins.tp.resolution import resolve

    model = hf_workers.build("stablelm")
    resolution = resolve(TP(), model, 2)
    assert resolution.source == "Hugging Face Llama names"
    assert not [f for f in resolution.findings if f.code == "CP431"]
    set_attrs = {(type(m).__name__, a, v) for m, a, v in resolution.local_heads}
    assert set_attrs == {("StableLmAttention", "num_heads", 2),
                         ("StableLmAttention", "num_key_value_heads", 1)}
    assert len(resolution.local_heads) == 2 * 2  # two layers


def test_per_head_norms_under_the_name_fallback_are_refused_cp431() -> None:
    model = hf_workers.build("stablelm", qk_layernorm=True)
    report = ParallelPlan(MeshSpec(tp=2)).use(TP()).use(MetaInit()).validate(model)
    assert report.codes() == ["CP431"], report.format()
    finding = report.findings[0]
    assert "model.layers.*.self_attn (StableLmAttention)" in finding.message
    assert "q_layernorm" in finding.message


def test_a_forward_reading_the_config_head_count_is_refused_cp431() -> None:
    import torch.nn as nn

    class Attention(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.config = config
            self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)
            self.v_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):  # type: ignore[no-untyped-def]
            q = self.q_proj(x).view(*x.shape[:2], self.config.num_attention_heads, -1)
            return self.o_proj(q.flatten(2) + self.k_proj(x) + self.v_proj(x))

    class Config:
        num_attention_heads = 2

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict({"self_attn": Attention(Config())})])

    report = ParallelPlan(MeshSpec(tp=2)).use(TP()).use(MetaInit()).validate(Model())
    assert "CP431" in report.codes(), report.format()
    assert "config.num_attention_heads" in report.format()
