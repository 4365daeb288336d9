"""walk_modules / walk_tensors give exactly what named_modules / named_parameters /
named_buffers give (names, objects, order, each shared module or tensor once), and
all_modules / registered the same modules and registrations without names, on real
models and on random module trees with shared children, tied parameters and empty
slots."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_par.blocks import all_modules, registered, walk_modules, walk_tensors
from composer_par.testing.tasks import llama


def same_walks(model: nn.Module) -> None:
    assert [(n, id(m)) for n, m in walk_modules(model)] == [
        (n, id(m)) for n, m in model.named_modules()]
    assert [(n, id(p)) for n, p in walk_tensors(model)] == [
        (n, id(p)) for n, p in model.named_parameters()]
    assert [(n, id(b)) for n, b in walk_tensors(model, "_buffers")] == [
        (n, id(b)) for n, b in model.named_buffers()]
    # all_modules: the same modules, each once, every one after a parent of it.
    named = [m for _, m in model.named_modules()]
    unnamed = all_modules(model)
    assert len(unnamed) == len(named)
    assert {id(m) for m in unnamed} == {id(m) for m in named}
    position = {id(m): i for i, m in enumerate(unnamed)}
    for i, module in enumerate(unnamed[1:], start=1):
        assert any(position[id(parent)] < i for parent in named
                   if any(child is module for child in parent._modules.values()))
    # registered: every registration of those modules, a tied tensor once per module.
    for kind in ("_parameters", "_buffers"):
        assert Counter(map(id, registered(model, kind))) == Counter(
            id(t) for m in named for t in getattr(m, kind).values() if t is not None)


def test_the_projects_llama() -> None:
    with torch.device("meta"):
        same_walks(llama.build())


def test_hugging_face_models_with_tied_weights_and_wrappers() -> None:
    import transformers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    same_walks(model)
    model.transformer.h[0] = checkpoint_wrapper(model.transformer.h[0])
    same_walks(model)


class _Node(nn.Module):
    pass


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_trees_with_sharing(data: Any) -> None:
    """Children drawn from earlier modules too (a module registered twice, even under
    itself via another path), empty child slots, parameters shared between modules."""
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
        if data.draw(st.booleans()):
            module.register_buffer("b", torch.zeros(1))
    same_walks(modules[0])


def test_same_tree_walks_each_model_once_and_hands_out_copies() -> None:
    from composer_par import blocks

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))
    expected = list(model.named_modules())
    with blocks.same_tree():
        first = walk_modules(model)
        first.clear()  # a caller's list is its own
        model.append(nn.Tanh())  # (which same_tree forbids): the first walk answers
        second = walk_modules(model)
        other = nn.Linear(1, 1)
        assert [m for _, m in walk_modules(other)] == [other]
    assert second == expected
    # Outside, a walk sees the tree as it is now.
    assert len(walk_modules(model)) == len(expected) + 1


def test_same_tree_answers_all_modules_from_one_walk_too() -> None:
    from composer_par import blocks

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))
    with blocks.same_tree():
        first = all_modules(model)
        first.clear()
        model.append(nn.Tanh())
        assert len(all_modules(model)) == 5  # the first walk's answer, a copy of it
        assert len(walk_modules(model)) == 6  # another kind of walk: walked now
    assert len(all_modules(model)) == 6


def test_same_tree_keeps_the_walk_of_that_model_only() -> None:
    from composer_par import blocks

    a, b = nn.Linear(1, 1), nn.Sequential(nn.Linear(1, 1))
    with blocks.same_tree():
        walk_modules(a)
        assert walk_modules(b)[0][1] is b
        with blocks.same_tree():  # nested: a fresh cache, the outer one kept after
            assert walk_modules(a)[0][1] is a
        assert walk_modules(a)[0][1] is a
