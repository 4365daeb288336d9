"""What a healing replica group takes from a live one: this rank's shards of the model and
of the optimizers' state, as plain tensors.

Groups have equal layouts (the plan's static rules), and torchft pairs each rank of a
healing group with the same rank of a live one, so every tensor travels as this rank's
local part: a DTensor's local tensor, a plain tensor as it is. Nothing but tensors,
numbers, strings and containers crosses, so the receiving side reads it with torch's
weights-only unpickler (no code from a peer runs), and it rebuilds each DTensor on its
own mesh and placements, which equal the sender's. A tensor whose shape or dtype differs
from the receiver's is a layout mismatch between groups, refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


class ReplicaLayoutError(RuntimeError):
    """A live group's state does not fit this group's tensors: the groups' layouts differ."""


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``, detached: a DTensor's local tensor (aliasing it)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach()


def model_state(models: Iterable[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Every parameter and buffer of each model (pipeline part), as local parts."""
    return [{name: local_part(t) for name, t in _tensors(model)} for model in models]


def load_model_state(models: Iterable[nn.Module], sent: list[dict[str, Any]]) -> None:
    """Copy ``sent`` (:func:`model_state` of a peer) into each model's tensors, in place."""
    import torch

    models = list(models)
    if len(sent) != len(models):
        raise ReplicaLayoutError(f"the live group sent {len(sent)} model part(s); this group "
                                 f"holds {len(models)}")
    with torch.no_grad():
        for part, (model, values) in enumerate(zip(models, sent, strict=True)):
            mine = dict(_tensors(model))
            if set(mine) != set(values):
                missing = sorted(set(mine) ^ set(values))
                raise ReplicaLayoutError(
                    f"model part {part}: the live group's tensors differ from this group's "
                    f"(first: {missing[0]!r}); every replica group must build the same model")
            for name, tensor in mine.items():
                local_part(tensor).copy_(_checked(values[name], local_part(tensor), name))


def layout(mesh: Iterable[tuple[str, int]], models: Iterable[nn.Module]) -> dict[str, Any]:
    """What a group's state means: its launch mesh and, per tensor, the mesh dims and
    placements it is split by. Equal local shapes can hold different parts of a tensor
    (rows split over one dim in one group, over another in the next), so a heal compares
    this too."""
    from torch.distributed.tensor import DTensor

    placements = {}
    for part, model in enumerate(models):
        for name, tensor in _tensors(model):
            placements[f"{part}:{name}"] = (
                f"{tensor.device_mesh.mesh_dim_names} {tuple(map(str, tensor.placements))}"
                if isinstance(tensor, DTensor) else "whole")
    return {"mesh": [[name, size] for name, size in mesh], "placements": placements}


def check_layout(sent: Any, mine: dict[str, Any]) -> None:
    """ReplicaLayoutError naming the difference unless a live group's :func:`layout`
    equals this group's."""
    if sent == mine:
        return
    if not isinstance(sent, dict) or sent.get("mesh") != mine["mesh"]:
        theirs = sent.get("mesh") if isinstance(sent, dict) else sent
        raise ReplicaLayoutError(
            f"the live group's launch mesh is {theirs}, this group's {mine['mesh']}: every "
            "replica group must run the same plan on the same number of ranks")
    differing = sorted(k for k in set(sent["placements"]) | set(mine["placements"])
                       if sent["placements"].get(k) != mine["placements"].get(k))
    first = differing[0]
    raise ReplicaLayoutError(
        f"{first.partition(':')[2]}: the live group splits it as "
        f"{sent['placements'].get(first)}, this group as {mine['placements'].get(first)} "
        f"({len(differing)} tensor(s) differ): every replica group must run the same plan")


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each tensor as its local part."""
    full = optimizer.state_dict()
    return {"state": {key: {name: _local_value(value) for name, value in entry.items()}
                      for key, entry in full["state"].items()},
            "param_groups": full["param_groups"]}


def load_optimizer_state(optimizer: torch.optim.Optimizer, sent: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict`` of a peer's :func:`optimizer_state`: each state tensor
    shaped like its parameter's local part becomes a DTensor laid out as the parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[Any, dict[str, Any]] = {}
    for key, entry in sent["state"].items():
        index = int(key)
        if not 0 <= index < len(params):
            raise ReplicaLayoutError(f"optimizer state for parameter {index}; this group's "
                                     f"optimizer has {len(params)}")
        state[key] = {name: _as_parameter_layout(value, params[index], name)
                      for name, value in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": sent["param_groups"]})


def _tensors(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _local_value(value: Any) -> Any:
    import torch

    return local_part(value) if isinstance(value, torch.Tensor) else value


def _checked(value: Any, like: torch.Tensor, name: str) -> torch.Tensor:
    import torch

    if not isinstance(value, torch.Tensor) or value.shape != like.shape \
            or value.dtype != like.dtype:
        got = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise ReplicaLayoutError(
            f"{name}: the live group's local part is {got}, this rank's is "
            f"{tuple(like.shape)} {like.dtype}: the replica groups' layouts differ (every "
            "group must run the same plan on the same number of ranks)")
    return value


def _as_parameter_layout(value: Any, param: torch.Tensor, name: str) -> Any:
    """An optimizer state value as the optimizer keeps it for ``param``."""
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor) or not isinstance(param, DTensor) or name == "step":
        return value
    local = param.to_local()
    if value.shape != local.shape:
        return value  # a per-parameter scalar, not a shard
    return DTensor.from_local(value.to(local.device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride(), run_check=False)


def local_state_optimizer(cls: type) -> type:
    """A subclass of optimizer class ``cls`` whose ``state_dict`` holds local parts and
    whose ``load_state_dict`` takes them back (for an optimizer torchft's DiLoCo sends to
    a healing group, whose DTensors must not cross as such)."""

    class LocalState(cls):  # type: ignore[misc, valid-type]
        def state_dict(self) -> dict[str, Any]:
            full = super().state_dict()
            return {"state": {key: {name: _local_value(value) for name, value in entry.items()}
                              for key, entry in full["state"].items()},
                    "param_groups": full["param_groups"]}

        def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
            params = [p for group in self.param_groups for p in group["params"]]
            state = {key: {name: _as_parameter_layout(v, params[int(key)], name)
                           for name, v in entry.items()}
                     for key, entry in state_dict["state"].items()}
            super().load_state_dict({"state": state,
                                     "param_groups": state_dict["param_groups"]})

    LocalState.__name__ = LocalState.__qualname__ = f"LocalState{cls.__name__}"
    return LocalState


__all__ = ["ReplicaLayoutError", "check_layout", "layout", "load_model_state",
           "load_optimizer_state", "local_part", "local_state_optimizer", "model_state",
           "optimizer_state"]
