"""``import`` of DeepSpeed's AutoTP for training (``"tensor_parallel": {"autotp_size": N}``
beside ZeRO 0 to 2, as DeepSpeed's AutoTP training tutorial writes it): a tp dim of N with
the tp plugin, data parallelism over the other ranks; AutoTP's own layer rules and its
communication overlap are named, not dropped. The imported plan trains at parity with
one process on 4 gloo ranks (dp_shard 2 x tp 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from composer_par.migrate import ImportFailed, import_config

DATA = Path(__file__).parent / "data" / "migrate"
META_INIT = '\n[[plugins]]\nname = "meta_init"\nseed = 7\n'


def _config(tmp_path: Path, section: Any, base: str = "ds_zero2.json") -> Path:
    config = json.loads((DATA / base).read_text())
    config["tensor_parallel"] = section
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return path


def test_autotp_size_is_a_tp_dim_with_the_tp_plugin(tmp_path: Path) -> None:
    result = import_config(_config(tmp_path, {"autotp_size": 2}), world_size=8)
    plan = result.plan()
    assert dict(plan.mesh.dims) == {"dp_shard": -1, "tp": 2}
    assert {p.name for p in plan.plugins} >= {"fsdp2", "tp"}
    found = {m.key: m for m in result.mapped}
    assert found["tensor_parallel.autotp_size"].plan == ("[mesh] tp = 2", "[[plugins]] tp")
    assert found["tensor_parallel.autotp_size"].code is None
    assert "CP908" not in result.report.codes() and result.report.ok


def test_zero_stage_0_with_autotp_replicates_over_the_other_ranks(tmp_path: Path) -> None:
    config = json.loads((DATA / "ds_zero2.json").read_text())
    config["zero_optimization"] = {"stage": 0}
    config["tensor_parallel"] = {"autotp_size": 4}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    plan = import_config(path, world_size=8).plan()
    assert dict(plan.mesh.dims) == {"dp_replicate": -1, "tp": 4}


@pytest.mark.parametrize("size", [0, 1])
def test_autotp_off_adds_nothing(tmp_path: Path, size: int) -> None:
    result = import_config(_config(tmp_path, {"autotp_size": size}))
    assert "tp" not in dict(result.plan().mesh.dims)
    assert "tensor_parallel.autotp_size" in {m.key for m in result.mapped}


def test_autotp_rules_and_overlap_are_named(tmp_path: Path) -> None:
    section = {"autotp_size": 2, "preset_model": "llama", "tp_overlap_comm": True,
               "dtype": "bfloat16", "tp_grain": 64}
    result = import_config(_config(tmp_path, section), world_size=4)
    codes = {m.key: m.code for m in result.mapped}
    assert codes["tensor_parallel.preset_model"] == "CP918"
    assert codes["tensor_parallel.tp_overlap_comm"] == "CP908"
    assert codes["tensor_parallel.dtype"] == "CP908"
    assert codes["tensor_parallel.tp_grain"] is not None  # unknown: said, not dropped
    assert dict(result.plan().mesh.dims)["tp"] == 2


@pytest.mark.parametrize("section", [{"autotp_size": -1}, {"autotp_size": "2"}, 2])
def test_a_bad_autotp_section_is_refused(tmp_path: Path, section: Any) -> None:
    with pytest.raises(ImportFailed) as raised:
        import_config(_config(tmp_path, section))
    assert "CP902" in raised.value.report.codes()
    assert "tensor_parallel" in raised.value.report.format()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_imported_autotp_plan_trains_at_parity(tmp_path: Path) -> None:
    from composer_par.testing.parity import ParityCase
    from tests.composition_workers import check_cases

    result = import_config(_config(tmp_path, {"autotp_size": 2}), world_size=4)
    assert result.report.ok, result.report.format()
    case = ParityCase("composer_par.testing.tasks:llama", result.toml + META_INIT, 4, steps=4)
    [outcome] = check_cases([case], timeout=280)
    outcome.assert_close()
