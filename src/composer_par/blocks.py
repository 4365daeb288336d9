"""Finding the blocks of any ``nn.Module``: found once, shared by every plugin.

A block is the repeated unit (a transformer layer) at which FSDP groups parameters,
activation checkpointing recomputes and compile traces. In order of precedence:

1. an explicit spec: a module path (``"layers"``: the children of that container;
   ``"model.layers.*"``: modules matching a glob) or block class names;
2. a Hugging Face model's ``_no_split_modules`` class names;
3. the same-class children of a ModuleList / ModuleDict / Sequential holding the most
   parameters (torchtitan's models keep their layers in a ModuleDict keyed "0", "1", ...).

A detected block (2 and 3) that shares a parameter with a module outside it (BERT's
word embedding, tied to the output head, inside ``BertEmbeddings``) is not a block: a
block is an FSDP unit, and one parameter cannot be sharded in two units. It stays in its
parent's unit, with its twin. An explicit spec is taken as given; FSDP2 reports such a
split (:func:`composer_par.ties.tied_outside`).
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch.nn as nn

Block = tuple[str, "nn.Module"]

# Path components that wrappers (activation checkpointing, compile) insert; users and
# checkpoints see the model's own names, so they are dropped everywhere.
WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def clean_name(name: str) -> str:
    """The model's own name of a parameter or module, without wrapper components."""
    if not any(component in name for component in WRAPPER_COMPONENTS):
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def modules_by_clean_name(model: nn.Module) -> dict[str, nn.Module]:
    """Every module of ``model`` by its clean name, in ``named_modules`` order (parents
    first), the root as ``""``. A wrapper and the module it wraps share a clean name; the
    outer one (the wrapper, which is what stands in the model) is kept."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        out.setdefault(clean_name(name), module)
    return out


def _tuple_of_str(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen
class BlockSpec:
    """Where the blocks are: a module path / glob, or class names (not both)."""

    path: str | None = None
    classes: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)

    @classmethod
    def parse(cls, value: Any) -> BlockSpec | None:
        """From a plugin option: ``"layers"``, ``"layers.*"``, ``["LlamaDecoderLayer"]``."""
        if value is None or isinstance(value, BlockSpec):
            return value
        if isinstance(value, str):
            # A bare identifier starting with an upper-case letter names a class.
            if value[:1].isupper() and value.isidentifier():
                return cls(classes=(value,))
            return cls(path=value)
        if isinstance(value, Sequence):
            return cls(classes=tuple(str(v) for v in value))
        raise TypeError(f"blocks must be a module path or a list of class names; got {value!r}")

    def describe(self) -> str:
        return f"path {self.path!r}" if self.path else f"classes {list(self.classes)}"


def find_blocks(model: nn.Module, spec: BlockSpec | None = None) -> list[Block]:
    """The model's blocks as ``(path, module)`` pairs in module order (maybe empty)."""
    if spec is not None and spec.path:
        return _by_path(model, spec.path)
    classes = spec.classes if spec is not None else ()
    if not classes:
        classes = tuple(getattr(model, "_no_split_modules", None) or ())
    found = _by_class(model, set(classes)) if classes else _largest_repeated_children(model)
    if spec is None or not spec.classes:
        from composer_par.ties import tied_outside  # (ties imports this module)

        split = {path for path, _, _ in tied_outside(model, found)}
        found = [(path, block) for path, block in found if path not in split]
    return found


def path_matches(pattern: str, name: str) -> bool:
    """Whether module path ``name`` matches glob ``pattern`` component by component:
    ``*`` stands for one path component, never for several (``fnmatch`` alone would let
    ``"layers.*"`` match ``layers.0.attention.wq`` too, making every module under the
    blocks a block)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True))


def _by_path(model: nn.Module, path: str) -> list[Block]:
    if any(ch in path for ch in "*?["):
        return [(n, m) for n, m in modules_by_clean_name(model).items()
                if n and path_matches(path, n)]
    target: nn.Module | None
    try:  # the common case, without walking every module
        target = model.get_submodule(path)
    except AttributeError:  # a path through a wrapper: match clean names
        target = modules_by_clean_name(model).get(path)
    if target is None:
        return []
    return [(f"{path}.{n}", m) for n, m in target.named_children()]


def _by_class(model: nn.Module, classes: set[str]) -> list[Block]:
    found: list[Block] = []
    for name, module in modules_by_clean_name(model).items():
        if name and type(module).__name__ in classes and not any(
            name.startswith(prefix + ".") for prefix, _ in found
        ):
            found.append((name, module))
    return found


def _largest_repeated_children(model: nn.Module) -> list[Block]:
    """Same-class children of a container (ModuleList / ModuleDict / Sequential): the
    group holding the most parameters wins. Plain attributes are not considered: a module's
    q/k/v projections are same-class siblings but not repeated units."""
    import torch.nn as nn

    best: list[Block] = []
    best_key = (0, 0)
    for parent_name, parent in modules_by_clean_name(model).items():
        if not isinstance(parent, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        children = list(parent.named_children())
        for cls, count in Counter(type(c) for _, c in children).items():
            if count < 2:
                continue
            group = [
                (f"{parent_name}.{n}" if parent_name else n, c)
                for n, c in children
                if type(c) is cls
            ]
            params = sum(p.numel() for _, c in group for p in c.parameters())
            if params and (params, count) > best_key:
                best, best_key = group, (params, count)
    return best


def names_near(model: nn.Module, pattern: str, n: int = 5) -> list[str]:
    """Module paths close to ``pattern``, for error messages."""
    import difflib

    names = [name for name in modules_by_clean_name(model) if name]
    return difflib.get_close_matches(pattern, names, n=n, cutoff=0.3)
