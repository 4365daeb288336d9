"""A torch optimizer whose state lives in files, streamed through the step unit by unit.

:class:`OffloadedOptimizer` wraps a torch optimizer whose state is per parameter (a dict
of tensors and plain numbers for each parameter: SGD with momentum, Adam, AdamW,
Adagrad, RMSprop, ...). Its parameters are cut into *units* (the FSDP2 units of a plan,
or consecutive parameters up to a byte budget). Between steps no unit's state is in
memory: each is one safetensors file (:mod:`.store`). ``step()`` runs the wrapped
optimizer once per unit, with the parameter groups narrowed to that unit's parameters:
it reads the unit's state, updates the unit's parameters, writes the state back and
drops it, so the host holds about one unit's state at a time.

The update is the wrapped optimizer's own code on the same tensors: torch's optimizers
update each parameter from its own gradient and state alone (the per-tensor and
``foreach`` paths do the same arithmetic), so training is bitwise equal to the wrapped
optimizer stepping all parameters at once. A DTensor state tensor is stored as its
local shard and rebuilt on the parameter's mesh and placements.

``state_dict()`` reads every unit (a checkpoint holds the whole state: so does memory,
while it is saved); ``load_state_dict()`` writes every unit and drops the state again.
Both keep torch's format, so ``composer_par.checkpoint.save``/``load`` and DCP's
``get_state_dict``/``set_state_dict`` take the offloaded optimizer as any other.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from composer_par.plugin import Finding, claim_directory, remove_dead_directories

from .store import LOST_STATE, OffloadStorageError, UnitStore

#: Every offload directory's name starts so: a later run tells its own from the user's.
DIRECTORY_PREFIX = "composer-par-offload-"
#: A directory without a claim (killed between making it and claiming it) is removed
#: once it is this old.
UNCLAIMED_AGE_S = 600.0

#: The safetensors metadata key holding how each state entry is rebuilt.
LAYOUT_KEY = "composer_par.offload"

#: Optimizers whose step needs a closure evaluated once over every parameter, or whose
#: state is not per parameter: streaming them unit by unit would change their result.
NOT_STREAMABLE = {"LBFGS": "its step re-evaluates the loss (a closure) over every "
                  "parameter at once, and it keeps its state on the first parameter only"}


class OffloadError(ValueError):
    """What the offload refuses when it wraps an optimizer or steps it (CP952, CP953,
    CP955): ``finding`` holds the code, the message and the fix."""

    def __init__(self, code: str, message: str, fix: str) -> None:
        self.finding = Finding(code, message, fix=fix, plugin="offload")
        super().__init__(self.finding.format())


def _param_label(names: Mapping[int, str], param: torch.Tensor, fallback: str) -> str:
    return names.get(id(param), fallback)


class Unit:
    """The parameters of one unit, in the order they are in the optimizer's groups."""

    def __init__(self, index: int, label: str, params: list[torch.Tensor]) -> None:
        self.index = index
        self.label = label
        self.params = params
        self.ids = {id(p) for p in params}


class OffloadedState(Mapping[torch.Tensor, dict[str, Any]]):
    """The offloaded optimizer's ``state``: read from the unit files on access. Its
    length (and truth) is the number of parameters with stored state, as torch's
    ``optimizer.state`` is; DCP's ``get_state_dict`` reads it to tell a fresh optimizer
    from one that has stepped."""

    def __init__(self, owner: OffloadedOptimizer) -> None:
        self._owner = owner

    def __len__(self) -> int:
        if self._owner.lost is not None:  # placeholder state, for a load to replace
            return sum(len(unit.params) for unit in self._owner.units)
        return sum(len(held) for held in self._owner._held.values())

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self._owner.lost is not None:
            for unit in self._owner.units:
                yield from unit.params
            return
        for unit in self._owner.units:
            held = self._owner._held.get(unit.index, set())
            yield from (p for p in unit.params if id(p) in held)

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        if self._owner.lost is not None:
            raise self._owner.lost_error()
        unit = self._owner._unit_of.get(id(param))
        if unit is None or id(param) not in self._owner._held.get(unit.index, set()):
            raise KeyError(param)
        return self._owner._read(unit)[id(param)]


def _cleanup(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


class OffloadedOptimizer(torch.optim.Optimizer):
    """``optimizer`` with its state in files under a fresh directory inside ``path``.

    ``units``: (label, parameters) per unit; parameters of ``optimizer`` in no unit form
    one more unit. ``names``: parameter names for messages. The directory is removed
    when the optimizer is garbage collected or :meth:`close` is called.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, path: str | Path,
                 units: Sequence[tuple[str, Sequence[torch.Tensor]]],
                 names: Mapping[int, str] | None = None, *, prefix: str = "") -> None:
        # torch.optim.Optimizer.__init__ would build state and groups of its own: this
        # wrapper shares the wrapped optimizer's groups instead (LR schedulers set them).
        kind = type(optimizer).__name__
        if kind in NOT_STREAMABLE:
            raise OffloadError("CP955", f"offload cannot stream {kind}: "
                               f"{NOT_STREAMABLE[kind]}",
                               fix="use a per-parameter optimizer (AdamW, Adam, SGD, ...), "
                               "or FSDP2's offload = \"cpu\" for this one")
        if isinstance(optimizer, OffloadedOptimizer):
            raise ValueError("the optimizer is offloaded already; wrap the torch "
                             "optimizer once")
        root = Path(path)
        if not root.is_dir():
            raise OffloadError("CP952", f"the offload path {root} is not a directory",
                               fix="create it, on the NVMe device, before training")
        self.inner = optimizer
        self.defaults = optimizer.defaults
        self._names = dict(names or {})
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = {}
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = {}
        # The directories of killed runs (their finalizers never ran) go first.
        self.removed_stale = remove_dead_directories(
            root, lambda name: name.startswith(DIRECTORY_PREFIX),
            unclaimed_age=UNCLAIMED_AGE_S)
        try:
            self.directory = Path(tempfile.mkdtemp(prefix=DIRECTORY_PREFIX + prefix, dir=root))
            self._finalizer = weakref.finalize(self, _cleanup, self.directory)
            claim_directory(self.directory)
        except OSError as e:
            raise OffloadError("CP953", f"offload cannot make its directory in {root}: "
                               f"{e.strerror}", fix=f"make {root} writable by the training "
                               "processes, or choose another path") from e
        self.store = UnitStore(self.directory)
        self.units = self._cut(units)
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        # Per unit, the ids of its parameters that have stored state.
        self._held: dict[int, set[int]] = {}
        #: Why the stored state was dropped (None: it is intact); see :meth:`lost_error`.
        self.lost: str | None = None
        if optimizer.state:  # a stepped or loaded optimizer: its state goes to disk now
            self._store_all()

    def _cut(self, given: Sequence[tuple[str, Sequence[torch.Tensor]]]) -> list[Unit]:
        mine = [p for g in self.param_groups for p in g["params"]]
        order = {id(p): i for i, p in enumerate(mine)}
        units: list[Unit] = []
        taken: set[int] = set()
        for label, params in given:
            kept = sorted((p for p in params if id(p) in order and id(p) not in taken),
                          key=lambda p: order[id(p)])
            if kept:
                taken.update(id(p) for p in kept)
                units.append(Unit(len(units), label, kept))
        rest = [p for p in mine if id(p) not in taken]
        if rest:
            units.append(Unit(len(units), "parameters in no unit", rest))
        return units

    # -- the step ---------------------------------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        # The wrapped optimizer's own list, whatever it is now: its load_state_dict
        # replaces it.
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> OffloadedState:  # type: ignore[override]
        return OffloadedState(self)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of the wrapped optimizer, unit by unit (see the module)."""
        if self.lost is not None:
            raise self.lost_error()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        groups = self.param_groups
        everything = [g["params"] for g in groups]
        try:
            for unit in self.units:
                if not any(p.grad is not None for p in unit.params):
                    continue  # torch's optimizers leave such parameters (and state) alone
                for group, params in zip(groups, everything, strict=True):
                    group["params"] = [p for p in params if id(p) in unit.ids]
                self._load(unit)
                self.inner.step()
                self._store(unit)
        except OffloadStorageError as e:
            self._lose(e)
            raise
        finally:
            for group, params in zip(groups, everything, strict=True):
                group["params"] = params
            self.inner.state.clear()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)
        known = {id(p) for u in self.units for p in u.params}
        new = [p for p in self.param_groups[-1]["params"] if id(p) not in known]
        if new:
            unit = Unit(len(self.units), f"parameter group {len(self.param_groups) - 1}", new)
            self.units.append(unit)
            self._unit_of.update({id(p): unit for p in new})

    def close(self) -> None:
        """Remove the state files and their directory (the optimizer is unusable after)."""
        self._finalizer()

    # -- state in and out of files -------------------------------------------------------

    def _load(self, unit: Unit) -> None:
        if unit.index in self._held:
            self.inner.state.update(self._read_params(unit))

    def _read(self, unit: Unit) -> dict[int, dict[str, Any]]:
        return {id(p): v for p, v in self._read_params(unit).items()}

    def _read_params(self, unit: Unit) -> dict[torch.Tensor, dict[str, Any]]:
        device = unit.params[0].device
        tensors, metadata = self.store.read(unit.index, unit.label, device)
        layout = json.loads(metadata[LAYOUT_KEY])
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for index, entries in layout.items():
            param = unit.params[int(index)]
            values: dict[str, Any] = {}
            for key, (kind, value) in entries.items():
                if kind == "value":
                    values[key] = value
                elif kind == "dtensor":
                    from torch.distributed.tensor import DTensor

                    sharded = cast(DTensor, param)
                    values[key] = DTensor.from_local(
                        tensors[f"{index}/{key}"], sharded.device_mesh, sharded.placements,
                        run_check=False, shape=param.shape, stride=param.stride())
                else:
                    values[key] = tensors[f"{index}/{key}"]
            state[param] = values
        return state

    def _store(self, unit: Unit, *, stepped: bool = True) -> None:
        inner = self.inner.state
        stray = [p for p in inner if id(p) not in unit.ids] if stepped else []
        if stray:
            raise OffloadError(
                "CP955", f"{type(self.inner).__name__} keeps state on parameters it did not "
                f"step ({len(stray)} outside unit {unit.label}): its state is not per "
                "parameter, so offload cannot stream it",
                fix="use a per-parameter optimizer (AdamW, Adam, SGD, ...), or FSDP2's "
                "offload = \"cpu\" for this one")
        tensors: dict[str, torch.Tensor] = {}
        layout: dict[str, dict[str, tuple[str, Any]]] = {}
        for index, param in enumerate(unit.params):
            if param not in inner:
                continue
            entries: dict[str, tuple[str, Any]] = {}
            for key, value in inner[param].items():
                entries[key] = self._entry(unit, index, param, key, value, tensors)
            layout[str(index)] = entries
        for param in unit.params:
            inner.pop(param, None)
        if not layout:
            self._held.pop(unit.index, None)
            return
        self.store.write(unit.index, unit.label, tensors,
                         {LAYOUT_KEY: json.dumps(layout)})
        self._held[unit.index] = {id(unit.params[int(i)]) for i in layout}

    def _entry(self, unit: Unit, index: int, param: torch.Tensor, key: str, value: Any,
               tensors: dict[str, torch.Tensor]) -> tuple[str, Any]:
        name = f"{index}/{key}"
        if isinstance(value, torch.Tensor):
            from torch.distributed.tensor import DTensor

            if isinstance(value, DTensor):
                if (not isinstance(param, DTensor) or value.device_mesh != param.device_mesh
                        or value.placements != param.placements):
                    raise self._unstreamable(unit, param, key, "a DTensor laid out unlike "
                                             "its parameter")
                tensors[name] = value.to_local()
                return ("dtensor", None)
            tensors[name] = value
            return ("tensor", None)
        if value is None or isinstance(value, (bool, int, float, str)):
            return ("value", value)
        raise self._unstreamable(unit, param, key, f"a {type(value).__name__}")

    def _unstreamable(self, unit: Unit, param: torch.Tensor, key: str, what: str
                      ) -> OffloadError:
        name = _param_label(self._names, param, f"a parameter of unit {unit.label}")
        return OffloadError(
            "CP955", f"{type(self.inner).__name__}'s state {key!r} of {name} is {what}; "
            "offload streams tensors (plain, or DTensors laid out as their parameter) and "
            "plain numbers only", fix="use FSDP2's offload = \"cpu\" for this optimizer")

    def _store_all(self) -> None:
        try:
            for unit in self.units:
                self._store(unit, stepped=False)
        finally:
            self.inner.state.clear()

    # -- torch's state dict -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict, every unit read back (torch's format).

        After the stored state was lost (:attr:`lost`), the state of a fresh optimizer
        (as torch builds it: one step with zero gradients and learning rate), so that a
        checkpoint load sees every key it fills; nothing is read from the files."""
        if self.lost is not None:
            return self._fresh_state_dict()
        try:
            for unit in self.units:
                self._load(unit)
            return self.inner.state_dict()
        except OffloadStorageError as e:
            self._lose(e)
            raise
        finally:
            self.inner.state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load torch's format into the wrapped optimizer, then write every unit (this is
        how a checkpoint load restores state that was lost)."""
        self.inner.state.clear()
        self.inner.load_state_dict(state_dict)
        self._held.clear()
        self.store.forget()
        try:
            self._store_all()
        except OffloadStorageError as e:
            self._lose(e)
            raise
        self.lost = None

    # -- after a storage error -----------------------------------------------------------

    def _lose(self, error: OffloadStorageError) -> None:
        """Drop the stored state after ``error``: part of a step may have been applied
        and part of the state is unreadable, so none of it is trusted again. Until a
        checkpoint load refills it, :meth:`step` refuses and the state reads as fresh."""
        self.lost = str(error)
        self.inner.state.clear()
        self._held.clear()
        self.store.forget()

    def lost_error(self) -> OffloadStorageError:
        import errno

        return OffloadStorageError(errno.EIO, f"the offloaded optimizer state was lost "
                                   f"({self.lost}). {LOST_STATE}")

    def _fresh_state_dict(self) -> dict[str, Any]:
        """torch's state dict of this optimizer had it never stepped: the state one step
        with zero gradients and zero learning rate builds (torch's own way to give a
        state dict the keys a load fills), parameters and gradients left as they were."""
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        rates = [g.get("lr") for g in self.param_groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p) if p.requires_grad else None
            for group in self.param_groups:
                if "lr" in group:
                    lr = group["lr"]
                    group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
            self.inner.state.clear()
            with torch.no_grad():
                self.inner.step()
            return self.inner.state_dict()
        finally:
            for group, lr in zip(self.param_groups, rates, strict=True):
                if "lr" in group:
                    group["lr"] = lr
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            self.inner.state.clear()

    def __repr__(self) -> str:
        return (f"OffloadedOptimizer({type(self.inner).__name__}, {len(self.units)} units "
                f"in {self.directory})")
