"""Rank side of tests/test_cp_docs.py: docs/cp.md's first Python block, run as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parent.parent / "docs" / "cp.md"


def first_python_block() -> str:
    match = re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    assert match is not None, "docs/cp.md has no python block"
    return match.group(1)


def run_doc_example(steps: int) -> dict[str, Any]:
    """Run the block with ``model`` a tiny transformers Llama (SDPA) built on meta and
    ``batches`` this rank's data shard of ``steps`` global batches; return the losses
    the training step gave and the same global mean loss computed in this process by the
    unsplit model with the plan's full weights."""
    import torch
    import torch.nn.functional as F

    from composer_par.testing.parity import full_parameters
    from tests.cp_workers import ContextHF

    task = ContextHF("llama")
    namespace: dict[str, Any] = {"model": task.build()}
    batches = [task.batch(step) for step in range(steps)]

    def shard_batches() -> Any:
        index, count = namespace["plan"].data_shard()
        for tokens in batches:
            yield tokens.chunk(count)[index]
            namespace.setdefault("losses", []).append(float(namespace["loss"]))

    namespace["batches"] = shard_batches()
    exec(compile(first_python_block(), str(DOC), "exec"), namespace)
    model = namespace["model"]
    # The same weights, whole, in one process: the global batch's mean token loss.
    reference = _unsplit(task)
    missing, unexpected = reference.load_state_dict(full_parameters(model), strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    expected = []
    for tokens in batches:
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
        positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        with torch.no_grad():
            logits = reference(input_ids=tokens, position_ids=positions).logits
        expected.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                              labels.reshape(-1))))
    return {"losses": namespace["losses"], "expected": expected}


def _unsplit(task: Any) -> Any:
    """The task's model built on the CPU (its buffers computed), in one process."""
    import transformers

    from tests import hf_workers

    config = hf_workers.config(task.family, **task.overrides)
    config._attn_implementation = "sdpa"
    return getattr(transformers, hf_workers.FAMILIES[task.family][1])(config)
