"""The routed experts as expert parallelism holds them: each group's experts tensors in
a group of their own, ``num_experts / ep`` experts per rank, which data parallelism
shards or replicates over its dims without ep (``ParamGroup.apart``), as FSDP2 shards
the modules a plugin asks to be sharded apart."""

from __future__ import annotations

import attrs

from composer_par.estimate.layout import Layout
from composer_par.estimate.model_shape import ModelShape, ParamGroup


def experts_apart(model: ModelShape, layout: Layout) -> ModelShape:
    """``model`` with every group's routed experts tensors moved to a group of their own
    (named ``"<group> experts"``, right after it), holding this rank's ``num_experts /
    ep`` experts and sharded apart from ``layout.experts_dim``; unchanged without expert
    parallelism or experts."""
    dim = layout.experts_dim
    if dim is None or not model.experts_params:
        return model
    ep = layout.experts_size()
    groups: list[ParamGroup] = []
    for group in model.groups:
        routed = [t for t in group.tensors if t.experts]
        if not routed:
            groups.append(group)
            continue
        rest = tuple(t for t in group.tensors if not t.experts)
        if rest:
            groups.append(attrs.evolve(group, tensors=rest))
        held = tuple(attrs.evolve(t, shape=(-(-t.shape[0] // ep), *t.shape[1:]))
                     for t in routed)
        groups.append(ParamGroup(f"{group.name} experts", held, block=group.block,
                                 count=group.count, apart=(dim,)))
    return attrs.evolve(model, groups=tuple(groups))


def split_apart(model: ModelShape) -> tuple[ModelShape, ModelShape]:
    """(the groups data parallelism runs over all its dims, the groups sharded apart),
    each as a model shape."""
    together = tuple(g for g in model.groups if not g.apart)
    apart = tuple(g for g in model.groups if g.apart)
    return attrs.evolve(model, groups=together), attrs.evolve(model, groups=apart)


__all__ = ["experts_apart", "split_apart"]
