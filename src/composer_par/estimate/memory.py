"""Per-rank memory at peak: parameters, gradients and optimizer states as the plan's
roles shard them (ZeRO's accounting), activations (Korthikanti et al. 2022, and counted
from the block's structure for a Llama's make), and what the plugins add by category."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from composer_par.estimate.layout import Layout, local_workload
from composer_par.estimate.model_shape import ModelShape
from composer_par.estimate.parts import MemoryTerm
from composer_par.estimate.units import bytes_of
from composer_par.estimate.workload import AC_MODES, Workload


@attrs.frozen
class Memory:
    """Per-rank bytes at peak, by category; ``activations_by_mode`` gives the
    activations with each activation-checkpointing mode for comparison; ``terms``: what
    each plugin added, by category (``(plugin, term)``), already in the totals."""

    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    activations_by_mode: Mapping[str, int]
    extra: Mapping[str, int] = attrs.field(factory=dict)
    local_params: int = 0  # elements of parameters one rank holds
    terms: tuple[tuple[str, MemoryTerm], ...] = ()
    # Held only at the start of backward, beside every activation: the loss's gradients
    # (:func:`loss_gradient_bytes`); not among ``activations``, which are what autograd
    # keeps at the end of forward.
    loss_gradients: int = 0

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations
                + self.comm_buffers + self.loss_gradients + sum(self.extra.values()))

    def by_plugin(self, category: str) -> list[tuple[str, MemoryTerm]]:
        """What the plugins added to ``category``."""
        return [(who, t) for who, t in self.terms if t.category == category]

    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "comm_buffers": self.comm_buffers,
                "loss_gradients": self.loss_gradients, "extra": dict(self.extra),
                "total": self.total,
                "activations_by_mode": dict(self.activations_by_mode),
                "local_params": self.local_params,
                "terms": [{"plugin": who, "category": t.category, "bytes": t.bytes,
                           "why": t.why} for who, t in self.terms]}


def activation_bytes(
    model: ModelShape, workload: Workload, dtype: str, *, tp: int, sequence_parallel: bool,
    loss_parallel: bool, mode: str, every: int = 1, recompute: bool = True,
    dispatched: bool = False, matmul_every: int = 1, head: bool = True,
    saved_attention: bool = False, saved_collectives: bool = True,
) -> int:
    """Per-rank activation bytes of one micro-batch (Korthikanti et al. 2022).

    ``recompute=False`` leaves out the one block that full checkpointing recomputes at a
    time (a rank holding several microbatches' activations recomputes one block).
    ``dispatched``: a mixture-of-experts block's routed pairs travel to experts on other
    ranks and back (one more hidden-sized tensor kept per pair, and where each went).
    ``matmul_every``: selective checkpointing saves the output of the 1st, (N+1)-th, ...
    matmul of a block (a Llama's make: q, k, v, o, gate, up, down).
    ``head``: the layers after the blocks (the final norm) run here; a pipeline stage
    without them says False. ``saved_attention``: selective checkpointing also saves
    the attention kernel's output and log-sum-exp (counted for a Llama's make);
    ``saved_collectives=False``: selective checkpointing issues tensor parallelism's
    collectives again in backward instead of keeping their outputs (a Llama's make)."""
    if _is_llama_like(model):
        return _llama_activation_bytes(model, workload, dtype, tp=tp,
                                       sequence_parallel=sequence_parallel,
                                       loss_parallel=loss_parallel, mode=mode, every=every,
                                       recompute=recompute, dispatched=dispatched,
                                       matmul_every=matmul_every, head=head,
                                       saved_attention=saved_attention,
                                       saved_collectives=saved_collectives)
    s, b, h = workload.seq, workload.micro_batch, model.hidden
    sbh = s * b * h
    eager = workload.attention == "eager" and model.heads
    attention = 5 * model.heads * s / h if eager else 0.0  # type: ignore[operator]
    if tp > 1 and sequence_parallel:
        full_block = sbh * (34 + attention) / tp
        selective_block = sbh * 34 / tp
        kept = 2 * sbh / tp
    elif tp > 1:
        full_block = sbh * (10 + 24 / tp + attention / tp)
        selective_block = sbh * (10 + 24 / tp)
        kept = 2 * sbh
    else:
        full_block = sbh * (34 + attention)
        selective_block = sbh * 34
        kept = 2 * sbh
    layers = model.layers
    if mode == "none":
        total = layers * full_block
    elif mode == "selective":
        checkpointed = layers // every
        total = checkpointed * selective_block + (layers - checkpointed) * full_block
    else:
        checkpointed = layers // every
        total = checkpointed * kept + (layers - checkpointed) * full_block
        if checkpointed and recompute:
            total += full_block  # one block's activations while it is recomputed
    scale = bytes_of(dtype) / 2  # the coefficients are for 16-bit activations
    logits = 0.0
    if model.vocab:
        logits = s * b * model.vocab * 4 / (tp if loss_parallel and tp > 1 else 1)
    return int(total * scale + logits)


def _is_llama_like(model: ModelShape) -> bool:
    """A decoder block of a Llama's make (RMSNorm, attention with separate q/k/v/o
    projections, a gated MLP of ``ffn_hidden``): seven matrices per block when measured
    from a module, or an MLP size given with the numbers."""
    if model.moe is not None and model.heads:
        return True  # its MLP counted as the MoE blocks' (_moe_mlp)
    if not (model.ffn_hidden and model.heads):
        return False
    if model.source == "numbers":
        return True
    return model.matrices_per_block == 7


# Bytes per routed (token, slot) pair of the int64 indices a MoE block keeps for
# backward (which token and slot each pair is, and, under expert parallelism, where it
# was sent), and of one fp32 router probability per expert and token; measured on the
# MoE Llama (tests/test_ep_estimate.py).
_PAIR_INDEX_BYTES = 24
_PAIR_INDEX_BYTES_EP = 44


def _moe_mlp(model: ModelShape, t: int, dtype_bytes: int, dispatched: bool,
             saved_collectives: bool = True) -> tuple[float, float, float]:
    """(full, selective, fixed bytes) per token of the feed-forward part of a block
    averaged over the blocks: elements kept (without checkpointing; selective
    checkpointing's matmul outputs) and bytes that do not scale with the dtype.

    A MoE block keeps, per routed pair, the expert's input, its gate, activation, up and
    product (``4 f_e``), its output and, under expert parallelism, the pair's hidden
    state as it came back (``3h + 4 f_e``, ``4h + 4 f_e`` with EP); per token the
    router's probabilities (fp32) and, for the shared expert, a gated MLP's ``4 f_s``
    (``dispatched``: the pairs travel to experts on other ranks). Selective
    checkpointing keeps, beside the matmul outputs, the dispatched pairs' all-to-all
    outputs when it saves the collectives' (the pair as it arrived and its output as it
    came back, ``2h``). A dense block of the same model keeps ``4f``. Measured on the
    MoE Llama."""
    moe = model.moe
    assert moe is not None
    h, k, e = model.hidden, moe.top_k, moe.expert_ffn
    c = 4 if dispatched else 3
    routed = k * (c * h + 4 * e) + 4 * moe.shared_ffn / t
    routed_selective = k * (2 * e + h) + moe.num_experts + (2 * moe.shared_ffn / t
                                                           + h if moe.shared_ffn else 0)
    if dispatched and saved_collectives:
        routed_selective += k * 2 * h
    fixed = (moe.num_experts * 4 + k * (_PAIR_INDEX_BYTES_EP if dispatched
                                        else _PAIR_INDEX_BYTES)) / dtype_bytes
    f = model.ffn_hidden or 4 * h
    moe_blocks = model.moe_blocks
    dense = model.layers - moe_blocks
    layers = max(1, model.layers)
    full = (dense * 4 * f / t + moe_blocks * (routed + fixed)) / layers
    selective = (dense * (2 * f / t + h) + moe_blocks * (routed_selective + fixed)) / layers
    return full, selective, fixed


# A Llama block's matmuls in forward order: selective checkpointing counts them so.
_MATMULS = ("q", "k", "v", "o", "gate", "up", "down")


def _llama_activation_bytes(
    model: ModelShape, workload: Workload, dtype: str, *, tp: int, sequence_parallel: bool,
    loss_parallel: bool, mode: str, every: int, recompute: bool,
    dispatched: bool = False, matmul_every: int = 1, head: bool = True,
    saved_attention: bool = False, saved_collectives: bool = True,
) -> int:
    """Per-rank activation bytes of one micro-batch of a Llama-like model: the tensors
    autograd keeps for backward, counted from the block's structure (measured on the
    project's Llama and on transformers' LlamaForCausalLM, within 10%: docs/estimate.md).

    Per token of a block without checkpointing (``h`` hidden, ``f`` the MLP's size,
    ``a`` heads): each of the two RMSNorms keeps its input, the normalized tensor and
    its output (what the projections after it keep as their input), ``3h``, plus one
    value (the reciprocal root); attention keeps q and the k and v expanded to every head
    (grouped-query attention repeats them before the kernel), the kernel's output (also
    the output projection's input) and one log-sum-exp per head, ``4h + a``; the gated MLP
    keeps the gate projection's output, its activation, the up projection's output and
    their product, ``4f``. Tensor parallelism splits the attention and MLP terms (heads and
    ``f``); the norms run on replicated tokens, or with sequence parallelism on the rank's
    share of them, the projections after them then keeping the gathered whole input (``h``)
    instead. Full checkpointing keeps each checkpointed block's input and, in backward,
    one block's activations while it is recomputed; selective checkpointing keeps the
    block's input and the matmul outputs: q, k, v (``h + 2 h_kv``), the output projection's
    and the down projection's (``2h``) and the gate and up projections' (``2f``), divided
    by ``tp`` where the matmul is split, and under TP the collectives' outputs; with
    ``matmul_every=N`` only the outputs of the block's 1st, (N+1)-th, ... matmul in
    forward order (q, k, v, o, gate, up, down), the others recomputed from the block's
    input (a MoE block's feed-forward part keeps the same share of its matmul outputs as
    a dense block's gate, up and down would).
    """
    s, b, h = workload.seq, workload.micro_batch, model.hidden
    a, f = model.heads or 1, model.ffn_hidden or 4 * h
    kv = (model.kv_heads or a) * (h // a)
    t = tp if tp > 1 else 1
    eager = workload.attention == "eager"
    attention = (4 * h + a + (a * s if eager else 0)) / t
    mlp = 4 * f / t
    # the matmul outputs selective checkpointing keeps of the MLP: gate, up, down
    mlp_selective = 2 * f / t + h
    if model.moe is not None:
        mlp, mlp_selective, _ = _moe_mlp(model, t, bytes_of(dtype), dispatched,
                                         saved_collectives)
    if t > 1 and sequence_parallel:
        norms = 2 * (2 * h / t + 1 / t + h)
        block_input = h / t
    else:
        norms = 2 * (3 * h + 1)
        block_input = h
    full_block = norms + attention + mlp
    matmul_outputs = (h + 2 * kv) / t + h + mlp_selective
    if matmul_every > 1:
        saved = set(_MATMULS[::matmul_every])
        outputs = {"q": h / t, "k": kv / t, "v": kv / t, "o": h}
        if model.moe is None:
            outputs.update(gate=f / t, up=f / t, down=h)
        matmul_outputs = sum(size for name, size in outputs.items() if name in saved)
        if model.moe is not None:
            matmul_outputs += mlp_selective * len(saved & {"gate", "up", "down"}) / 3
    # Selective checkpointing saves collective outputs too (the plugin's default): under
    # TP the row-parallel outputs' all-reduces (2h), or with sequence parallelism the
    # gathered inputs (2h) and the reduce-scattered outputs (2h/t); without them, backward
    # issues the collectives again (measured on 2 ranks: tests/test_activation_memory.py).
    collective_outputs = 0.0
    if t > 1 and saved_collectives:
        collective_outputs = 2 * h + (2 * h / t if sequence_parallel else 0)
    selective_block = block_input + matmul_outputs + collective_outputs
    if saved_attention:
        # the kernel's output (the rank's heads' share of h) and one fp32 log-sum-exp
        # per head
        selective_block += (h + a * 4 / bytes_of(dtype)) / t
    layers = model.layers
    checkpointed = layers // every if mode != "none" else 0
    per_token = (layers - checkpointed) * full_block
    if mode == "selective":
        per_token += checkpointed * selective_block
    elif mode == "full":
        per_token += checkpointed * block_input
        if checkpointed and recompute:
            per_token += full_block  # one block's activations while it is recomputed
    # After the blocks: the final norm (as a block's norms: 3h + 1 per token, or its
    # sequence-parallel share and the gathered input of the head).
    if head:
        per_token += (2 * h / t + 1 / t + h) if t > 1 and sequence_parallel else 3 * h + 1
    total = s * b * per_token * bytes_of(dtype)
    logits = 0.0
    if model.vocab:
        # the loss's log-softmax output, in fp32 (losses upcast the logits)
        logits = s * b * model.vocab * 4 / (t if loss_parallel else 1)
    return int(total + logits)


def loss_gradient_bytes(model: ModelShape, workload: Workload, *, tp: int,
                        loss_parallel: bool) -> int:
    """What the loss adds at its peak, the start of backward, when every activation is
    still held: the gradient of its log-softmax output (cross-entropy's backward writes
    a dense fp32 tensor of the logits' size) and the one it computes from it for the
    logits, two more fp32 copies of the logits beside the log-softmax output the
    activations count (one rank's share of the vocabulary with loss parallelism).
    ``workload``: one rank's (:func:`~.layout.local_workload`)."""
    if not model.vocab:
        return 0
    logits = workload.seq * workload.micro_batch * model.vocab * 4
    return 2 * logits // (tp if loss_parallel and tp > 1 else 1)


def optimizer_bytes(optimizer: str, mixed: bool) -> int:
    if optimizer in ("adamw", "adam"):
        return 12 if mixed else 8
    if optimizer == "sgd":
        return 4 if mixed else 0
    return 0


def held_elements(layout: Layout, model: ModelShape, tp: int, shard: int) -> int:
    """Elements of parameters one rank holds: each group split by ``tp`` and sharded
    over ``shard`` ranks, a group set apart over the shard dims without the dims it
    differs along."""
    return sum(g.local_numel(tp, shard if not g.apart else layout.shard_size(g.apart))
               * g.count for g in model.groups)


def activations_by_mode(layout: Layout, model: ModelShape, workload: Workload, dtype: str,
                        tp: int, mode: str, *, recompute: bool = True) -> dict[str, int]:
    """One micro-batch's activations per rank with each checkpointing mode (``mode``'s
    with the layout's every-N-th block and matmul saving, the others on every block)."""
    return {m: activation_bytes(model, local_workload(layout, workload), dtype, tp=tp,
                                sequence_parallel=layout.sequence_parallel,
                                loss_parallel=layout.loss_parallel, mode=m,
                                every=layout.checkpoint_every if m == mode else 1,
                                recompute=recompute, dispatched=model.dispatched,
                                matmul_every=(layout.checkpoint_matmul_every if m == mode
                                              else 1),
                                saved_attention=(layout.checkpoint_saves_attention
                                                 and m == mode),
                                saved_collectives=(layout.checkpoint_saves_collectives
                                                   or m != mode))
            for m in AC_MODES}


def memory_per_rank(
    layout: Layout, model: ModelShape, workload: Workload,
    terms: Sequence[tuple[str, MemoryTerm]], *, dtype: str, mode: str, tp: int, shard: int,
    by_mode: Mapping[str, int] | None = None,
) -> Memory:
    """Per-rank bytes at peak of ``model`` as one rank holds it, with activation
    checkpointing ``mode`` (``by_mode``: the activations per mode, when the caller
    counted them), plus what the plugins state (``terms``, by category).

    Parameters, gradients and optimizer states are divided as the roles of the plan's
    mesh dims divide them (ZeRO's accounting): by the shard dims and the dims data
    parallelism folds in, and, for the tensors model parallelism splits, its dims."""
    mixed = bytes_of(dtype) == 2
    pbytes = 2 if mixed else bytes_of(dtype)
    local = held_elements(layout, model, tp, shard)
    if by_mode is None:
        by_mode = activations_by_mode(layout, model, workload, dtype, tp, mode)
    totals = {"params": local * pbytes, "grads": local * pbytes,
              "optimizer": local * optimizer_bytes(workload.optimizer, mixed),
              "activations": by_mode[mode], "buffers": 0}
    extra: dict[str, int] = {}
    for who, term in terms:
        if term.category == "other":
            key = f"{who}: {term.why}" if who else term.why
            extra[key] = extra.get(key, 0) + int(term.bytes)
        else:
            totals[term.category] += int(term.bytes)
    loss = loss_gradient_bytes(model, local_workload(layout, workload), tp=tp,
                               loss_parallel=layout.loss_parallel)
    return Memory(totals["params"], totals["grads"], totals["optimizer"],
                  totals["activations"], totals["buffers"], dict(by_mode), extra, local,
                  tuple(terms), loss_gradients=loss)
