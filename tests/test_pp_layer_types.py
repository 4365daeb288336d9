"""PP at parity on Hugging Face decoders whose layers differ by type: each stage's layers
run with their own entries of ``config.layer_types`` (the mask of a sliding layer, and
in Gemma 3 its rotary embedding), not the first layers' ones.

Qwen2 with sliding layers (the last stage holds full and sliding ones), Gemma 3 text
(per-layer rotary) and gpt-oss, built from tiny configs, under PP 2 and PP 2 x FSDP2 on
real gloo ranks; losses and every parameter (each rank's stage, gathered) against
single-process training from the same MetaInit weights (see tests/test_pp_parity.py).
"""

from __future__ import annotations

import pytest

from tests.test_pp_parity import case, check, pp

pytestmark = pytest.mark.distributed

TASKS = {"Qwen2, sliding layers": "hf_qwen2_sliding", "Gemma 3 text": "hf_gemma3",
         "gpt-oss": "hf_gpt_oss"}


def test_layer_types_two_stages() -> None:
    # Clipped as the other Hugging Face cases are: unclipped at lr 1, the microbatches'
    # summation order grows past atol in the steps.
    cases = {f"{name}, PP 2": case(task, "pp = 2", pp("1F1B"), world=2, clip=0.5)
             for name, task in TASKS.items()}
    # Two stages per rank: each stage's part reads its own cut config, not its rank's.
    cases["Qwen2, sliding layers, PP 2, Interleaved1F1B"] = case(
        "hf_qwen2_sliding", "pp = 2", pp("Interleaved1F1B", stages_per_rank=2), world=2,
        clip=0.5)
    check(cases, timeout=900)


def test_layer_types_two_stages_by_fsdp2() -> None:
    check({f"{name}, PP 2 x FSDP2": case(task, "pp = 2\ndp_shard = 2", pp("1F1B"),
                                         'name = "fsdp2"', world=4, clip=0.5)
           for name, task in TASKS.items()}, timeout=900)
