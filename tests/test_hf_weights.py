"""Hugging Face weights in and out, per family, on real gloo ranks: a plain model's
``save_pretrained(safe_serialization=True)`` loaded by LoadSafetensors into FSDP2, TP and
FSDP2 x TP gives the plain model's logits; the file's older key names (GPT-NeoX's
``embed_out``, ViT's ``encoder.layer.*.attention.attention.query``) are renamed, and its
per-expert tensors (Mixtral's ``block_sparse_moe.experts.0.w1.weight``, Qwen3-MoE's
``mlp.experts.0.gate_proj.weight``) merged into the model's fused experts, as transformers
does when it loads, each rank reading exactly the bytes of its own part (also of TP's
strided split of the packed expert weights, which DCP describes as one box);
``export_safetensors`` of the loaded model read back by ``from_pretrained`` gives the same
state dict, and the export (the fused layout) loads again the same way. A per-expert file
that cannot be merged is refused before anything changes (CP414/CP415, saying why and
what to do)."""

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
TP_FAMILIES = [f for f in hf_workers.FAMILIES if f not in NO_TP]


def _check(rows: list[dict[str, Any]]) -> None:
    problems = []
    for row in rows:
        where = f"{row['family']} x {row['plan']} from {row['from']}"
        if "error" in row:
            problems.append(f"{where}: raised\n{row['error']}")
            continue
        if row["plan"] in ("tp", "fsdp2_tp") and row["family"] in NO_TP:
            if (row["applied"] is not False or "CP408" not in row["codes"]
                    or not row["untouched"]):
                problems.append(f"{where}: expected CP408 before anything changed, got {row}")
            continue
        if row["per_expert"] != (row["family"] in MERGED and row["from"] == "save_pretrained"):
            problems.append(f"{where}: save_pretrained wrote per-expert tensors: "
                            f"{row['per_expert']}")
        if not row["applied"]:
            problems.append(f"{where}: refused\n{row.get('report')}")
            continue
        if row["logits"] > LOGITS_ATOL:
            problems.append(f"{where}: logits differ by {row['logits']}")
        if "export" in row and (not row["export_keys"] or row["export"] != 0.0):
            problems.append(f"{where}: export -> from_pretrained differs "
                            f"(keys equal: {row['export_keys']}, values by {row['export']})")
        if row["bytes_read"] != row["held"]:  # its own part's bytes, each once
            problems.append(f"{where}: a rank holding {row['held']} bytes of the model read "
                            f"{row['bytes_read']} of the file's {row['file_bytes']}")
    assert not problems, "\n".join(problems)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_every_family_loads_into_fsdp2_and_tp(tmp_path: Path) -> None:
    results = run_ranks(hf_workers.round_trips, 2, timeout=540,
                        args=(list(hf_workers.FAMILIES), ["fsdp2", "tp"], str(tmp_path)))
    for rows in results:  # each rank's own reads and comparisons
        _check(rows)
    assert any("export" in r for r in results[0])
    assert {(r["family"], r["plan"]) for r in results[0] if r["from"] == "export"} == {
        (f, p) for f in MERGED for p in ("fsdp2", "tp")}
    assert [r.get("logits") for r in results[1]] == [r.get("logits") for r in results[0]]


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_every_family_loads_into_fsdp2_x_tp(tmp_path: Path) -> None:
    # Every family TP supports, in one launch of 2 x 2 ranks; GPT-2 and BERT are refused.
    results = run_ranks(hf_workers.round_trips, 4, timeout=840,
                        args=(list(hf_workers.FAMILIES), ["fsdp2_tp"], str(tmp_path)))
    for rows in results:
        _check(rows)
    loaded = [r["family"] for r in results[0] if r["from"] == "save_pretrained" and r["applied"]]
    assert sorted(loaded) == sorted(TP_FAMILIES)


def _drop(directory: Path, pattern: str) -> None:
    """Rewrite the safetensors in ``directory`` without the keys containing ``pattern``."""
    from safetensors.torch import load_file, save_file

    for file in directory.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({k: v for k, v in tensors.items() if pattern not in k}, str(file),
                  metadata={"format": "pt"})


@pytest.mark.parametrize(("family", "dropped", "words"), [
    ("mixtral", ".experts.2.", "the experts numbered [0, 1, 3] are not 0..2"),
    ("qwen3_moe", ".up_proj.", "the file has no tensors for mlp.experts.*.up_proj.weight"),
])
def test_per_expert_files_that_cannot_be_merged_are_refused_untouched(
        tmp_path: Path, family: str, dropped: str, words: str) -> None:
    import torch

    from composer_par import LoadSafetensors, MeshSpec, ParallelPlan, PlanError

    hf_workers.build(family, meta=False).save_pretrained(tmp_path, safe_serialization=True)
    _drop(tmp_path, dropped)
    model = hf_workers.build(family)
    before = {n: (type(p), p.shape) for n, p in model.named_parameters()}
    plan = ParallelPlan(MeshSpec()).use(LoadSafetensors(str(tmp_path)))
    with pytest.raises(PlanError) as err:
        plan.apply(model)
    unexpected = [f for f in err.value.report.findings if f.code == "CP415"]
    assert len(unexpected) == 1 and words in unexpected[0].message, err.value.report.format()
    assert "export_safetensors" in unexpected[0].fix
    assert "CP414" in err.value.report.codes()  # the fused tensors: nothing to fill them
    assert {n: (type(p), p.shape) for n, p in model.named_parameters()} == before
    assert all(p.is_meta for p in model.parameters()) and torch.is_grad_enabled()


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_dcp_checkpoints_of_tp_packed_weights_reshard_bitwise(tmp_path: Path) -> None:
    """TP's packed (strided) weights -- Phi3's fused gate_up_proj split as packed halves,
    Mixtral's packed expert gate_up_proj -- saved with their Adam state by
    composer_par.checkpoint under TP 2 load into FSDP2 and TP on 2 ranks, into TP from
    an FSDP2 save, and into one process: every part of every tensor and optimizer state
    bitwise the saved model's. (DTensor describes a strided part to DCP as one box: the
    save failed with overlapping chunks.)"""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from composer_par import checkpoint

    results = run_ranks(hf_workers.packed_checkpoints, 2, timeout=540, args=(str(tmp_path),))
    problems = []
    for rank, rows in enumerate(results):
        assert [r["family"] for r in rows] == list(hf_workers.PACKED_CASES)
        for row in rows:
            where = f"rank {rank} {row['family']}"
            if "error" in row:
                problems.append(f"{where}: raised\n{row['error']}")
                continue
            if len(row["strided"]) != 2:  # one packed weight per layer, or no test
                problems.append(f"{where}: strided weights {row['strided']}")
            for case in ("initial", "tp->fsdp2", "tp->tp", "fsdp2->tp"):
                if row[case]:
                    problems.append(f"{where} {case}: differ in {row[case][:5]}")
    assert not problems, "\n".join(problems)
    for row in results[0]:  # one process, no process group
        family = row["family"]
        model = hf_workers.build(family, meta=False)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        checkpoint.load(tmp_path / f"{family}-tp", model, optimizer)
        saved_model, saved_optim = row["saved"]
        state = model.state_dict()
        assert sorted(state) == sorted(saved_model)
        differ = [k for k, v in state.items() if not torch.equal(v, saved_model[k])]
        optim = get_optimizer_state_dict(model, optimizer)["state"]
        got = {f"{n}:{k}": v for n, values in optim.items() for k, v in values.items()}
        assert sorted(got) == sorted(saved_optim)
        differ += [k for k, v in got.items() if not torch.equal(v, saved_optim[k])]
        assert not differ, f"{family}: one process loaded other values for {differ[:5]}"
