"""What tensor parallelism costs a step, for ``composer-par estimate`` and ``suggest``:
its activation collectives over the tp dim (the logical payload bytes
:class:`~composer_par.testing.comm_count.CommCounter` counts) and its activation
buffers. Pure arithmetic: no torch.

TP moves ``s*b*h`` activations (this rank's tokens) twice per block in forward and twice
in backward: with sequence parallelism all-gather + reduce-scatter pairs (Megatron's
count: the input gathered once per attention and once per MLP); without it all-reduces,
backward all-reducing the input gradient of the column-parallel Linears that take a
replicated input: with the auto plan once per input they share (``shared_input``: the
attention's, the MLP's, a shared expert's; one per row-parallel output, 2 in a Llama
block), with an explicit plan without it once per Linear (5 in a Llama block; a MoE block whose
routed experts are held apart its attention's and its shared expert's only); once more
at the embedding and at the output head; plus the gathered logits unless loss
parallelism keeps them sharded (then its cross-entropy's three per-token reductions). A
checkpointed block's recomputation issues its forward's collectives again, up to what
the checkpointing plugin says (``checkpoint_reissue``). With sequence parallelism the
norms' gradients (partial sums over tp) are all-reduced, before a sharding plugin's
reduce-scatter or, without one, as they accumulate; without it, those of per-head norms.
A MoE block whose routed experts TP splits all-reduces its router's gradient, and under
sequence parallelism its output and input gradient (it computes on plain tensors). The
ranks wait for every one of them (no overlap). What a rank holds of the model is
:mod:`.held`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from composer_par.plugin import (
    Collective,
    EstimatePart,
    MemoryTerm,
    ModelShape,
    dtype_bytes,
    runs_of,
)

if TYPE_CHECKING:
    from composer_par.plugin import EstimateStage

ACCOUNTING = (
    "tp: 2 forward + 2 backward s*b*h activation collectives per block (+2 per recomputed "
    "block; without sequence parallel, one backward all-reduce per input that "
    "column-parallel Linears share, or with an explicit plan per Linear: 5 in a Llama "
    "block), +1 at the embedding and +1 at the output head each way, + the gathered logits "
    "without loss parallel; a MoE block of split experts all-reduces its router's gradient, "
    "and with sequence parallel its output and input gradient; all on the critical path; "
    "buffers 2*s*b*h",
)


def block_linears(model: ModelShape, moe_blocks: set[str]) -> tuple[int, int, int]:
    """(row-parallel, column-parallel, MLP row-parallel) Linears of every block: a dense
    block has two row-parallel outputs (attention's, the MLP's) and the column-parallel
    rest of its matrices; a MoE block whose routed experts are held apart
    (``moe_blocks``) its attention's output and its shared expert's, and the rest of the
    matrices TP splits (the router is not among them) column-parallel. A shape from
    numbers counts no matrices: its MoE blocks keep the dense blocks' column count."""
    colwise_dense = max(2, model.matrices_per_block - 2) if model.matrices_per_block else 2
    rows, cols, mlp = 2 * model.layers, colwise_dense * model.layers, model.layers
    if model.moe is None:
        return rows, cols, mlp
    rowwise = 1 + (1 if model.moe.shared_ffn else 0)
    for g in model.groups:
        if g.name not in moe_blocks or not g.block:
            continue
        colwise = (max(0, sum(1 for t in g.tensors if t.tp) - rowwise)
                   if model.matrices_per_block else colwise_dense)
        rows += (rowwise - 2) * g.count
        cols += (colwise - colwise_dense) * g.count
        mlp += (rowwise - 2) * g.count
    return rows, cols, mlp


def partial_sums(together: list[Any], split_moe: list[Any],
                 partial: Callable[[Any], bool]) -> list[tuple[int, int]]:
    """(elements, count) of each whole tensor whose gradient every tp rank computes a
    part of, all-reduced once per pass: those ``partial`` picks among the tensors TP
    leaves whole, and the router of each block whose routed experts TP splits (each
    rank's experts give part of every output)."""
    out = []
    for g in together:
        for t in g.tensors:
            if not t.tp and not t.experts and ((t.router and g in split_moe) or partial(t)):
                out.append((t.numel, g.count))
    return out


def collectives(layout: Any, model: ModelShape, workload: Any, dim: str,
                micro: int, shared_inputs: bool = True) -> list[Collective]:
    """The collectives over the tp dim ``dim`` of one step (``micro`` passes).
    ``shared_inputs``: column-parallel Linears sum the gradient of an input they share
    once (the auto plan's ``shared_input``), not once each."""
    tokens = workload.seq // layout.sequence_split * workload.micro_batch
    act_bytes = dtype_bytes(workload.dtype)
    grad_bytes = dtype_bytes(workload.dtype)
    x = tokens * model.hidden * act_bytes
    layers = model.layers
    mode = workload.activation_checkpoint or "none"
    # A checkpointed block's recomputation in backward issues its collectives again: up
    # to the last tensor backward needs (torch's early stop, full checkpointing's
    # default): not the MLP's output collective; without early stop, all of them;
    # selective checkpointing that saves collective outputs (the plugin's default), none.
    reissue = layout.reissue(mode)
    recomputed = layout.reissued_blocks(mode, layers)
    outputs_again = recomputed if reissue == "all" else 0  # the MLP's output collective
    together = [g for g in model.groups if not g.apart]
    has_root = any(not g.block and g.numel for g in together)
    root = 1 if has_root else 0
    moe_blocks = {g.parent for g in model.groups if g.apart and g.parent}
    # Blocks whose routed experts TP splits (each rank 1/tp of every expert): each
    # rank's experts give part of every output, so the router's gradient is a partial
    # sum over tp.
    split_moe = [g for g in together if g.block and any(t.experts and t.tp for t in g.tensors)]
    out: list[Collective] = []
    if layout.sequence_parallel:
        # per block and direction: gather the attention and the MLP input, reduce-scatter
        # their outputs; the embedding scatters (forward) and the head gathers its input;
        # a recomputed block gathers both inputs again and reduce-scatters attention's.
        # A MoE block whose experts TP splits computes on plain tensors (TP's
        # sequence_region_local): its output and its input gradient are all-reduced.
        moe = sum(g.count for g in split_moe)
        moe_again = outputs_again * moe // max(1, layers)
        gathers = 2 * (2 * layers + root) + 2 * recomputed
        scatters = 2 * (2 * layers + root) + recomputed + outputs_again - 2 * moe - moe_again
        out.append(Collective(dim, "all_gather", gathers * x * micro, gathers * micro,
                              "activations (sequence parallel): attention/MLP inputs"))
        out.append(Collective(dim, "reduce_scatter", scatters * x * micro, scatters * micro,
                              "activations (sequence parallel): attention/MLP outputs"))
        if moe:
            summed = 2 * moe + moe_again
            out.append(Collective(dim, "all_reduce", summed * x * micro, summed * micro,
                                  "activations (sequence parallel): MoE blocks' outputs "
                                  "and input gradients, on plain tensors"))
        # the sequence-parallel norms' gradients (and a split-experts router's) are
        # partial sums over tp: all-reduced to the parameters' placement (by FSDP2 before
        # its reduce-scatter, or by DTensor as they accumulate)
        partial = partial_sums(together, split_moe, lambda t: len(t.shape) == 1)
        if partial:
            out.append(Collective(dim, "all_reduce",
                                  sum(n * c for n, c in partial) * grad_bytes * micro,
                                  sum(c for _, c in partial) * micro,
                                  "gradients of sequence-parallel norms"))
    else:
        # forward: the row-parallel outputs (2 per dense block) and the embedding;
        # backward: the input gradient of the column-parallel Linears that take a
        # replicated input, and of the output head: once per input they share, which
        # each row-parallel output closes (attention, the MLP, a shared expert), or with
        # an explicit plan once per Linear (torch's ColwiseParallel reduces each
        # separately). A recomputed block issues its forward's again but the MLP's
        # output (the last: early stop), or all of them.
        rowwise, colwise, mlp = block_linears(model, moe_blocks)
        if shared_inputs:
            colwise = min(colwise, rowwise)
        if recomputed:
            again = rowwise if reissue == "all" else rowwise - mlp
            recomputed = again * recomputed // max(1, layers)
        calls = rowwise + root + recomputed + colwise + root
        per_block = (f"forward {rowwise // layers}, backward {colwise // layers} per block"
                     if layers and not rowwise % layers and not colwise % layers else
                     f"forward {rowwise}, backward {colwise} over {layers} blocks")
        inputs = "shared " if shared_inputs else ""
        out.append(Collective(dim, "all_reduce", calls * x * micro, calls * micro,
                              f"activations: {per_block} (one per {inputs}column-parallel "
                              "input), "
                              "+1 each way at the embedding / output head"
                              + ("; MoE blocks: attention and shared expert only"
                                 if moe_blocks else "")))
        # per-head norms (Qwen3's, Gemma 3's q and k norms) see this rank's heads only
        heads = (model.heads or 0) > 1
        partial = partial_sums(together, split_moe,
                               lambda t: heads and t.shape == (model.attention_head_dim,))
        if partial:
            out.append(Collective(dim, "all_reduce",
                                  sum(n * c for n, c in partial) * grad_bytes * micro,
                                  sum(c for _, c in partial) * micro,
                                  "gradients of replicated tensors each rank computes a "
                                  "part of (per-head norms, a router beside split experts)"))
    if model.vocab and has_root and not layout.loss_parallel:
        logits = tokens * model.vocab * act_bytes
        out.append(Collective(dim, "all_gather", logits * micro, micro,
                              "logits gathered from the vocabulary-split output head"))
    elif model.vocab and has_root:
        # Loss-parallel cross-entropy (torch's) reduces one fp32 value per token three
        # times in forward, over the vocabulary shards: the logits' max, the sum of their
        # exponentials and the target's logit; its backward is local.
        out.append(Collective(dim, "all_reduce", 3 * tokens * 4 * micro, 3 * micro,
                              "loss-parallel cross-entropy: max, sum of exponentials and "
                              "target logit per token"))
    return out


def estimate_part(tp: Any, layout: Any, model: ModelShape, workload: Any,
                  stage: EstimateStage | None) -> EstimatePart | None:
    """TP's terms for ``layout`` (its plugin object ``tp``: its dim)."""
    if tp.dim not in layout.mesh or layout.mesh.size(tp.dim) < 2:
        return None
    # The auto plan gives shared_input where it fits; an explicit plan where it says so.
    shared = tp.plan == "auto" or any(spec.style == "shared_input"
                                      for _, spec in tp.entries()[0])
    found = collectives(layout, model, workload, tp.dim, runs_of(workload, stage),
                        shared_inputs=shared)
    tokens = workload.seq // layout.sequence_split * workload.micro_batch
    buffers = MemoryTerm("buffers", 2 * tokens * model.hidden * dtype_bytes(workload.dtype),
                         "activations gathered or being reduced over tp (2*s*b*h)",
                         transient=True)
    return EstimatePart(collectives=tuple(found), terms=(buffers,), accounting=ACCOUNTING)


__all__ = ["ACCOUNTING", "block_linears", "collectives", "estimate_part"]
