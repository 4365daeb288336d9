"""Rank workers for tests/test_hf_pipeline_weights.py: a Hugging Face model's
``save_pretrained`` loaded into a two-stage pipeline, then one step on a padded batch."""

from __future__ import annotations

import os
from typing import Any

from tests import hf_workers

LAYERS = 4  # two blocks a stage
MICROBATCHES = 4
PADDED = 5  # tokens of padding in each row


def padded_batch() -> tuple[Any, Any, Any]:
    """``(input_ids, attention_mask, labels)``: even rows padded on the left, odd rows on
    the right, the padding's labels ignored. Each microbatch holds one row of each, so
    every microbatch's mean loss counts as many tokens and their mean is the batch's."""
    import torch

    ids = hf_workers.batch("llama", 0, size=2 * MICROBATCHES)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0::2, :PADDED] = 0
    mask[1::2, -PADDED:] = 0
    ids = ids.masked_fill(mask == 0, hf_workers.COMMON["pad_token_id"])
    return ids, mask, ids.masked_fill(mask == 0, -100)


def next_token_loss(outputs: Any, labels: Any) -> Any:
    import torch.nn.functional as F

    logits = outputs.logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)


def loaded_step(family: str, directory: str) -> dict[str, Any]:
    """Rank 0 writes the plain model (seeded) with ``save_pretrained``; every rank loads
    its stage from it with LoadSafetensors (strict) under PP 2 and runs one step on the
    padded batch. Returns this rank's largest differences from the plain model: of its
    loaded parameters, and of its gradients from the plain model's on the whole batch;
    the step's loss, the plain model's with and without the mask."""
    import torch
    import torch.distributed as dist
    import transformers

    from composer_par import PP, LoadSafetensors, MeshSpec, ParallelPlan
    from composer_par.blocks import clean_name

    cfg = hf_workers.config(family, num_hidden_layers=LAYERS, use_cache=False,
                            tie_word_embeddings=False)
    cls = getattr(transformers, hf_workers.FAMILIES[family][1])
    torch.manual_seed(hf_workers.SEED)
    plain = cls(cfg)
    saved = os.path.join(directory, family)
    if dist.get_rank() == 0:
        plain.save_pretrained(saved, safe_serialization=True)
    dist.barrier()
    ids, mask, labels = padded_batch()
    loss = next_token_loss(plain(input_ids=ids, attention_mask=mask), labels)
    loss.backward()
    with torch.no_grad():
        unmasked = next_token_loss(plain(input_ids=ids), labels)
    expected = dict(plain.named_parameters())

    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="1F1B", microbatches=MICROBATCHES)) \
        .use(LoadSafetensors(saved))
    with torch.device("meta"):
        model = cls(cfg)
    model = plan.apply(model)
    own = {clean_name(n): p for n, p in model.named_parameters()}
    weights = max(float((p.detach() - expected[n].detach()).abs().max())
                  for n, p in own.items())
    step_loss = plan.training_step(model, next_token_loss).step(ids, labels,
                                                                attention_mask=mask)
    grads = max(float((p.grad - expected[n].grad).abs().max()) for n, p in own.items())
    return {"names": sorted(own), "weights": weights, "grads": grads,
            "loss": float(step_loss), "plain": float(loss), "unmasked": float(unmasked)}
