"""Checkpoints and weights with pipeline parallelism, on real gloo ranks.

A DCP checkpoint saved from PP x FSDP2 (one and two stages per rank) loads into FSDP2
without a pipeline and into one process, and one saved without a pipeline loads into
PP x FSDP2: every full tensor of model and optimizer (AdamW) state bitwise equal. The
optimizer's parameter groups survive only the loads into a plan without a pipeline (an
xfail test below: the checkpoint keeps rank 0's groups).
LoadSafetensors into a pipeline reads on each rank only its stage's tensors (its shard
of them).

Under a pipeline a rank's model holds its stages' keys only, so the other stages' keys
in a checkpoint or weights file are "unexpected" to the strict key checks of
``checkpoint.load`` and LoadSafetensors, which do not know of pipelines yet: loading into
a pipeline takes ``strict=False`` today (the xfail tests below say what is missing), and
``export_safetensors`` plans its files from rank 0's keys alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from composer_par.testing.distributed import run_ranks
from tests import pp_workers as workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def assert_bitwise(expected: dict[str, Any], got: Any, what: str) -> None:
    assert isinstance(got, dict), f"{what}: {got}"
    got = {k: v for k, v in got.items() if k not in ("groups", "held")}
    assert expected.keys() == got.keys(), f"{what}: keys differ: {set(expected) ^ set(got)}"
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == got[key].dtype and torch.equal(value, got[key]), (what, key)
        else:
            assert value == got[key], (what, key)


def test_pp_checkpoints_load_without_pp_into_one_process_and_back(tmp_path: Path) -> None:
    root = str(tmp_path)
    saved = run_ranks(workers.pp_save_many, 4, args=(root, ["pp_fsdp2", "pp_virtual_fsdp2"]),
                      timeout=600)[0]
    saved.update(run_ranks(workers.pp_save_many, 1, args=(root, ["one_process"]),
                           timeout=300)[0])
    # Two stages' worth of keys, whole: the model's and AdamW's (exp_avg, exp_avg_sq, step).
    assert any(k.startswith("model.tok_embeddings") for k in saved["pp_fsdp2"])
    assert any(k.startswith("optim.output.weight.exp_avg") for k in saved["pp_fsdp2"])
    one = run_ranks(workers.pp_load_many, 1, args=(root, [
        ("pp_fsdp2", "one_process", True), ("pp_virtual_fsdp2", "one_process", True)]),
        timeout=300)[0]
    ranks = run_ranks(workers.pp_load_many, 4, args=(root, [
        ("pp_fsdp2", "fsdp2_4", True), ("pp_virtual_fsdp2", "fsdp2_4", True),
        ("one_process", "pp_fsdp2", False), ("pp_fsdp2", "pp_virtual_fsdp2", False)]),
        timeout=600)
    loaded = {**one, **ranks[0]}
    # Without a pipeline every rank's optimizer keeps the saved hyperparameters.
    for rank in ranks:
        for pair in ("pp_fsdp2->fsdp2_4", "pp_virtual_fsdp2->fsdp2_4"):
            assert rank[pair]["held"] and rank[pair]["groups"][0]["lr"] == 0.01, pair
    for pair in ["pp_fsdp2->one_process", "pp_virtual_fsdp2->one_process",
                 "pp_fsdp2->fsdp2_4", "pp_virtual_fsdp2->fsdp2_4",
                 "one_process->pp_fsdp2", "pp_fsdp2->pp_virtual_fsdp2"]:
        assert_bitwise(saved[pair.split("->")[0]], loaded[pair], pair)


def test_strict_load_into_a_pipeline_names_the_other_stages_keys(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(workers.pp_save_many, 1, args=(root, ["one_process"]), timeout=300)
    (got,) = run_ranks(workers.pp_load_many, 4, args=(root, [
        ("one_process", "pp_fsdp2", True)]), timeout=300)[:1]
    text = got["one_process->pp_fsdp2"]
    assert isinstance(text, str) and text.startswith("KeyMismatchError"), text
    assert "not in the model" in text


@pytest.mark.xfail(reason="checkpoint.save records the optimizer's parameter groups from "
                   "rank 0 alone: loaded into a pipeline, the other stages' ranks get groups "
                   "without lr, betas, eps and weight_decay", strict=True)
def test_optimizer_groups_load_into_every_pipeline_rank(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(workers.pp_save_many, 4, args=(root, ["pp_fsdp2"]), timeout=300)
    ranks = run_ranks(workers.pp_load_many, 4, args=(root, [("pp_fsdp2", "pp_fsdp2", False)]),
                      timeout=300)
    for rank in ranks:
        groups = rank["pp_fsdp2->pp_fsdp2"]["groups"]
        assert groups[0].get("lr") == 0.01 and groups[0].get("betas") == (0.9, 0.999)


@pytest.mark.xfail(reason="checkpoint.load's strict key check does not know of pipeline "
                   "stages yet: keys other stages own count as unexpected", strict=True)
def test_strict_load_into_a_pipeline(tmp_path: Path) -> None:
    root = str(tmp_path)
    saved = run_ranks(workers.pp_save_many, 1, args=(root, ["one_process"]), timeout=300)[0]
    got = run_ranks(workers.pp_load_many, 4, args=(root, [("one_process", "pp_fsdp2", True)]),
                    timeout=300)[0]
    assert_bitwise(saved["one_process"], got["one_process->pp_fsdp2"], "strict")


def test_load_safetensors_into_a_pipeline_reads_each_stages_own_tensors(tmp_path: Path
                                                                        ) -> None:
    directory = str(tmp_path / "hf")
    exported = run_ranks(workers.pp_export, 1, args=(directory, "one_process"),
                         timeout=300)[0]
    total = sum(v.numel() * v.element_size() for v in exported.values())
    for layout in ("pp_fsdp2", "pp_virtual_fsdp2"):
        ranks = run_ranks(workers.pp_load_safetensors, 4, args=(directory, layout, False),
                          timeout=300)
        assert_bitwise(exported, ranks[0][0], layout)
        if layout == "pp_virtual_fsdp2":
            # The loader's note holds its last part's report: the bytes of one of two.
            continue
        # Each rank reads its stage's tensors only, and of those its FSDP2 shard.
        assert sum(r[1] for r in ranks) == total, layout
        loaded = [set(r[2]) for r in ranks]
        assert loaded[0] == loaded[1] and loaded[2] == loaded[3], layout  # dp peers
        assert not loaded[0] & loaded[2], layout  # the two pp ranks: disjoint stages
        assert loaded[0] | loaded[2] == {k.removeprefix("model.") for k in exported}


@pytest.mark.xfail(reason="LoadSafetensors' strict check at materialize does not know of "
                   "pipeline stages yet: the other stages' tensors count as unexpected",
                   strict=True)
def test_strict_load_safetensors_into_a_pipeline(tmp_path: Path) -> None:
    directory = str(tmp_path / "hf")
    run_ranks(workers.pp_export, 1, args=(directory, "one_process"), timeout=300)
    run_ranks(workers.pp_load_safetensors, 4, args=(directory, "pp_fsdp2", True), timeout=300)


@pytest.mark.xfail(reason="export_safetensors plans its files from rank 0's keys: under a "
                   "pipeline those are stage 0's only", strict=True)
def test_export_safetensors_from_a_pipeline(tmp_path: Path) -> None:
    directory = str(tmp_path / "hf")
    exported = run_ranks(workers.pp_export, 4, args=(directory, "pp_fsdp2"), timeout=300)[0]
    ranks = run_ranks(workers.pp_load_safetensors, 1, args=(directory, "one_process"),
                      timeout=300)
    assert_bitwise(exported, ranks[0][0], "export from pp")
