"""Hugging Face weights in and out, per family, on real gloo ranks: a plain model's
``save_pretrained(safe_serialization=True)`` loaded by LoadSafetensors into FSDP2, TP and
FSDP2 x TP gives the plain model's logits; the file's older key names (GPT-NeoX's
``embed_out``, ViT's ``encoder.layer.*.attention.attention.query``) are renamed as
transformers renames them when it loads; ``export_safetensors`` of the loaded model read
back by ``from_pretrained`` gives the same state dict. Per-expert tensors, which
transformers merges into fused experts when it loads, are refused before anything
changes (CP414/CP415, saying why and what to do), and the way the refusal names works:
read once with ``from_pretrained``, written with ``export_safetensors``, loaded — also
into TP's strided split of the packed expert weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from composer_par.testing.distributed import run_ranks
from tests import hf_workers

pytest.importorskip("transformers")

LOGITS_ATOL = 1e-5
NO_TP = {"gpt2", "bert"}  # TP(auto) has no plan for them (CP408, see test_hf_models)
MERGED = {"mixtral", "qwen3_moe"}  # per-expert tensors in the file, fused in the model


def _check(rows: list[dict[str, Any]]) -> None:
    problems = []
    for row in rows:
        where = f"{row['family']} x {row['plan']} from {row['from']}"
        if "error" in row:
            problems.append(f"{where}: raised\n{row['error']}")
            continue
        direct = row["from"] == "save_pretrained"
        if row["plan"] in ("tp", "fsdp2_tp") and row["family"] in NO_TP:
            if row["applied"] is not False or "CP408" not in row["codes"]:
                problems.append(f"{where}: expected CP408, got {row}")
            continue
        if direct and row["family"] in MERGED:
            if (row["applied"] is not False or "CP415" not in row["codes"]
                    or "merges into one when it loads" not in row["report"]
                    or "export_safetensors" not in row["report"] or not row["untouched"]):
                problems.append(f"{where}: expected a refusal before anything changed: {row}")
            continue
        if not row["applied"]:
            problems.append(f"{where}: refused\n{row.get('report')}")
            continue
        if row["logits"] > LOGITS_ATOL:
            problems.append(f"{where}: logits differ by {row['logits']}")
        if "export" in row and (not row["export_keys"] or row["export"] != 0.0):
            problems.append(f"{where}: export -> from_pretrained differs "
                            f"(keys equal: {row['export_keys']}, values by {row['export']})")
    sources = {(r["family"], r["from"]) for r in rows}
    assert {(f, "via export") for f in MERGED} & sources, "the way around was not tried"
    assert not problems, "\n".join(problems)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_every_family_loads_into_fsdp2_and_tp(tmp_path: Path) -> None:
    results = run_ranks(hf_workers.round_trips, 2, timeout=540,
                        args=(list(hf_workers.FAMILIES), ["fsdp2", "tp"], str(tmp_path)))
    _check(results[0])
    # every rank computed the same logits comparison
    assert [r.get("logits") for r in results[1]] == [r.get("logits") for r in results[0]]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_families_load_into_fsdp2_x_tp(tmp_path: Path) -> None:
    # a plain one, a tied embedding, renamed keys, and packed expert weights (strided)
    families = ["llama", "gemma", "gpt_neox", "mixtral"]
    results = run_ranks(hf_workers.round_trips, 4, timeout=540,
                        args=(families, ["fsdp2_tp"], str(tmp_path)))
    _check(results[0])
