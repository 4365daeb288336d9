"""Tied parameters (composer_par.ties): found on real Hugging Face models (GPT-2's token
embedding is its output head, BERT's word embedding its MLM decoder's weight and its
prediction bias the decoder's bias), kept through ``to_empty``, named for checkpoints
and tied again by name; on random module trees with shared children and parameters,
against a plain reading of every module's ``_parameters``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from composer_par.blocks import find_blocks
from composer_par.ties import (
    retie,
    tie_groups,
    tied_names,
    tied_outside,
    tied_registrations,
    to_empty_keeping_ties,
)
from tests import hf_workers

pytest.importorskip("transformers")


def test_gpt2_the_embedding_and_the_head_are_one_group() -> None:
    model = hf_workers.build("gpt2")
    embedding, head = model.transformer.wte, model.lm_head
    assert head.weight is embedding.weight
    # named_modules order: the embedding first, where FSDP2 keeps the parameter too
    assert tie_groups(model) == [[(embedding, "weight"), (head, "weight")]]
    assert tied_names(model) == {"transformer.wte.weight": ["lm_head.weight"]}
    assert tied_registrations(model) == [[("transformer.wte.weight", embedding, "weight"),
                                          ("lm_head.weight", head, "weight")]]


def test_bert_ties_and_the_blocks_that_would_split_them() -> None:
    model = hf_workers.build("bert")
    head = model.cls.predictions
    assert [[(type(m).__name__, a) for m, a in g] for g in tie_groups(model)] == [
        [("Embedding", "weight"), ("Linear", "weight")],
        [("BertLMPredictionHead", "bias"), ("Linear", "bias")]]  # a parent's and a child's
    assert tie_groups(model)[1] == [(head, "bias"), (head.decoder, "bias")]
    assert tied_names(model) == {
        "bert.embeddings.word_embeddings.weight": ["cls.predictions.decoder.weight"],
        "cls.predictions.bias": ["cls.predictions.decoder.bias"]}
    embeddings = ("bert.embeddings", model.bert.embeddings)
    assert tied_outside(model, [embeddings]) == [
        ("bert.embeddings", "bert.embeddings.word_embeddings.weight",
         "cls.predictions.decoder.weight")]
    assert tied_outside(model, [("cls", model.cls)]) == [
        ("cls", "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")]
    assert tied_outside(model, find_blocks(model)) == []  # the encoder layers split none


def test_declared_ties_count_though_the_parameters_are_two() -> None:
    # A Hugging Face model declares its ties (all_tied_weights_keys); a block holding one
    # side of a declared tie splits it even before the model ties the two.
    model = hf_workers.build("gpt2")
    model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))
    assert tie_groups(model) == []
    assert tied_outside(model, [("transformer", model.transformer)]) == [
        ("transformer", "transformer.wte.weight", "lm_head.weight")]


def test_to_empty_keeping_ties_keeps_the_tie_that_to_empty_breaks() -> None:
    model = hf_workers.build("gpt2")
    model.to_empty(device="cpu")
    assert model.lm_head.weight is not model.transformer.wte.weight  # why this exists

    model = hf_workers.build("gpt2")
    groups = to_empty_keeping_ties(model, torch.device("cpu"))
    assert [[m for m, _ in g] for g in groups] == [[model.transformer.wte, model.lm_head]]
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not any(p.is_meta for p in model.parameters())
    registrations = list(model.named_parameters(remove_duplicate=False))
    assert len(list(model.parameters())) == len(registrations) - 1


def test_tied_names_and_retie_round_trip() -> None:
    model = hf_workers.build("bert")
    names = tied_names(model)
    model.to_empty(device="cpu")
    assert model.cls.predictions.decoder.weight is not model.bert.embeddings.word_embeddings.weight
    assert retie(model, names) == 2
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    assert tied_names(model) == names
    assert retie(model, names) == 0  # tied already


def test_names_are_the_models_own_through_a_wrapper() -> None:
    model = hf_workers.build("gpt2")
    model.transformer = checkpoint_wrapper(model.transformer)
    assert tied_names(model) == {"transformer.wte.weight": ["lm_head.weight"]}
    assert tied_outside(model, [("transformer", model.transformer)]) == [
        ("transformer", "transformer.wte.weight", "lm_head.weight")]
    assert [[name for name, _, _ in group] for group in tied_registrations(model)] == [
        ["transformer.wte.weight", "lm_head.weight"]]
    names = tied_names(model)
    model.to_empty(device="cpu")
    assert retie(model, names) == 1
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_module_at_two_paths_is_named_at_each_and_tied_to_nothing() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert tie_groups(model) == []  # one registration: to_empty keeps it one tensor
    assert tied_registrations(model) == []
    # ... but two paths, which a pipeline split may put on two stages
    assert tied_registrations(model, every_path=True) == [
        [("0.weight", shared, "weight"), ("2.weight", shared, "weight")],
        [("0.bias", shared, "bias"), ("2.bias", shared, "bias")]]
    assert tied_outside(model, [("0", shared)]) == []
    # the state dict names its tensors at both paths: a checkpoint holds them once
    assert tied_names(model) == {"0.weight": ["2.weight"], "0.bias": ["2.bias"]}


def test_tied_buffers_are_named_too() -> None:
    model = nn.Sequential(nn.Module(), nn.Module())
    table = torch.zeros(3)
    model[0].register_buffer("table", table)
    model[1].register_buffer("table", table)
    assert tied_names(model) == {"0.table": ["1.table"]}
    assert tie_groups(model) == []  # parameters only


class _Node(nn.Module):
    pass


def _registrations(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> (module, attribute) of each distinct module holding it."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                found.setdefault(id(param), []).append((module, attr))
    return found


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_trees_with_sharing(data: Any) -> None:
    """Children drawn from later modules too (a module registered twice, under two
    paths), empty child slots, parameters shared between modules and within one."""
    count = data.draw(st.integers(1, 12))
    modules = [_Node() for _ in range(count)]
    params = [nn.Parameter(torch.zeros(1)) for _ in range(4)]
    for i, module in enumerate(modules):
        for j in range(data.draw(st.integers(0, 3))):
            if i + 1 < count and data.draw(st.booleans()):
                child: nn.Module | None = modules[data.draw(st.integers(i + 1, count - 1))]
            else:
                child = None
            module.register_module(f"c{j}", child)
        for j in range(data.draw(st.integers(0, 2))):
            module.register_parameter(f"p{j}", params[data.draw(st.integers(0, 3))]
                                      if data.draw(st.booleans()) else None)
    root = modules[0]
    expected = [g for g in _registrations(root).values() if len(g) > 1]
    groups = tie_groups(root)
    assert sorted(sorted((id(m), a) for m, a in g) for g in groups) == sorted(
        sorted((id(m), a) for m, a in g) for g in expected)
    assert [[(m, a) for _, m, a in g] for g in tied_registrations(root)] == groups
    every: dict[int, list[str]] = {}  # id -> every name, a module at two paths at each
    for path, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                every.setdefault(id(param), []).append(f"{path}.{attr}" if path else attr)
    assert [[name for name, _, _ in g] for g in tied_registrations(root, every_path=True)] \
        == [names for names in every.values() if len(names) > 1]
    names = tied_names(root)
    to_empty_keeping_ties(root, torch.device("cpu"))
    for group in groups:  # every registration holds one parameter again
        assert len({id(m._parameters[a]) for m, a in group}) == 1
    assert retie(root, names) == 0
    assert tied_names(root) == names
