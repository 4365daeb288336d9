"""The FSDP units a model's own FSDP plan asks for, and a unit of small parameters joined
with a neighbour (composer_par.plugin.fsdp_units): pure logic on small modules and the
test matrix's Hugging Face models, no processes (the collectives and parity these units
give: tests/test_hf_collective_counts.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
from composer_par.blocks import find_blocks
from composer_par.plugin import join_small_units, own_units


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class Decoder(nn.Module):
    """An embedding, a norm before the layers, two layers, a final norm, a head."""

    def __init__(self, plan: dict[str, str]) -> None:
        super().__init__()
        self._fsdp_plan = plan
        self.embed = nn.Embedding(16, 8)
        self.norm_in = nn.LayerNorm(8)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)


PLAN = {"embed": "free_full_weight", "layers.*": "free_full_weight",
        "norm": "keep_full_weight", "head": "keep_full_weight"}


def joined(model: nn.Module) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    blocks = find_blocks(model)
    units, done = join_small_units(model, blocks, own_units(model, blocks)[0])
    return [(u.key, u.style) for u in units], [(j.key, j.into) for j in done]


def test_the_final_norm_joins_the_head_after_it() -> None:
    assert joined(Decoder(PLAN)) == ([("embed", "free_full_weight"),
                                      ("norm + head", "keep_full_weight")], [("norm", "head")])


def test_the_large_neighbours_style_wins() -> None:
    # A small unit's style changes a few bytes of memory; the head's decides whether the
    # unit is gathered again in backward.
    plan = {**PLAN, "head": "free_full_weight"}
    assert joined(Decoder(plan))[0] == [("embed", "free_full_weight"),
                                        ("norm + head", "free_full_weight")]
    # Both small: kept whole if either is. (The layers moved after both norms; the root's
    # embedding and head frozen, so the norms cannot go into the root's unit.)
    plan = {"norm_in": "free_full_weight", "norm": "keep_full_weight"}
    model = Decoder(plan)
    del model.layers
    model.layers = nn.ModuleList([Layer(), Layer()])
    for module in (model.embed, model.head):
        module.weight.requires_grad_(False)
    assert joined(model) == ([("norm_in + norm", "keep_full_weight")], [("norm_in", "norm")])


def test_no_join_across_a_block() -> None:
    # norm_in sits before the layers, the head after them: they are no neighbours. The
    # root keeps parameters of its own (the embedding, outside the plan): norm_in joins it.
    plan = {"norm_in": "keep_full_weight", "head": "keep_full_weight"}
    assert joined(Decoder(plan)) == ([("head", "keep_full_weight")], [("norm_in", "root")])
    # With the embedding a unit, norm_in joins it (no block between them), whatever its
    # style; the final norm joins the head.
    plan = {**plan, "embed": "free_full_weight", "norm": "keep_full_weight"}
    assert joined(Decoder(plan)) == ([("embed + norm_in", "free_full_weight"),
                                      ("norm + head", "keep_full_weight")],
                                     [("norm_in", "embed"), ("norm", "head")])


@pytest.mark.parametrize("change", ["dtype", "requires_grad"])
def test_units_fully_shard_cannot_group_stay_apart(change: str) -> None:
    model = Decoder({**PLAN, "norm_in": "free_full_weight"})  # the root: no parameter
    if change == "dtype":
        model.head.to(torch.bfloat16)
    else:
        model.head.weight.requires_grad_(False)
    units, done = joined(model)
    # The norm cannot go with the head, nor into the root (which holds nothing): alone.
    assert ("norm", "keep_full_weight") in units and ("head", "keep_full_weight") in units
    assert done == [("norm_in", "embed")]


def test_a_model_without_its_own_plan_is_untouched() -> None:
    model = Decoder({})
    assert joined(model) == ([], [])
    from composer_par.testing.tasks import llama

    with torch.device("meta"):
        built = llama.build()
    units, _ = FSDP2().unit_list(built, find_blocks(built))
    assert [u.name for u in units] == ["layers.0", "layers.1", "root"]


def _hf(family: str) -> Any:
    pytest.importorskip("transformers")
    from tests import hf_workers

    return hf_workers.build(family)


def test_hf_llama_norm_and_head_one_unit_shown_by_validate_and_explain() -> None:
    model = _hf("llama")
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit())
    report = plan.validate(model, world_size=2)
    assert report.codes() == ["CP425"], report.format()
    message = report.findings[0].message
    assert ("model.embed_tokens (free_full_weight), model.norm + lm_head (keep_full_weight) "
            "sharded as units of their own beside 2 block(s)") in message
    assert "joined with a neighbour" in message
    assert "model.norm (64 small parameter(s)) with lm_head" in message
    explained = plan.explain(world_size=2).format()
    assert ("fully_shard each block, then the units of the model's own FSDP plan if it has "
            "one (a unit of small parameters with its neighbour), then the root") in explained
    # reshard_units names the joined unit by either module, or by its name.
    for key in ("lm_head", "model.norm", "model.norm + lm_head"):
        fsdp = FSDP2(reshard_units={key: True})
        units, _ = fsdp.unit_list(model, find_blocks(model))
        assert fsdp.reshard_values(units)[0]["model.norm + lm_head"] is True, key


def test_hf_tied_embedding_and_head_take_the_norm_into_the_roots_unit() -> None:
    # Gemma ties its embedding to its head: both stay in the root's unit (one parameter
    # cannot be in two units), and the final norm joins them there, as transformers puts
    # its final norm with the (tied) embedding in one kept unit.
    for family in ("gemma", "llama_tied"):
        model = _hf(family)
        units, _ = FSDP2().unit_list(model, find_blocks(model))
        assert [u.name for u in units] == ["model.layers.0", "model.layers.1", "root"], family
        report = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit()).validate(
            model, world_size=2)
        assert "model.norm (64 small parameter(s)) with the root's unit" in report.format()


def _llama() -> nn.Module:
    from composer_par.testing.tasks import llama

    with torch.device("meta"):
        return llama.build()


def test_units_leaving_the_root_a_norm_alone_say_so_cp441() -> None:
    # The project's Llama has no FSDP plan of its own: its root's unit holds the embedding,
    # the final norm and the head together, and nothing is said. Given units that take the
    # embedding and the head out, the norm is the root's alone: the fix names its
    # neighbour, and the units it suggests leave nothing to say.
    def report(units: Any) -> Any:
        return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(units=units)).use(
            MetaInit()).validate(_llama(), world_size=2)

    assert ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit()).validate(
        _llama(), world_size=2).codes() == []
    found = report(["tok_embeddings", "output"])
    assert found.codes() == ["CP441"], found.format()
    finding = found.findings[0]
    assert finding.severity.value == "info"
    assert "leaves the root's unit norm alone (64 parameter(s) of one tensor dim)" in \
        finding.message
    assert "units=['tok_embeddings', ['norm', 'output']]" in (finding.fix or "")
    assert report(["tok_embeddings", ["norm", "output"]]).codes() == []
    # A root still holding a matrix (the head) or the embedding: nothing to say.
    assert report(["tok_embeddings"]).codes() == []
    assert report(["output"]).codes() == []
