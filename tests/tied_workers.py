"""Rank-side functions of tests/test_tied_parity.py: real Hugging Face models whose token
embedding is their output head (GPT-2, BERT, a tied Llama, ERNIE 4.5), trained under
FSDP2 and FSDP2 x TP at parity with one process, and saved and loaded with their tie.

The parity cases reuse :func:`tests.hf_workers.train_case`; what is added here is the
tie itself (the head's weight is the embedding's parameter object on every rank, before
and after training and after a load) and the checkpoint round trips.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from tests import hf_workers

STEPS = 10
# BERT has no tp plan of its own and TP(auto) recognizes none of its names: its
# attention and MLP projections written out, the tied embedding and decoder left whole.
BERT_TP = {
    **{f"bert.encoder.layer.*.attention.self.{p}": "colwise" for p in ("query", "key", "value")},
    "bert.encoder.layer.*.attention.output.dense": "rowwise",
    "bert.encoder.layer.*.intermediate.dense": "colwise",
    "bert.encoder.layer.*.output.dense": "rowwise",
}


def plan_for(layout: str, world: int, seed: int = hf_workers.SEED) -> Any:
    """"fsdp2" (every rank) or "fsdp2_tp" (dp_shard = world / 2, tp = 2, TP(auto)), or
    "fsdp2_tp_bert" (the same mesh, BERT_TP), all initialized by MetaInit(seed)."""
    from composer_par import FSDP2, TP, MeshSpec, MetaInit, ParallelPlan

    if layout == "fsdp2":
        plan = ParallelPlan(MeshSpec(dp_shard=world)).use(FSDP2())
    elif layout == "fsdp2_tp":
        plan = ParallelPlan(MeshSpec(dp_shard=world // 2, tp=2)).use(FSDP2()).use(TP())
    elif layout == "fsdp2_tp_bert":
        plan = (ParallelPlan(MeshSpec(dp_shard=world // 2, tp=2)).use(FSDP2())
                .use(TP(plan=BERT_TP)))
    else:
        raise ValueError(layout)
    return plan.use(MetaInit(seed=seed))


def head_is_embedding(model: Any) -> bool:
    """The output head's weight is the input embedding's parameter (one object)."""
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def train_cases(cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Each (family, layout) case trained STEPS steps by hf_workers.train_case (every
    parameter part of this rank against the single-process reference). Its ``ties`` and
    ``tied_after`` name each parameter registered in two modules (one object), before
    and after training."""
    import torch.distributed as dist

    refs: dict[str, Any] = {}
    out = []
    for family, layout in cases:
        try:
            row = hf_workers.train_case(family, layout, STEPS, refs=refs,
                                        plan=plan_for(layout, dist.get_world_size()))
        except Exception:
            row = {"family": family, "plan": layout, "applied": None,
                   "error": traceback.format_exc()[-3000:]}
        row["rank"] = dist.get_rank()
        out.append(row)
    return out


# -- checkpoints ---------------------------------------------------------------------------


def _step(model: Any, family: str, plan: Any, optimizer: Any, step: int) -> None:
    index, count = plan.data_shard()
    model(**hf_workers.shard(hf_workers.batch(family, step), index, count)).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _optimizer(model: Any) -> Any:
    """SGD with momentum: an optimizer state to save, and no step that blows a gradient
    of rounding noise up to a full step (as Adam does for BERT's key biases, whose
    gradient is zero: softmax ignores a shift shared by a query's scores)."""
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _applied(family: str, layout: str, seed: int) -> tuple[Any, Any]:
    import torch.distributed as dist

    plan = plan_for(layout, dist.get_world_size(), seed)
    model = plan.apply(hf_workers.build(family)).train()
    return plan, model


def save_and_continue(root: str, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Per (family, layout): apply it (MetaInit(SEED)), 2 SGD steps, save to
    ``root/family`` with composer_par.checkpoint, then 1 step more. Returns, per family,
    the whole saved state, the whole state after the third step, and whether the head
    was the embedding at the save and after the step that follows it."""
    from composer_par import checkpoint

    out: dict[str, Any] = {}
    for family, layout in cases:
        try:
            plan, model = _applied(family, layout, hf_workers.SEED)
            optimizer = _optimizer(model)
            for step in range(2):
                _step(model, family, plan, optimizer, step)
            tied = head_is_embedding(model)
            saved = hf_workers.full_state(model, optimizer)
            checkpoint.save(os.path.join(root, family), model, optimizer, step=2, plan=plan)
            _step(model, family, plan, optimizer, 2)
            out[family] = {"saved": saved, "continued": hf_workers.full_state(model, optimizer),
                           "tied": tied and head_is_embedding(model)}
        except Exception:
            out[family] = {"error": traceback.format_exc()[-3000:]}
    return out


def load_and_continue(root: str, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Per (family, layout): apply it from another seed, load ``root/family``, then the
    third step. Returns, per family, the whole state right after the load and after the
    step, and whether the head was the embedding after each."""
    from composer_par import checkpoint

    out: dict[str, Any] = {}
    for family, layout in cases:
        try:
            plan, model = _applied(family, layout, hf_workers.SEED + 1)
            optimizer = _optimizer(model)
            info = checkpoint.load(os.path.join(root, family), model, optimizer)
            loaded = hf_workers.full_state(model, optimizer)
            tied = head_is_embedding(model)
            _step(model, family, plan, optimizer, info.step)
            out[family] = {"loaded": loaded, "continued": hf_workers.full_state(model, optimizer),
                           "tied": tied and head_is_embedding(model), "step": info.step}
        except Exception:
            out[family] = {"error": traceback.format_exc()[-3000:]}
    return out


def round_trip(root: str, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """save_and_continue, then load_and_continue into freshly applied models of the same
    layouts, on this process group."""
    return {"saved": save_and_continue(root, cases), "loaded": load_and_continue(root, cases)}
