"""The reduction check: one forward in which every tensor says, per mesh dim, how its
value and its gradient stand across the ranks of that dim, so that a gradient that needs
a sum over a dim and gets none (or gets one it must not) is named before launch.

It types tensors as SPMD type checkers do (torchtitan's ``spmd_types``: invariant,
replicated, varying, partial), from what DTensor already says, with no annotation of the
model:

* ``I`` invariant: the same value on every rank of the dim, and a gradient nobody sums
  over it (a parameter replicated there whose gradient each rank keeps as computed:
  ``to_local()`` of a ``Replicate`` DTensor, or a plain parameter no data-parallel
  plugin reduces over the dim);
* ``R`` replicated: the same value, and a gradient that *is* summed over the dim (a
  parameter a data-parallel plugin reduces there; ``to_local(grad_placements=Partial)``);
* ``V`` varying: values that differ across the dim's ranks (each rank's samples; a
  ``Shard`` DTensor's local part: this rank's heads);
* ``P`` partial: each rank holds a part of a sum (``to_local()`` of a ``Partial``).

Inputs vary over the dims whose ranks read different samples. A parameter is typed where
its module's forward runs (after the plugins' own hooks have made it what the forward
uses): over the dims its DTensor is sharded or replicated over at rest and no longer is
at use (a data-parallel plugin gathered it and will reduce its gradient there) it is
``R``; over dims it is no DTensor of, ``I``. Local ops propagate the types; DTensor
boundaries set them (``to_local``) and check them (``from_local``).

Two situations mean a wrong gradient, silently:

* an ``I`` tensor that carries a gradient meets a ``V``, ``P`` or ``R`` one in an op:
  its gradient then differs across the dim's ranks (each rank's part: DeepSeek's
  rotary key from a projection kept whole, combined with this rank's heads), and nothing
  sums it; or it meets a value whose gradient is summed, and one of the two is summed
  where it must not be;
* a tensor handed to ``DTensor.from_local`` as ``Replicate`` that varies over the dim
  (a lie: its gradient comes back summed as if it were whole), or whose gradient is
  summed already (``R``: summed twice).

Each finding names the parameters whose values reached the offending tensor through
local ops, the mesh dim, the module whose forward ran the op, and the op.

``cat`` keeps the types of its pieces, and ``split``/``narrow``/slices of the result get
them back: a projection whose output is a latent part and a rotary part with different
gradient handling (DeepSeek's ``kv_a_proj_with_mqa`` under TP) types as it computes.

Torch is imported inside functions only. ``DTensor.to_local`` and ``DTensor.from_local``
are wrapped (public methods, restored after) while the check runs, and
``composer_par.plugin.gradient_sum.sum_gradient`` (the same boundary without DTensor)
is watched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import torch_private

if TYPE_CHECKING:
    import torch.nn as nn

INV, REP, VAR, PART, MIXED = "I", "R", "V", "P", "M"
# The order in which an op's result takes its operands' types.
_RANK = {VAR: 3, PART: 2, REP: 1, INV: 0, MIXED: 1}


@attrs.frozen
class ReductionProblem:
    """One wrong gradient reduction found: ``kind`` is ``"missing"`` (a gradient that
    differs across the dim's ranks and is summed nowhere), ``"double"`` (a gradient summed
    over the dim where it is whole already) or ``"declared"`` (a value that differs across
    the dim's ranks handed on as replicated)."""

    dim: str
    kind: str
    parameters: tuple[str, ...]
    module: str
    op: str

    def message(self) -> str:
        who = (", ".join(self.parameters[:3])
               + (f" and {len(self.parameters) - 3} more" if len(self.parameters) > 3
                  else "")) if self.parameters else "a tensor no parameter reached"
        where = f" in {self.module}" if self.module else ""
        if self.kind == "missing":
            return (f"{who}: gradient needs a sum over {self.dim} and gets none: "
                    f"{self.op}{where} combines it with values that differ across the "
                    f"{self.dim} ranks (or whose gradient is summed there), so each rank "
                    "keeps its own part of the gradient")
        if self.kind == "double":
            return (f"{who}: gradient is summed over {self.dim} twice: it is summed where "
                    f"it was made, and {self.op}{where} declares it replicated, which "
                    "sums it again")
        return (f"{who}: values that differ across the {self.dim} ranks are declared "
                f"replicated over {self.dim} by {self.op}{where}: their gradient comes "
                "back as if each rank held the whole")


class _Type:
    """A tensor's type: per checked mesh dim one of I/R/V/P (or ``M``: an invariant and a
    replicated value met, and which of their gradients is wrong depends on what uses the
    result: ``mixed`` keeps, per such dim, the parameters on each side), the parameters
    whose values reached it through local ops (the nearest ones: an op on a parameter
    names that parameter), and, for a ``cat`` of pieces of differing types, the pieces
    (``(tensor dim, [(length, type)])``)."""

    __slots__ = ("dims", "is_param", "mixed", "params", "pieces")

    def __init__(self, dims: dict[str, str], params: frozenset[str] = frozenset(),
                 pieces: tuple[int, list[tuple[int, _Type]]] | None = None,
                 mixed: dict[str, tuple[frozenset[str], frozenset[str]]] | None = None,
                 is_param: bool = False) -> None:
        self.dims, self.params, self.pieces = dims, params, pieces
        self.mixed = mixed or {}
        self.is_param = is_param


class _Checker:
    def __init__(self, dims: Sequence[str], groups: Mapping[str, frozenset[int]],
                 hooked_dims: Sequence[str] = ()) -> None:
        from torch.utils.weak import WeakTensorKeyDictionary

        self.dims = list(dims)
        self.hooked = frozenset(hooked_dims)
        self.groups = dict(groups)  # plan dim -> the ranks of this rank's group over it
        self.types: Any = WeakTensorKeyDictionary()
        self.problems: list[ReductionProblem] = []
        self.modules: list[str] = []
        self.names: dict[int, str] = {}  # id(module) -> path
        self.at_rest: dict[tuple[int, str], frozenset[str]] = {}

    # -- dims of a DTensor's mesh -------------------------------------------------------

    def covered(self, mesh: Any, index: int) -> frozenset[str]:
        """The plan dims one mesh dim of a DTensor spans (a flattened dim spans several)."""
        import torch.distributed as dist

        ranks = frozenset(dist.get_process_group_ranks(mesh.get_group(index)))
        return frozenset(d for d in self.dims if self.groups[d] <= ranks)

    def mesh_dims(self, dtensor: Any) -> frozenset[str]:
        mesh = dtensor.device_mesh
        return frozenset().union(*(self.covered(mesh, i) for i in range(mesh.ndim)))

    # -- types --------------------------------------------------------------------------

    def type_of(self, tensor: Any) -> _Type | None:
        return self.types.get(tensor)

    def set_type(self, tensor: Any, kind: _Type) -> None:
        with contextlib.suppress(TypeError):  # not weak-referenceable
            self.types[tensor] = kind

    def where(self) -> str:
        return self.modules[-1] if self.modules else ""

    def report(self, dim: str, kind: str, params: frozenset[str], op: str) -> None:
        problem = ReductionProblem(dim, kind, tuple(sorted(params)), self.where(), op)
        if not any((p.dim, p.kind, p.parameters) == (dim, kind, problem.parameters)
                   for p in self.problems):
            self.problems.append(problem)

    def combine(self, operands: list[tuple[Any, _Type]], op: str, check: bool = True,
                skip: frozenset[str] = frozenset()) -> _Type:
        """The type of an op's result from its typed operands; with ``check``, what the
        op's mixing says about their gradients is reported. ``skip``: dims a DTensor's
        own placements govern."""
        direct = [k.params for _, k in operands if k.is_param]
        params = frozenset().union(*(direct or [k.params for _, k in operands]))
        if len(params) > 16:
            params = frozenset(sorted(params)[:16])
        dims: dict[str, str] = {}
        mixed: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        for dim in self.dims:
            if dim in skip:
                continue
            seen = [(t, k.dims[dim], k) for t, k in operands if dim in k.dims]
            if not seen:
                continue
            # Only values that carry a gradient can carry a wrong one.
            graded = [(kind, k) for t, kind, k in seen if _grad(t)]
            kinds = {kind for _, kind, _ in seen}
            invariant = frozenset().union(*(k.params for kind, k in graded if kind == INV))
            summed = frozenset().union(*(k.params for kind, k in graded if kind == REP))
            for kind, k in graded:
                if kind == MIXED:
                    summed |= k.mixed[dim][0]
                    invariant |= k.mixed[dim][1]
            has_invariant = any(kind in (INV, MIXED) for kind, _ in graded)
            varying = kinds & {VAR, PART}
            if varying:
                if check and has_invariant:
                    self.report(dim, "missing", invariant, op)
                dims[dim] = max(varying, key=_RANK.__getitem__)
            elif MIXED in kinds or (has_invariant and any(kind == REP for kind, _ in graded)):
                dims[dim] = MIXED
                mixed[dim] = (summed, invariant)
            elif REP in kinds:
                dims[dim] = REP
            else:
                dims[dim] = INV
        return _Type(dims, params, mixed=mixed)

    # -- pieces of a cat ------------------------------------------------------------------

    def piece_of(self, kind: _Type, dim: int, start: int, stop: int) -> _Type:
        if kind.pieces is None or kind.pieces[0] != dim:
            return kind
        out: list[_Type] = []
        at = 0
        for length, piece in kind.pieces[1]:
            if at < stop and start < at + length:
                out.append(piece)
            at += length
        if len(out) == 1:
            return out[0]
        return self.combine([(_GRAD, p) for p in out], "cat", check=False) if out else kind


class _Graded:
    """Stands for a tensor that carries a gradient, where only types are at hand."""

    requires_grad = True


_GRAD = _Graded()


def _grad(tensor: Any) -> bool:
    return bool(getattr(tensor, "requires_grad", False))


def _tensors(value: Any) -> list[Any]:
    import torch

    return [v for v in torch_private.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _dim_index(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


_CATS = {"cat", "concat", "concatenate"}
_SPLITS = {"split", "split_with_sizes", "chunk", "tensor_split", "unbind"}


def _mode_class() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    class ReductionTypes(TorchFunctionMode):
        def __init__(self, checker: _Checker) -> None:
            super().__init__()
            self.checker = checker

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            # Typing must never break the forward it watches.
            with contextlib.suppress(Exception):
                self.propagate(func, args, kwargs, out)
            return out

        def propagate(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
            from torch.distributed.tensor import DTensor

            checker = self.checker
            raw = getattr(func, "__name__", str(func))
            name = raw.strip("_")
            inplace = (raw.endswith("_") and not raw.endswith("__")) or raw == "__setitem__"
            results = [args[0]] if raw == "__setitem__" else _tensors(out)
            if not results:
                return
            operands = [(t, checker.type_of(t)) for t in _tensors((args, kwargs))]
            typed = [(t, k) for t, k in operands if k is not None]
            if not typed:
                return
            if name in _CATS:
                self.cat(args, kwargs, results[0])
                return
            if name in (*_SPLITS, "narrow", "getitem", "select") and self.split(
                    name, args, kwargs, results):
                return
            skip: frozenset[str] = frozenset()
            dtensors = [t for t, _ in operands if isinstance(t, DTensor)]
            if dtensors:
                # DTensor's own placements govern the dims of its mesh.
                skip = checker.mesh_dims(dtensors[0])
            kind = checker.combine(typed, name, skip=skip)
            for result in results:
                if not kind.dims:
                    continue
                checker.set_type(result, kind)
            if inplace and args and isinstance(args[0], torch.Tensor) and kind.dims:
                checker.set_type(args[0], kind)

        def cat(self, args: Any, kwargs: Any, result: Any) -> None:
            checker = self.checker
            pieces = args[0] if args else kwargs.get("tensors", ())
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            pieces = list(pieces)
            kinds = [checker.type_of(t) for t in pieces]
            if not pieces or all(k is None for k in kinds):
                return
            dim = _dim_index(int(dim), pieces[0].dim())
            filled = [k if k is not None else _Type({}) for k in kinds]
            kind = checker.combine([(t, k) for t, k in zip(pieces, filled, strict=True)],
                                   "cat", check=False)
            kind.pieces = (dim, [(int(t.shape[dim]), k)
                                 for t, k in zip(pieces, filled, strict=True)])
            checker.set_type(result, kind)

        def split(self, name: str, args: Any, kwargs: Any, results: list[Any]) -> bool:
            """Pieces of a cat's result keep the types of what was concatenated."""
            checker = self.checker
            source = args[0] if args else None
            if not isinstance(source, torch.Tensor):
                return False
            kind = checker.type_of(source)
            if kind is None:
                return False
            if kind.pieces is None:
                for result in results:
                    checker.set_type(result, kind)
                return True
            axis, _ = kind.pieces
            if name == "getitem":
                index = args[1]
                index = index if isinstance(index, tuple) else (index,)
                spans = _slice_span(index, source.dim(), axis, source.shape[axis])
                if spans is None:
                    checker.set_type(results[0], kind)
                else:
                    checker.set_type(results[0], checker.piece_of(kind, axis, *spans))
                return True
            if name == "narrow":
                dim = _dim_index(int(args[1]), source.dim())
                start, length = int(args[2]), int(args[3])
                checker.set_type(results[0], checker.piece_of(kind, dim, start,
                                                              start + length)
                                 if dim == axis else kind)
                return True
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            dim = _dim_index(int(dim), source.dim())
            if dim != axis:
                for result in results:
                    checker.set_type(result, kind)
                return True
            at = 0
            for result in results:
                length = int(result.shape[axis])
                checker.set_type(result, checker.piece_of(kind, axis, at, at + length))
                at += length
            return True

    return ReductionTypes


def _slice_span(index: tuple[Any, ...], ndim: int, axis: int, size: int
                ) -> tuple[int, int] | None:
    """The ``[start, stop)`` an index takes along ``axis`` (basic slicing only)."""
    if any(i is None for i in index):
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = ndim - (len(index) - 1)
        index = index[:at] + (slice(None),) * fill + index[at + 1:]
    index = index + (slice(None),) * (ndim - len(index))
    part = index[axis]
    if not isinstance(part, slice) or part.step not in (None, 1):
        return None
    start, stop, _ = part.indices(size)
    return start, stop


@contextlib.contextmanager
def _dtensor_boundaries(checker: _Checker) -> Iterator[None]:
    """``to_local`` and ``from_local`` typed and checked while the check runs."""
    from torch.distributed.tensor import DTensor

    to_local, from_local = DTensor.to_local, DTensor.from_local
    # The descriptors as the class holds them (from_local is a staticmethod), restored
    # as they were.
    held = {name: DTensor.__dict__[name] for name in ("to_local", "from_local")}

    def typed_to_local(self: Any, *, grad_placements: Any = None) -> Any:
        out = to_local(self, grad_placements=grad_placements)
        kind = checker.type_of(self)
        dims = dict(kind.dims) if kind is not None else {}
        params = kind.params if kind is not None else frozenset()
        grads = grad_placements or [None] * len(self.placements)
        mesh = self.device_mesh
        for index, (placement, grad) in enumerate(zip(self.placements, grads, strict=True)):
            covered = checker.covered(mesh, index)
            if placement.is_replicate():
                kind_here = REP if grad is not None and grad.is_partial() else INV
            elif placement.is_partial():
                kind_here = PART
            else:  # Shard, strided shards
                kind_here = VAR
            for dim in covered:
                dims[dim] = kind_here
        checker.set_type(out, _Type(dims, params))
        return out

    def typed_from_local(local: Any, device_mesh: Any = None, placements: Any = None,
                         *args: Any, **kwargs: Any) -> Any:
        out = from_local(local, device_mesh, placements, *args, **kwargs)
        kind = checker.type_of(local)
        if kind is None:
            return out
        mesh = out.device_mesh
        spanned: set[str] = set()
        for index, placement in enumerate(out.placements):
            covered = checker.covered(mesh, index)
            spanned |= covered
            if not placement.is_replicate():
                continue
            for dim in covered:
                held = kind.dims.get(dim)
                if not _grad(local):
                    continue
                if held == VAR:
                    checker.report(dim, "declared", kind.params, "DTensor.from_local")
                elif held == REP:
                    checker.report(dim, "double", kind.params, "DTensor.from_local")
                elif held == MIXED:
                    checker.report(dim, "double", kind.mixed[dim][0], "DTensor.from_local")
        off = {d: k for d, k in kind.dims.items() if d not in spanned}
        checker.set_type(out, _Type(off, kind.params))
        return out

    DTensor.to_local = typed_to_local  # type: ignore[method-assign]
    DTensor.from_local = staticmethod(typed_from_local)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        for name, descriptor in held.items():
            setattr(DTensor, name, descriptor)


@contextlib.contextmanager
def _summed_gradients(checker: _Checker) -> Iterator[None]:
    """``composer_par.plugin.gradient_sum.sum_gradient`` typed and checked as the
    ``from_local(Replicate)`` / ``to_local(grad_placements=Partial)`` pair it stands for:
    its input must be the same on every rank of the dim and not summed already; its
    result's gradient is summed there."""
    from composer_par.plugin import gradient_sum

    def typed(local: Any, out: Any, mesh: Any) -> None:
        kind = checker.type_of(local)
        dims = dict(kind.dims) if kind is not None else {}
        params = kind.params if kind is not None else frozenset()
        for dim in checker.covered(mesh, 0):
            held = dims.get(dim)
            if kind is not None and held == VAR:
                checker.report(dim, "declared", params, "sum_gradient")
            elif kind is not None and held == REP:
                checker.report(dim, "double", params, "sum_gradient")
            elif kind is not None and held == MIXED:
                checker.report(dim, "double", kind.mixed[dim][0], "sum_gradient")
            dims[dim] = REP
        checker.set_type(out, _Type(dims, params))

    with gradient_sum.watching(typed):
        yield


def _module_hooks(checker: _Checker, model: nn.Module) -> list[Any]:
    """Per module: the module stack, and its parameters typed as its forward uses them
    (a hook after every hook the plugins registered)."""
    from torch.distributed.tensor import DTensor

    handles = []
    for path, module in model.named_modules():
        checker.names[id(module)] = path

        def pre(mod: nn.Module, args: Any, path: str = path) -> None:
            checker.modules.append(path)
            for name, param in mod._parameters.items():
                if param is None:
                    continue
                full = f"{path}.{name}" if path else name
                known = checker.type_of(param)
                if known is not None:
                    if not known.params:
                        known.params = frozenset({full})
                        known.is_param = True
                    continue
                reduced = checker.at_rest.get((id(mod), name), frozenset())
                if torch_private.has_gradient_hooks(param):
                    # A plugin averaging over its folded dims by parameter hooks (with
                    # no data-parallel plugin to do it).
                    reduced |= checker.hooked
                on_mesh = checker.mesh_dims(param) if isinstance(param, DTensor) else frozenset()
                dims = {d: (REP if d in reduced else INV) for d in checker.dims
                        if d not in on_mesh}
                checker.set_type(param, _Type(dims, frozenset({full}), is_param=True))

        def post(mod: nn.Module, args: Any, out: Any) -> None:
            if checker.modules:
                checker.modules.pop()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    return handles


def _rest_layout(checker: _Checker, model: nn.Module) -> None:
    """What a data-parallel plugin will reduce: the dims each parameter's DTensor spans at
    rest (sharded or replicated by FSDP2/HSDP), before its forward gathers it."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        for name, param in module._parameters.items():
            if isinstance(param, DTensor):
                checker.at_rest[(id(module), name)] = checker.mesh_dims(param)


def check_reductions(model: nn.Module, run: Any, *, dims: Sequence[str],
                     groups: Mapping[str, frozenset[int]], data_dims: Sequence[str],
                     inputs: Sequence[Any], hooked_dims: Sequence[str] = ()
                     ) -> list[ReductionProblem]:
    """Run ``run()`` (one forward of ``model``) with every tensor typed per mesh dim of
    ``dims`` (those of size > 1); ``groups`` gives, per dim, this rank's group's ranks;
    ``inputs`` vary over ``data_dims``; a parameter with gradient hooks has its gradient
    reduced over ``hooked_dims`` (the folded dims a plugin averages over by hooks). The
    problems found, in the order found."""
    checker = _Checker(dims, groups, hooked_dims)
    _rest_layout(checker, model)
    # Over a dim a parameter is not a DTensor of at rest, nothing reduces its gradient.
    for tensor in inputs:
        checker.set_type(tensor, _Type({d: VAR for d in data_dims if d in checker.dims}))
    handles = _module_hooks(checker, model)
    mode = _mode_class()(checker)
    try:
        with _dtensor_boundaries(checker), _summed_gradients(checker), mode:
            run()
    finally:
        for handle in handles:
            handle.remove()
    return checker.problems


__all__ = ["ReductionProblem", "check_reductions"]
