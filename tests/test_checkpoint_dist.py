"""Checkpoints on real gloo ranks: resharding across layouts and world sizes, resume
parity, crash safety during a save, and Hugging Face safetensors in and out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_par import checkpoint as ck
from composer_par.checkpoint import safetensors_io as sio
from composer_par.checkpoint.sources import WeightsSource
from composer_par.testing.distributed import RankFailure, run_ranks
from composer_par.testing.parity import assert_every_rank
from tests import checkpoint_io_workers as workers
from tests.test_checkpoint_io import HF_RENAME, reference, state

pytestmark = pytest.mark.distributed

# Layouts by world size (each group is run in one multi-rank call to bound the runtime).
BY_WORLD: dict[int, list[str]] = {}
for _name, (_world, _, _) in workers.LAYOUTS.items():
    BY_WORLD.setdefault(_world, []).append(_name)


def assert_bitwise(expected: dict[str, Any], got: dict[str, Any], what: str) -> None:
    assert expected.keys() == got.keys(), f"{what}: keys differ: {set(expected) ^ set(got)}"
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            other = got[key]
            assert value.dtype == other.dtype and value.shape == other.shape, (what, key)
            assert torch.equal(value, other), f"{what}: {key} differs"
        else:
            assert value == got[key], (what, key, value, got[key])


def assert_every_rank_bitwise(expected: dict[str, Any], views: list[dict[str, Any]],
                              what: str) -> None:
    """Each rank's view (a replicated tensor is that rank's own copy) bitwise ``expected``."""
    assert_every_rank(views, lambda got: assert_bitwise(expected, got, what))


def agreed(views: list[dict[str, Any]], what: str) -> dict[str, Any]:
    """The state every rank holds: each rank's view bitwise rank 0's."""
    assert_every_rank_bitwise(views[0], views, f"{what}: the ranks' views")
    return views[0]


@pytest.mark.timeout(900)
def test_resharding_grid_every_layout_into_every_other(tmp_path: Path) -> None:
    """Save with FSDP2 4, HSDP 2x2, FSDP2xTP 2x2, TP 2 and one process; load each into
    each of the others: every full tensor of model and optimizer state bitwise equal, in
    every rank's view on both sides (the ranks that saved agree; each rank that loaded
    holds it, its copies of replicated tensors included)."""
    saved: dict[str, Any] = {}
    for world, layouts in BY_WORLD.items():
        views = run_ranks(workers.save_layouts, world, args=(layouts, str(tmp_path)),
                          timeout=400)
        saved.update({layout: agreed([v[layout] for v in views], f"saved {layout}")
                      for layout in layouts})
    for world, layouts in BY_WORLD.items():
        pairs = [(s, layout) for s in saved for layout in layouts if s != layout]
        loaded = run_ranks(workers.load_layouts, world, args=(pairs, str(tmp_path)),
                           timeout=600)
        for (source, layout) in pairs:
            views = [dict(rank[f"{source}->{layout}"]) for rank in loaded]
            for got in views:
                assert got.pop("info.extra") == {"layout": source}
                assert got.pop("info.step") == 2
            assert_every_rank_bitwise(saved[source], views, f"{source} -> {layout}")
    # The plan it was saved with is in the checkpoint (inspect shows it).
    info = ck.describe(tmp_path / "hsdp_2x2")
    assert info["kind"] == "root" and 'name = "hsdp"' in info["checkpoint"]["plan"]
    assert info["checkpoint"]["world_size"] == 4
    # The model part loads with the LoadCheckpoint plugin too, resharded to TP 2.
    views = run_ranks(workers.load_checkpoint_plugin, 2,
                      args=(str(tmp_path / "fsdp2_tp_2x2"), "tp_2"), timeout=300)
    assert_every_rank_bitwise(
        {k: v for k, v in saved["fsdp2_tp_2x2"].items() if k.startswith("model.")},
        views, "LoadCheckpoint fsdp2_tp_2x2 -> tp_2")


@pytest.mark.timeout(400)
def test_resume_parity_two_steps_save_load_one_step_equals_three(tmp_path: Path) -> None:
    uninterrupted = run_ranks(workers.train_save_continue, 4,
                              args=(str(tmp_path), "fsdp2_4"), timeout=300)
    resumed = run_ranks(workers.load_continue, 4, args=(str(tmp_path), "fsdp2_4"), timeout=300)
    assert_bitwise(uninterrupted[0]["state"], resumed[0]["state"], "3 steps vs 2+load+1")
    assert resumed[0]["step"] == 2 and all(r["rng_restored"] for r in resumed)
    for rank, (a, b) in enumerate(zip(uninterrupted, resumed, strict=True)):
        # Every rank's torch RNG and data-order generator continue where they were saved.
        assert torch.equal(a["draws"]["torch"], b["draws"]["torch"]), rank
        assert torch.equal(a["draws"]["data"], b["draws"]["data"]), rank
    assert not torch.equal(uninterrupted[0]["draws"]["torch"], uninterrupted[1]["draws"]["torch"])


@pytest.mark.timeout(400)
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as err:
        run_ranks(workers.save_then_die, 4, args=(str(tmp_path), 2), timeout=200)
    assert "rank 2/4: killed by signal SIGKILL" in str(err.value)
    partial = tmp_path / "step-000000002"
    assert partial.is_dir() and not ck.is_committed(partial)
    assert ck.latest(tmp_path) == tmp_path / "step-000000001"
    assert ck.describe(partial)["commit"].startswith("uncommitted")
    with pytest.raises(ck.UncommittedError, match="step-000000002: uncommitted"):
        ck.load(partial, reference())
    expected = run_ranks(workers.save_one, 4, args=(str(tmp_path / "again"), "fsdp2_4", 1),
                         timeout=300)[0]
    got = run_ranks(workers.load_latest, 4, args=(str(tmp_path), "fsdp2_4"), timeout=300)[0]
    assert got.pop("info.step") == 1
    assert got.pop("info.latest") == str(tmp_path / "step-000000001")
    # The same training from the same seed: the checkpoint of step 1 is intact.
    assert_bitwise(expected, got, "step 1 after the crash")


def _write_hf(directory: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The reference Llama under Hugging Face names, split in 3 files plus an index, and a
    stray file the index does not name. Returns the reference state (model names)."""
    ref = state(reference(seed=21))
    renamed = {ck.Rename(HF_RENAME).to_file(k): v.to(dtype) for k, v in ref.items()}
    keys = list(renamed)
    weight_map = {}
    directory.mkdir(parents=True)
    for i in range(3):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        sio.save_file({k: renamed[k] for k in keys[i::3]}, directory / name)
        weight_map.update(dict.fromkeys(keys[i::3], name))
    (directory / sio.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sio.save_file({"model.embed_tokens.weight": torch.zeros(1)}, directory / "stale.safetensors")
    return ref


@pytest.mark.timeout(600)
def test_hugging_face_weights_load_into_fsdp2_tp_and_both_then_export(tmp_path: Path) -> None:
    ref = _write_hf(tmp_path / "hf")
    expected = {f"model.{k}": v for k, v in ref.items()}
    reference_buffers = dict(reference().named_buffers())
    results: dict[str, list[dict[str, Any]]] = {}  # layout -> every rank's view
    for world, layouts in ((4, ["fsdp2_4", "fsdp2_tp_2x2"]), (2, ["tp_2"])):
        views = run_ranks(workers.load_hf, world, args=(
            str(tmp_path / "hf" / sio.INDEX_NAME), layouts, str(tmp_path / "out"),
            HF_RENAME), timeout=400)
        for layout in layouts:
            results[layout] = [v[layout] for v in views]
            results[f"{layout}.buffers"] = [v[f"{layout}.buffers"] for v in views]
    for layout in ("fsdp2_4", "fsdp2_tp_2x2", "tp_2"):
        assert_every_rank_bitwise(expected, results[layout], f"HF -> {layout}")
        for rank, buffers in enumerate(results[f"{layout}.buffers"]):
            for name, buffer in reference_buffers.items():
                assert torch.equal(buffers[name], buffer), (layout, rank, name)
        # Exported from the sharded model (Hugging Face names, several files plus index):
        # equal to the original files, read back by safetensors itself.
        out = tmp_path / "out" / layout
        index = json.loads((out / sio.INDEX_NAME).read_text())
        assert len(set(index["weight_map"].values())) > 1
        from safetensors.torch import load_file

        reread: dict[str, torch.Tensor] = {}
        for file in sorted(set(index["weight_map"].values())):
            reread.update(load_file(out / file))
        original = {k: sio.read_tensor(e)
                    for k, e in WeightsSource.open(tmp_path / "hf").entries.items()}
        assert_bitwise(original, reread, f"export of {layout}")


@pytest.mark.timeout(300)
def test_bf16_export_from_a_sharded_model(tmp_path: Path) -> None:
    views = run_ranks(workers.export_one, 4, args=("fsdp2_tp_2x2", str(tmp_path / "out"),
                                                  "bfloat16"), timeout=200)
    from safetensors.torch import load_file

    got = load_file(tmp_path / "out" / "model.safetensors")
    # The file holds one copy of each tensor: every rank's view is that copy.
    assert_every_rank(views, lambda full: assert_bitwise(
        {k.removeprefix("model."): v.to(torch.bfloat16) for k, v in full.items()}, got,
        "bf16 export"))
