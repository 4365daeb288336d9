"""walk_modules / walk_tensors give exactly what named_modules / named_parameters /
named_buffers give (names, objects, order, each shared module or tensor once), on real
models and on random module trees with shared children, tied parameters and empty
slots."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_par.blocks import walk_modules, walk_tensors
from composer_par.testing.tasks import llama


def same_walks(model: nn.Module) -> None:
    assert [(n, id(m)) for n, m in walk_modules(model)] == [
        (n, id(m)) for n, m in model.named_modules()]
    assert [(n, id(p)) for n, p in walk_tensors(model)] == [
        (n, id(p)) for n, p in model.named_parameters()]
    assert [(n, id(b)) for n, b in walk_tensors(model, "_buffers")] == [
        (n, id(b)) for n, b in model.named_buffers()]


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


def test_same_tree_keeps_the_walk_of_that_model_only() -> None:
    from composer_par import blocks

    a, b = nn.Linear(1, 1), nn.Sequential(nn.Linear(1, 1))
    with blocks.same_tree():
        walk_modules(a)
        assert walk_modules(b)[0][1] is b
        with blocks.same_tree():  # nested: a fresh cache, the outer one kept after
            assert walk_modules(a)[0][1] is a
        assert walk_modules(a)[0][1] is a
