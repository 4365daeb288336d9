"""One gradient sum for a replicated input that several column-parallel layers share.

Without sequence parallelism, attention's q, k and v projections (and the MLP's gate and
up projections) each take the block's replicated hidden states. Each column-parallel
layer's backward gives only this rank's part of its input's gradient, and torch's
ColwiseParallel all-reduces that part layer by layer: 5 all-reduces of the activations
per Llama block, as transformers' own TP issues too. Megatron sums once per attention
and once per MLP (its fused QKV and gate/up layers take one input each).

Here the module holding the layers gets ``shared_input``: its first input becomes one
replicated DTensor that every child takes as it is. The children's partial gradients add
up (a sum of partial sums stays a partial sum), and the DTensor's conversion back sums
the total over tp once: 2 all-reduces per Llama block, the same values.

A module qualifies when at least two of its children are column-parallel layers taking a
replicated input, and every parameter below it has a plan entry whose style either takes
that input (the column-parallel kinds) or works on what they produce (the row-parallel
kinds, a per-head norm). A router, a norm or a latent projection left replicated
(mixture-of-experts blocks, latent attention) would compute on the DTensor: such a module
keeps the sum per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .styles import StyleSpec

#: Styles whose layer takes a replicated input and sums that input's gradient over tp.
TAKES_INPUT = {"colwise", "packed_colwise", "local_colwise"}
#: Styles that work on what the column-parallel layers produce.
AFTER_INPUT = {"rowwise", "packed_rowwise", "local_rowwise", "local_packed_rowwise",
               "replicate_grad_allreduce"}


def _owns_parameters(module: Any) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def shared_input_regions(specs: Mapping[str, StyleSpec], modules: Mapping[str, Any]
                         ) -> dict[str, StyleSpec]:
    """The plan's entries (module path -> spec) with ``shared_input`` on each module that
    qualifies (see the module docstring); nothing else changes."""
    out = dict(specs)
    children: dict[str, list[str]] = {}
    for path, spec in specs.items():
        replicated = spec.input_layouts in (None, ("replicate",))
        if "." in path and spec.style in TAKES_INPUT and replicated:
            children.setdefault(path.rsplit(".", 1)[0], []).append(path)
    for parent, layers in children.items():
        if len(layers) < 2 or parent in specs or _owns_parameters(modules[parent]):
            continue
        below = [n for n in modules if n.startswith(parent + ".")]
        if all(n in specs and specs[n].style in TAKES_INPUT | AFTER_INPUT
               for n in below if _owns_parameters(modules[n])):
            out[parent] = StyleSpec("shared_input")
    return out


__all__ = ["AFTER_INPUT", "TAKES_INPUT", "shared_input_regions"]
