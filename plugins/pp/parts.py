"""This rank's pipeline stages as modules: the model, pruned to what a stage owns.

A stage's part is the model's own root module with every module another stage owns taken
out, so the stage runs the model's own ``forward`` unchanged:

* out of a container (ModuleList, ModuleDict, Sequential), the entry is deleted and the
  others keep their keys (``layers.2`` stays ``layers.2``, so names match checkpoints);
  a ModuleList still indexes by position among the entries left, and iterating runs
  only them (none, on a stage that holds only the embedding or only the head);
* any other module is replaced by a plain callable (not a module: no walk over modules
  sees it) that hands back its first argument. A stage that lacks the embedding thus
  passes the hidden state it received through ``self.tok_embeddings(...)``, and one that
  lacks the norm and output head sends on its last block's output (what the forward
  does outside modules around them runs on the stage holding them: :mod:`.boundary`).

With one stage per rank the part is the model object itself, pruned in place. With
several, the model is pruned to the union of the rank's stages (it holds the parameters:
``model.parameters()`` are the rank's, under the model's own names), and each stage's
part is a shallow copy of the containers on the way to its modules, sharing the modules
themselves with the model.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from composer_par.plugin import clean_name

if TYPE_CHECKING:
    from composer_par.plugin import Block


class OnAnotherStage:
    """Stands in for a module another pipeline stage owns: returns its first argument."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .boundary import note_handed

        # A module after the blocks: what it is given is the hidden state the stage sends.
        note_handed(self.path, args, kwargs)
        if args:
            return args[0]
        if kwargs:
            return next(iter(kwargs.values()))
        raise TypeError(f"{self.path} runs on another pipeline stage; here it passes its "
                        "first argument through, and it was called without one")

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<{self.path}: on another pipeline stage>"


class StageModuleList(nn.ModuleList):
    """A ModuleList holding some of its original entries under their original keys.

    Iteration and ``len`` see the entries held; an int index counts among them (a model
    reading ``self.layers[0]`` gets this stage's first layer); a slice is a plain list.
    """

    def _keys(self) -> list[str]:
        return list(self._modules)

    def __getitem__(self, idx: Any) -> Any:  # type: ignore[override]
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(values[idx])
        return values[idx]

    def __setitem__(self, idx: int, module: nn.Module) -> None:  # type: ignore[override]
        self.register_module(self._keys()[idx], module)

    def __delitem__(self, idx: Any) -> None:  # type: ignore[override]
        keys = self._keys()
        for key in keys[idx] if isinstance(idx, slice) else [keys[idx]]:
            del self._modules[key]


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object of the same class sharing the children and tensors, with its
    own registries (children, parameters, buffers, hooks): pruning it leaves ``module``."""
    new = module.__class__.__new__(module.__class__)
    new.__dict__ = {k: copy.copy(v) if isinstance(v, (dict, set)) else v
                    for k, v in module.__dict__.items()}
    return new


def _drop(parent: nn.Module, name: str, path: str) -> None:
    del parent._modules[name]
    if isinstance(parent, _CONTAINERS):
        # A plain ModuleList only: a subclass may index in its own way.
        if type(parent) is nn.ModuleList:
            parent.__class__ = StageModuleList
        return
    object.__setattr__(parent, name, OnAnotherStage(path))


def prune(module: nn.Module, keep: Collection[str], *, copy_containers: bool,
          prefix: str = "") -> nn.Module:
    """``module`` with only the subtrees at paths in ``keep`` (and their ancestors).

    ``copy_containers``: ancestors are shallow copies (the input is left as it was); else
    pruned in place. Kept subtrees are never copied.
    """
    root = _shallow(module) if copy_containers else module
    for name, child in list(root._modules.items()):
        if child is None:
            continue
        path = clean_name(f"{prefix}.{name}" if prefix else name)
        if path in keep or not path:
            continue
        # A container held by a module (not an entry of another container, which is
        # deleted) with nothing kept is emptied, not stood in for: the forward loops over
        # it (a stage holding only the embedding runs no layer).
        emptied = isinstance(child, _CONTAINERS) and not isinstance(root, _CONTAINERS)
        if emptied or any(k.startswith(path + ".") for k in keep):
            pruned = prune(child, keep, copy_containers=copy_containers, prefix=path)
            if pruned is not child:
                root._modules[name] = pruned
        else:
            _drop(root, name, path)
    return root


def build_parts(model: nn.Module, stages: Sequence[Sequence[str]], shared: Sequence[str],
                local: Sequence[int], blocks: Sequence[Block]
                ) -> tuple[nn.Module, list[tuple[int, nn.Module, list[Block], tuple[str, ...]]]]:
    """Prune ``model`` to the ``local`` stages; returns it and, per local stage,
    ``(stage, part, its blocks, its module paths)``."""
    union = {p for s in local for p in stages[s]} | set(shared)
    prune(model, union, copy_containers=False)
    parts = []
    for stage in local:
        keep = set(stages[stage]) | set(shared)
        part = model if len(local) == 1 else prune(model, keep, copy_containers=True)
        owned = tuple(stages[stage])
        mine = [(p, m) for p, m in blocks
                if any(clean_name(p) == o or clean_name(p).startswith(o + ".") for o in owned)]
        parts.append((stage, part, mine, owned))
    return model, parts


__all__ = ["OnAnotherStage", "StageModuleList", "build_parts", "prune"]
