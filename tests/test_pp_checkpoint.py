"""Checkpoints and weights with pipeline parallelism, on real gloo ranks.

A DCP checkpoint saved from PP x FSDP2 (one and two stages per rank) loads into FSDP2
without a pipeline and into one process, and one saved without a pipeline loads into
PP x FSDP2: every full tensor of model and optimizer (AdamW) state bitwise equal, and
every rank's optimizer keeps the saved hyperparameters (the checkpoint holds every
stage's parameter groups, not rank 0's alone).

Under a pipeline a rank's model holds its stages' keys only. The strict key checks count
the whole model: ``checkpoint.load`` calls a key unexpected only when no rank's model
has it, LoadSafetensors' check at materialize knows the other stages' tensors from the
plan's pipeline (``Pipeline.model_keys``), and both still refuse keys that no stage has
or lacks. LoadSafetensors into a pipeline reads on each rank only its stage's tensors
(its shard of them); ``export_safetensors`` from a pipeline writes every stage's tensors
into one directory, byte for byte the files one process writes.
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
    # With and without a pipeline every rank's optimizer keeps the saved hyperparameters.
    for rank in [*ranks, one]:
        for pair, got in rank.items():
            assert got["held"] and got["groups"][0]["lr"] == 0.01, pair
            assert got["groups"][0]["weight_decay"] == 0.1, pair
    for pair in ["pp_fsdp2->one_process", "pp_virtual_fsdp2->one_process",
                 "pp_fsdp2->fsdp2_4", "pp_virtual_fsdp2->fsdp2_4",
                 "one_process->pp_fsdp2", "pp_fsdp2->pp_virtual_fsdp2"]:
        assert_bitwise(saved[pair.split("->")[0]], loaded[pair], pair)


def test_strict_load_into_a_pipeline_refuses_keys_no_stage_has_or_lacks(tmp_path: Path
                                                                        ) -> None:
    """Checkpoints of a llama with 5 and with 3 blocks, strictly into llama4 cut in two
    stages: the fifth block's keys are in no stage; the fourth block's are missing from
    stage 1. Every rank raises, and only those keys are named."""
    root = str(tmp_path)
    run_ranks(workers.pp_save_depth, 1, args=(root, 5), timeout=300)
    run_ranks(workers.pp_save_depth, 1, args=(root, 3), timeout=300)
    ranks = run_ranks(workers.pp_load_many, 4, args=(root, [
        ("layers-5", "pp_fsdp2", True), ("layers-3", "pp_fsdp2", True)]), timeout=300)
    for rank, got in enumerate(ranks):
        deeper = got["layers-5->pp_fsdp2"]
        assert isinstance(deeper, str) and deeper.startswith("KeyMismatchError"), deeper
        assert "not in the model" in deeper and "layers.4." in deeper, deeper
        assert "missing" not in deeper and "layers.3." not in deeper, deeper
        shallower = got["layers-3->pp_fsdp2"]
        assert isinstance(shallower, str) and "layers.3." in shallower, shallower
        if rank >= 2:  # stage 1 (layers 2 and 3) lacks its last block
            assert shallower.startswith("KeyMismatchError") and "missing" in shallower
        else:  # its own keys are all there: it names the ranks that failed
            assert "rank 2:" in shallower and "rank 3:" in shallower, shallower


def test_optimizer_groups_load_into_every_pipeline_rank(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(workers.pp_save_many, 4, args=(root, ["pp_fsdp2"]), timeout=300)
    ranks = run_ranks(workers.pp_load_many, 4, args=(root, [("pp_fsdp2", "pp_fsdp2", False)]),
                      timeout=300)
    for rank in ranks:
        groups = rank["pp_fsdp2->pp_fsdp2"]["groups"]
        assert groups[0].get("lr") == 0.01 and groups[0].get("betas") == (0.9, 0.999)


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


def test_strict_load_safetensors_into_a_pipeline(tmp_path: Path) -> None:
    directory = str(tmp_path / "hf")
    exported = run_ranks(workers.pp_export, 1, args=(directory, "one_process"),
                         timeout=300)[0]
    ranks = run_ranks(workers.pp_load_safetensors, 4, args=(directory, "pp_fsdp2", True),
                      timeout=300)
    assert_bitwise(exported, ranks[0][0], "strict")
    # Two parts per rank, each checked on its own; and not strict: a part's report lists
    # no other stage's tensor as unexpected.
    for layout, strict in (("pp_virtual_fsdp2", True), ("pp_fsdp2", False)):
        reports = run_ranks(workers.pp_safetensors_report, 4,
                            args=(directory, layout, strict), timeout=300)
        for unexpected, missing, loaded in reports:
            assert unexpected == () and missing == () and loaded > 0, (layout, unexpected)


def _tensors_in_file_order(path: Path) -> list[str]:
    import json
    import struct

    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def test_export_safetensors_from_a_pipeline(tmp_path: Path) -> None:
    """Every stage's tensors in one Hugging Face-layout directory: it loads into one
    process bitwise, and its bytes are those one process exports (same weights, the
    whole model's order), with one and with two stages per rank."""
    run_ranks(workers.pp_export, 1, args=(str(tmp_path / "one"), "one_process"), timeout=300)
    alone = (tmp_path / "one" / "model.safetensors").read_bytes()
    for layout in ("pp_fsdp2", "pp_virtual_fsdp2"):
        directory = tmp_path / layout
        exported = run_ranks(workers.pp_export, 4, args=(str(directory), layout),
                             timeout=300)[0]
        assert sorted(p.name for p in directory.iterdir()) == ["model.safetensors"], layout
        ranks = run_ranks(workers.pp_load_safetensors, 1, args=(str(directory), "one_process"),
                          timeout=300)
        assert_bitwise(exported, ranks[0][0], f"export from {layout}")
        written = directory / "model.safetensors"
        assert _tensors_in_file_order(written) == _tensors_in_file_order(
            tmp_path / "one" / "model.safetensors"), layout
        assert written.read_bytes() == alone, layout
