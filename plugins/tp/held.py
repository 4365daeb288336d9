"""One rank's view of the model for ``composer-par estimate``: the tensors TP's plan
splits, and those it leaves whole.

A model shape guesses: every tensor of two or more tensor dims split, fused routed
experts whole. The plan decides. It leaves whole what it names with no splitting style
(Qwen2-MoE's shared expert, the projections of DeepSeek's latent attention that its plan
does not list), and it splits fused experts where it gives their module the ``experts``
style, as the auto plan does for a Hugging Face model's fused experts
(:func:`.auto.fused_expert_entries`): each rank then holds ``1/tp`` of every expert.
What apply will do with the measured module is :func:`.resolution.resolve`'s answer;
a shape from numbers has no module and keeps its guess. Experts another plugin set apart
(expert parallelism, listed before TP) are in groups of their own, left alone here.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs

from composer_par.plugin import ModelShape

# module -> (plan, sequence_parallel, loss_parallel, tp size) -> the split tensors'
# names: one resolution per module and TP setting, however many layouts suggest tries.
_SPLIT: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], frozenset[str]]] = (
    weakref.WeakKeyDictionary())


def split_tensors(tp: Any, module: Any, size: int) -> frozenset[str]:
    """The names of the parameters TP's plan splits over ``size`` ranks: the weights of
    modules it gives a splitting style (and a column-parallel one's bias), and the
    parameters it splits by entries of their own (a MoE experts module's fused
    weights)."""
    from composer_par.plugin import clean_name

    from .resolution import resolve
    from .styles import EMBEDDING_STYLES, LINEAR_STYLES, PARAMETER_STYLES

    key = (repr(tp.plan), tp.sequence_parallel, tp.loss_parallel, size)
    cached = _SPLIT.setdefault(module, {})
    if key not in cached:
        resolution = resolve(tp, module, size)
        names: set[str] = set()
        for path, owner, spec in resolution.entries:
            # a colwise Linear's bias is split with its output features; a rowwise one's
            # is whole
            columns = LINEAR_STYLES.get(spec.style) == "out_features"
            if spec.style in LINEAR_STYLES or spec.style in EMBEDDING_STYLES:
                names.update(clean_name(f"{path}.{n}") for n, p in
                             owner.named_parameters(recurse=False)
                             if p.dim() >= 2 or columns)
        names.update(clean_name(path) for path, _, _, spec in resolution.params
                     if PARAMETER_STYLES.get(spec.style) is not None)
        cached[key] = frozenset(names)
    return cached[key]


def plan_split(tp: Any, layout: Any, model: ModelShape) -> ModelShape | None:
    """``model`` with each tensor marked ``tp`` where TP's plan splits it and whole
    where it does not (a routed experts tensor it splits: each expert's weights, see
    :meth:`TensorShape.local_numel`), or None when the shape has no module to resolve
    the plan against or already says so."""
    size = layout.mesh.size(tp.dim) if tp.dim in layout.mesh else 1
    if size < 2 or model.module is None:
        return None
    split = split_tensors(tp, model.module, size)
    groups = tuple(group if group.apart else attrs.evolve(group, tensors=tuple(
        attrs.evolve(t, tp=t.name in split) for t in group.tensors))
        for group in model.groups)
    if groups == model.groups:
        return None
    return attrs.evolve(model, groups=groups)


__all__ = ["plan_split", "split_tensors"]
