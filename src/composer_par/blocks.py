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

import contextlib
import fnmatch
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from functools import partial
from itertools import chain
from operator import attrgetter, is_not
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
    # One substring test first (every wrapper component holds "_mod"): this runs for
    # every module and parameter name, and most names hold no wrapper component.
    if "_mod" not in name or not any(component in name for component in WRAPPER_COMPONENTS):
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


# Set while nothing may change any model's module tree (a plan's validation): walks are
# then answered from one walk per model and kind of walk. Keyed by (id, kind), holding
# the model (so the id stays its own while the entry lives).
_SAME_TREE: ContextVar[dict[tuple[int, str], tuple[Any, list[Any]]] | None] = ContextVar(
    "composer_par_same_tree", default=None)


@contextlib.contextmanager
def same_tree() -> Iterator[None]:
    """Within: :func:`walk_modules` walks each model once and answers again from that
    walk (a copy each time). For code that changes no module tree: a plan's validation,
    where the core and several plugins each walk the model."""
    token = _SAME_TREE.set({})
    try:
        yield
    finally:
        _SAME_TREE.reset(token)


def walk_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(model.named_modules())``: the same names, modules and order (parents first;
    a module registered twice comes once, at its first path), walked with a stack. torch's
    nested generators pay for every level of depth at each module, and a plan walks the
    model several times per validation and apply."""
    return _once_per_tree(model, "named", _walk_named)


def _once_per_tree(model: nn.Module, kind: str, walk: Callable[[Any], list[Any]]
                   ) -> list[Any]:
    """``walk(model)``; within :func:`same_tree`, walked once per model and kind, and a
    copy of that walk handed out each time (a caller's list is its own)."""
    cache = _SAME_TREE.get()
    if cache is None:
        return walk(model)
    hit = cache.get((id(model), kind))
    if hit is None or hit[0] is not model:
        hit = cache[(id(model), kind)] = (model, walk(model))
    return list(hit[1])


def _walk_named(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    pop, push, keep, mark = stack.pop, stack.append, out.append, seen.add
    while stack:
        name, module = pop()
        key = id(module)
        if key in seen:
            continue
        mark(key)
        keep((name, module))
        children = module._modules
        if children:
            prefix = f"{name}." if name else ""
            for child_name, child in reversed(children.items()):
                if child is not None:
                    push((prefix + child_name, child))
    return out


# Getters that run in C: the walks below hand whole lists to map / chain / filter, so
# that no Python code runs per module or per tensor in the usual case. A plan asks these
# questions of every module on every validation and apply (a walk of the 629 modules of
# a 48-block Llama: 94 us this way, 157 us for walk_modules' Python loop, measured).
_CHILDREN = attrgetter("_modules")
_PARAMETERS = attrgetter("_parameters")
_BUFFERS = attrgetter("_buffers")
_NOT_NONE = partial(is_not, None)


def all_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` once, parents before children (level by level), without
    names: for the checks that ask about modules, not about their paths. Each level's
    children are gathered in C; a level with an empty slot or a module seen before (a
    module registered twice) is sorted out in Python. Within :func:`same_tree`, answered
    from one walk per model (a copy each time)."""
    return _once_per_tree(model, "all", _walk_all)


def _walk_all(model: nn.Module) -> list[nn.Module]:
    out = [model]
    seen = {id(model)}
    level = out
    while level:
        children = list(chain.from_iterable(map(dict.values, map(_CHILDREN, level))))
        ids = set(map(id, children))
        if len(ids) < len(children) or id(None) in ids or not seen.isdisjoint(ids):
            fresh = []
            for child in children:
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    fresh.append(child)
            children = fresh
        else:
            seen |= ids
        out += children
        level = children
    return out


def registered(model: nn.Module, kind: str = "_parameters",
               modules: Iterable[nn.Module] | None = None) -> list[Any]:
    """Every tensor registered on the modules of ``model`` (``kind``: ``"_parameters"``
    or ``"_buffers"``), once per registration: a tied parameter comes once per module
    that registers it. ``modules``: the modules to look at, when the caller has them
    (else :func:`all_modules`). Gathered in C (see :data:`_CHILDREN`); within
    :func:`same_tree`, answered from one gathering per model and kind."""
    getter = _PARAMETERS if kind == "_parameters" else _BUFFERS

    def gather(walked: Iterable[nn.Module]) -> list[Any]:
        return list(filter(_NOT_NONE, chain.from_iterable(map(dict.values, map(getter,
                                                                               walked)))))

    if modules is not None:
        return gather(modules)
    return _once_per_tree(model, kind, lambda m: gather(all_modules(m)))


def walk_tensors(model: nn.Module, kind: str = "_parameters",
                 modules: list[tuple[str, nn.Module]] | None = None) -> list[tuple[str, Any]]:
    """``list(model.named_parameters())`` (``kind="_buffers"``: ``named_buffers()``), the
    same names, tensors and order (a tensor registered twice comes once), from
    :func:`walk_modules` (or ``modules``, its result, when the caller has it)."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, module in walk_modules(model) if modules is None else modules:
        for attr, tensor in getattr(module, kind).items():
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            out.append((f"{name}.{attr}" if name else attr, tensor))
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


def _named_modules(model: nn.Module) -> list[Block]:
    """Non-root modules by clean name; a wrapper and its inner module share a name, and
    the outer one (the wrapper, which is what stands in the model) is kept."""
    seen: dict[str, nn.Module] = {}
    for name, module in walk_modules(model):
        clean = clean_name(name)
        if clean and clean not in seen:
            seen[clean] = module
    return list(seen.items())


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
        return [(n, m) for n, m in _named_modules(model) if path_matches(path, n)]
    target: nn.Module | None
    try:  # the common case, without walking every module
        target = model.get_submodule(path)
    except AttributeError:  # a path through a wrapper: match clean names
        target = dict(_named_modules(model)).get(path)
    if target is None:
        return []
    return [(f"{path}.{n}", m) for n, m in target.named_children()]


def _by_class(model: nn.Module, classes: set[str]) -> list[Block]:
    found: list[Block] = []
    for name, module in _named_modules(model):
        if type(module).__name__ in classes and not any(
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
    for parent_name, parent in [("", model), *_named_modules(model)]:
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

    names = [name for name, _ in _named_modules(model)]
    return difflib.get_close_matches(pattern, names, n=n, cutoff=0.3)
