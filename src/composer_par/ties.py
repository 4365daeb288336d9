"""Tied parameters: found and re-tied in one place.

A tie is one tensor registered more than once: a token embedding's weight that is also
the output head's (GPT-2, BERT, Llama with ``tie_word_embeddings``). Two things break
ties. ``to_empty`` (``nn.Module._apply``) gives every registration a tensor of its own,
which silently unties them: MetaInit and the loaders tie them again
(:func:`to_empty_keeping_ties`, or :func:`tied_names` before and :func:`retie` after).
And a tensor cannot be sharded in two FSDP units: the blocks and units found must not
put the twins apart (:func:`tied_outside`). Checkpoints write and read a tied tensor
once, under its first name (:func:`tied_names`).

Everything here is read from one walk, :func:`registrations`, over torch's
``named_modules(remove_duplicate=False)``: parents first, a module registered at two
paths seen at each. Plugins that check ties of their own (a pipeline split, TP's styles)
read them from :func:`tied_registrations`, not from a walk of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from composer_par.blocks import Block, clean_name

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

# (name of the tensor, the module holding it, the attribute it is held as)
Registration = tuple[str, "nn.Module", str]


def registrations(model: nn.Module, *, buffers: bool = False) -> dict[int, list[Registration]]:
    """``id(parameter)`` -> every registration of that parameter (``buffers``: of each
    buffer instead), in ``named_modules`` order. A module registered at two paths gives
    one registration per path, as ``state_dict`` names it at each."""
    found: dict[int, list[Registration]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if buffers:
            own = module.named_buffers(recurse=False, remove_duplicate=False)
        else:
            own = module.named_parameters(recurse=False, remove_duplicate=False)
        for attr, tensor in own:
            name = f"{path}.{attr}" if path else attr
            found.setdefault(id(tensor), []).append((name, module, attr))
    return found


def _distinct(group: list[Registration]) -> list[Registration]:
    """One registration per (module, attribute): a module registered at two paths holds
    the tensor once (its first path named)."""
    seen: dict[tuple[int, str], Registration] = {}
    for name, module, attr in group:
        seen.setdefault((id(module), attr), (name, module, attr))
    return list(seen.values())


def _ties(model: nn.Module, *, every_path: bool = False) -> list[list[Registration]]:
    """Each Parameter held by two or more (module, attribute) registrations (with
    ``every_path``: two or more paths, a module registered at two paths counting twice)."""
    found = registrations(model).values()
    groups = list(found) if every_path else [_distinct(group) for group in found]
    return [group for group in groups if len(group) > 1]


def tied_registrations(model: nn.Module, *, every_path: bool = False
                       ) -> list[list[Registration]]:
    """Each parameter registered under several names, as a group of ``(clean name, the
    module holding it, the attribute it is held as)``, groups and names in
    ``named_modules`` order (the first is where FSDP2 keeps the parameter too). A module
    registered at two paths holds its parameters once, at its first path; with
    ``every_path``, at each (what a pipeline split that puts the paths on two stages
    needs: each stage would hold its own copy)."""
    return [[(clean_name(name), module, attr) for name, module, attr in group]
            for group in _ties(model, every_path=every_path)]


def tie_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Parameters registered under several names (tied weights, e.g. an embedding shared
    with the output head), as ``[(module, attribute), ...]`` groups of two or more, in
    ``named_modules`` order (the first is where FSDP2 keeps the parameter too)."""
    return [[(module, attr) for _, module, attr in group] for group in _ties(model)]


def to_empty_keeping_ties(model: nn.Module, device: torch.device | str
                          ) -> list[list[tuple[nn.Module, str]]]:
    """``model.to_empty(device=device)``, then each tied group made one parameter again
    (``to_empty`` gives every registration its own new tensor). Returns the tied groups
    (:func:`tie_groups`)."""
    groups = tie_groups(model)
    model.to_empty(device=device)
    for (first_module, first_attr), *rest in groups:
        shared = first_module._parameters[first_attr]
        for module, attr in rest:
            module._parameters[attr] = shared
    return groups


def tied_outside(model: nn.Module, blocks: Sequence[Block]) -> list[tuple[str, str, str]]:
    """``(block path, parameter, its twin)`` for each parameter a block shares with a
    module outside it: the same Parameter registered twice (a tied embedding), or a tie
    a Hugging Face model declares (``all_tied_weights_keys``, the ties its config makes).
    Block paths and names are clean names (:func:`~composer_par.blocks.clean_name`)."""
    if not blocks:
        return []
    shared = [[clean_name(name) for name, _, _ in group] for group in _ties(model)]
    declared = getattr(model, "all_tied_weights_keys", None)
    pairs = [(str(a), str(b)) for a, b in declared.items()] if isinstance(declared, dict) else []
    out = []
    for path, _ in blocks:
        inside = path + "."
        for group in shared:
            mine = [n for n in group if n.startswith(inside)]
            others = [n for n in group if not n.startswith(inside)]
            if mine and others:
                out.append((path, mine[0], others[0]))
        for a, b in pairs:
            if a.startswith(inside) != b.startswith(inside):
                mine_name, other = (a, b) if a.startswith(inside) else (b, a)
                if not any(row[1] == mine_name for row in out):
                    out.append((path, mine_name, other))
    return out


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """For tied tensors (parameters and buffers): the first clean name of each -> its
    other clean names, every name ``state_dict`` gives it (a module registered at two
    paths counts: its tensors are named at each)."""
    out: dict[str, list[str]] = {}
    for buffers in (False, True):
        for group in registrations(model, buffers=buffers).values():
            first, *others = [clean_name(name) for name, _, _ in group]
            for name in others:
                if name != first:
                    out.setdefault(first, []).append(name)
    return out


def retie(model: nn.Module, tied: dict[str, list[str]]) -> int:
    """Tie again what ``to_empty`` untied, by name (``tied``: :func:`tied_names`, taken
    before): each other name's module gets the first name's Parameter. Plain parameters
    only: sharded ones (DTensors) are left to the weights load, which copies into each
    name. Returns the number of names re-tied."""
    from torch.distributed.tensor import DTensor

    where = {clean_name(name): (module, attr)
             for group in registrations(model).values() for name, module, attr in group}
    count = 0
    for first, names in tied.items():
        if first not in where:
            continue
        first_module, first_attr = where[first]
        param = first_module._parameters[first_attr]
        if isinstance(param, DTensor):
            continue
        for name in names:
            if name in where:
                module, attr = where[name]
                if module._parameters.get(attr) is not param:
                    module._parameters[attr] = param
                    count += 1
    return count
