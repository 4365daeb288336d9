"""Per-layer config lists cut to each pipeline stage (no ranks): which lists are per
layer, that the stages of one process each read their own layers' entries while the
model's config is left as it was, and CP611 where a stage's entries cannot be told.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn as nn  # noqa: E402
from composer_par.plugins.pp import PP  # noqa: E402
from composer_par.plugins.pp.layer_config import (  # noqa: E402
    give_stage_configs,
    per_layer_attributes,
    stage_layers,
)
from composer_par.plugins.pp.parts import build_parts  # noqa: E402
from composer_par.plugins.pp.split import compute_split  # noqa: E402

from composer_par import MeshSpec, ParallelPlan  # noqa: E402
from composer_par.blocks import find_blocks  # noqa: E402

FULL, SLIDING = "full_attention", "sliding_attention"


def qwen2_sliding(layers: int = 6) -> Any:
    """Layers 0-3 full, the rest sliding over 4 tokens."""
    cfg = transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128, use_cache=False,
        use_sliding_window=True, sliding_window=4, max_window_layers=4,
        **{"attn_implementation": "eager"})
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def test_per_layer_lists_are_those_as_long_as_the_layers() -> None:
    cfg = qwen2_sliding().config
    assert per_layer_attributes(cfg) == ["layer_types"]
    cfg.architectures = ["Qwen2ForCausalLM"]  # one entry, not one per layer
    assert per_layer_attributes(copy.copy(cfg)) == ["layer_types"]
    assert per_layer_attributes(object()) == []


def test_two_stages_of_one_process_each_read_their_own_layers_types() -> None:
    model = qwen2_sliding()
    tokens = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = model(tokens).logits
    original = model.config
    types = list(original.layer_types)
    blocks = find_blocks(model)
    split = compute_split(model, blocks, "auto", 2)
    needs = stage_layers(model, split.blocks)
    assert [[n.indices for n in stage] for stage in needs] == [[(0, 1, 2)], [(3, 4, 5)]]
    _, parts = build_parts(model, split.stages, split.shared, [0, 1], blocks)
    for stage, part, _, _ in parts:
        give_stage_configs(part, needs[stage], type(model).__name__)
    (_, first, _, _), (_, last, _, _) = parts
    assert first.model.config.layer_types == [FULL] * 3
    assert last.model.config.layer_types == [FULL, SLIDING, SLIDING]
    assert last.model.config.num_hidden_layers == 3
    # The model's (and the layers') config is the original object, unchanged.
    assert model.config is original and model.model.config is original
    assert original.layer_types == types and original.num_hidden_layers == 6
    assert all(layer.self_attn.config is original for layer in model.model.layers)
    with torch.no_grad():
        hidden = first(input_ids=tokens).logits  # the hidden state: no head on stage 0
        got = last(inputs_embeds=hidden).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class NamedLayers(nn.Module):
    """A base model keeping its layers in a ModuleDict keyed by name, read by the type
    list of its config: which entry is whose cannot be told from the keys."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.config = inner.config
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleDict({f"block_{i}": layer for i, layer in
                                     enumerate(inner.layers)})
        self.norm = inner.norm


def test_layers_under_keys_that_are_no_layer_numbers_refused_naming_the_attribute() -> None:
    model = qwen2_sliding(4)
    model.model = NamedLayers(model.model)
    report = ParallelPlan(MeshSpec(pp=2)).use(PP()).validate(model)
    found = [f for f in report.findings if f.code == "CP611"]
    assert found, report.format()
    text = found[0].message
    assert "Qwen2ForCausalLM.model" in text and "config.layer_types" in text, text
    assert "layers.block_" in text, text
