"""Blocks named by a glob: ``*`` stands for one module path component."""

from __future__ import annotations

import torch

from composer_par.blocks import BlockSpec, find_blocks, path_matches
from composer_par.testing.tasks import llama


def test_a_glob_names_the_children_it_spells_not_everything_below_them() -> None:
    with torch.device("meta"):
        model = llama.build()
    found = [path for path, _ in find_blocks(model, BlockSpec(path="layers.*"))]
    assert found == [f"layers.{i}" for i in range(len(model.layers))]
    assert [p for p, _ in find_blocks(model, BlockSpec(path="layers.*.attention"))] == [
        f"layers.{i}.attention" for i in range(len(model.layers))]


def test_path_matches_component_by_component() -> None:
    assert path_matches("model.layers.*", "model.layers.11")
    assert not path_matches("model.layers.*", "model.layers.11.mlp")
    assert path_matches("*.layers.?", "model.layers.3")
    assert not path_matches("layers.*", "layers")
