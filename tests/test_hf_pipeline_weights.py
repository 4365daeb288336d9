"""A Hugging Face model's ``save_pretrained`` loaded into a two-stage pipeline (2 gloo
ranks), then trained one step on a padded batch.

``save_pretrained`` writes some keys under older names that transformers renames when it
loads: GPT-NeoX's head as ``embed_out``, Mixtral's router as ``block_sparse_moe.gate``
(and its experts per expert, which the loader merges). A stage holds only its own layers
(and only the last stage the head), so it lacks the model names of the other stage's
renamed keys: LoadSafetensors' strict check must count those file keys as held by the
other stage, not as unexpected. Each rank's stage then holds the file's weights exactly.

The padding mask is a keyword argument of the step, which every stage is given: each
rank's gradients are the plain model's on the whole batch, and the loss is the plain
model's with the mask (which differs from its loss without it, so a stage running
without the mask would fail here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_par.testing.distributed import run_ranks

pytest.importorskip("transformers")

# llama: no key renamed; gpt_neox: the head renamed; mixtral: the router renamed and the
# experts merged.
FAMILIES = ("llama", "gpt_neox", "mixtral")
GRAD_ATOL = 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_into_pipeline_stages_and_trains_on_padding(
        family: str, tmp_path: Path) -> None:
    ranks = run_ranks("tests.hf_pipeline_workers:loaded_step", 2,
                      args=(family, str(tmp_path)), timeout=540)
    first, last = (set(r["names"]) for r in ranks)
    assert first and last and not first & last, "the stages hold disjoint parameters"
    for rank, row in enumerate(ranks):
        assert row["weights"] == 0.0, (family, rank, row)
        assert row["grads"] <= GRAD_ATOL, (family, rank, row)
        assert row["loss"] == pytest.approx(row["plain"], abs=1e-6), (family, rank, row)
        assert abs(row["plain"] - row["unmasked"]) > 1e-4, (family, "the mask changes nothing")
