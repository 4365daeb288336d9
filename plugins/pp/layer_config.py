"""Per-layer config lists cut to each pipeline stage's layers.

Hugging Face decoders pick each layer's attention mask (Qwen2's sliding layers, gpt-oss)
and rotary embedding (Gemma 3) in the base model's forward by
``self.config.layer_types[i]``, ``i`` counting the layers that forward iterates. A stage
iterates its own layers only, so read against the whole model's list its later layers
would take the first layers' types. Each stage's module that holds the layer container
(the base model) is therefore given its own shallow copy of the config in which every
per-layer list (a list or tuple as long as ``num_hidden_layers``) holds the entries of
the stage's layers, in order, and ``num_hidden_layers`` is the stage's count. The layers
themselves keep the original config: what they read by their own global index was read
when they were built. The original config object is never changed (the stages of one
process, and the user's model, share it).

Where the layers' global indices cannot be told (a container whose keys are not the
layer numbers), or a list cannot be cut, the plan refuses with CP611 naming the model
and the attribute.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import clean_name

if TYPE_CHECKING:
    import torch.nn as nn

# Lists of a config that are not one entry per layer whatever their length.
_NOT_PER_LAYER = frozenset({"architectures"})


def per_layer_attributes(config: Any) -> list[str]:
    """The names of ``config``'s lists that hold one entry per layer."""
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return []
    try:
        items = vars(config).items()
    except TypeError:
        return []
    return [name for name, value in items
            if not name.startswith("_") and name not in _NOT_PER_LAYER
            and isinstance(value, (list, tuple)) and len(value) == count]


@attrs.frozen
class StageLayers:
    """What one stage's config holder needs: the holder's path in the model (``""``: the
    root), the global indices of the stage's layers under it, and the lists to cut."""

    holder: str
    indices: tuple[int, ...]
    attributes: tuple[str, ...]


class LayerConfigError(ValueError):
    """A stage's per-layer config cannot be cut (the CP611 finding's text)."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


_FIX = ("keep the layers in a ModuleList (or a container keyed by layer number) directly "
        "under the module holding the config, or drop the per-layer setting")


def _holder(modules: dict[str, nn.Module], container: str) -> str | None:
    """The nearest ancestor of ``container`` holding a ``config``."""
    path = container
    while path:
        path = path.rsplit(".", 1)[0] if "." in path else ""
        module = modules.get(path)
        if module is not None and getattr(module, "config", None) is not None:
            return path
    return None


def stage_layers(model: nn.Module, blocks: Sequence[Sequence[str]]) -> list[list[StageLayers]]:
    """Per stage (``blocks``: its block paths), what its config holders need; raises
    :class:`LayerConfigError` where a per-layer list cannot be cut to a stage."""
    modules = {clean_name(n): m for n, m in model.named_modules()}
    out: list[list[StageLayers]] = []
    for stage_blocks in blocks:
        by_container: dict[str, list[str]] = {}
        for block in stage_blocks:
            if "." in block:
                container, key = block.rsplit(".", 1)
                by_container.setdefault(container, []).append(key)
        needs: list[StageLayers] = []
        for container, keys in by_container.items():
            holder = _holder(modules, container)
            if holder is None:
                continue
            config = modules[holder].config  # type: ignore[union-attr]
            attributes = per_layer_attributes(config)
            if not attributes:
                continue
            where = f"{type(model).__name__}" + (f".{holder}" if holder else "")
            names = ", ".join(f"config.{a}" for a in attributes)
            count = config.num_hidden_layers
            bad = [k for k in keys if not k.isdigit() or int(k) >= count]
            if bad:
                raise LayerConfigError(
                    f"{where} reads its per-layer {names} ({count} entries), and its layer "
                    f"container {container} holds {container}.{bad[0]}, which is no layer "
                    "number below num_hidden_layers: a pipeline stage cannot tell which "
                    "entries its layers are", _FIX)
            needs.append(StageLayers(holder, tuple(int(k) for k in keys), tuple(attributes)))
        out.append(needs)
    return out


def cut_config(config: Any, layers: StageLayers, model_name: str) -> Any:
    """A shallow copy of ``config`` with its per-layer lists holding ``layers.indices``'
    entries and ``num_hidden_layers`` their count; ``config`` is left as it was."""
    cut = copy.copy(config)
    try:
        cut.num_hidden_layers = len(layers.indices)
        for name in layers.attributes:
            value = getattr(config, name)
            setattr(cut, name, type(value)(value[i] for i in layers.indices))
    except Exception as exc:  # a config class refusing the assignment
        raise LayerConfigError(
            f"{model_name}'s config ({type(config).__name__}) refuses per-layer lists "
            f"cut to a pipeline stage ({', '.join(layers.attributes)}): "
            f"{type(exc).__name__}: {exc}", _FIX) from exc
    return cut


def give_stage_configs(part: nn.Module, needs: Sequence[StageLayers], model_name: str) -> None:
    """Give each config holder of a stage's ``part`` its stage's cut config (the holder
    is the part's own object: the model pruned in place, or a stage's shallow copy)."""
    modules = {clean_name(n): m for n, m in part.named_modules()}
    for layers in needs:
        holder = modules[layers.holder]
        holder.config = cut_config(holder.config, layers, model_name)


__all__ = ["LayerConfigError", "StageLayers", "cut_config", "give_stage_configs",
           "per_layer_attributes", "stage_layers"]
