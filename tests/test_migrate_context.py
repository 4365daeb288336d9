"""``import`` of what real configs ask for: accelerate's parallelism_config with context
parallelism (cp_size) and DeepSpeed-Ulysses (sp_size), written by accelerate's own config
code (``ClusterConfig.to_yaml_file``, what ``accelerate config`` calls) on TRL's own shipped
configs; DeepSpeed's ``sequence_parallel_size``; transformers' ``DistributedConfig``
(written by its own ``to_json_file``). Every key of each source is listed by ``--json``
and ``--explain``, and the plans train at parity with one process on gloo ranks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from composer_par.cli.main import main
from composer_par.migrate import (
    ImportFailed,
    ImportResult,
    import_config,
    import_distributed_config,
)
from composer_par.plan import ParallelPlan

DATA = Path(__file__).parent / "data" / "migrate"
META_INIT = '\n[[plugins]]\nname = "meta_init"\nseed = 7\n'
SECTIONS = ("fsdp_config", "deepspeed_config", "parallelism_config", "dynamo_config")


def accelerate_yaml(path: Path, base: Mapping[str, Any] | None = None, **fields: Any) -> Path:
    """An accelerate config written by accelerate itself: ``ClusterConfig`` (the object
    ``accelerate config`` fills) and its ``to_yaml_file``; ``base`` another config's
    fields (TRL's shipped ones) that ``fields`` override."""
    from accelerate.commands.config.config_args import ClusterConfig

    data: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
                            "mixed_precision": "no", "use_cpu": True, "debug": False,
                            "num_processes": 2}
    data.update(base or {})
    data.update(fields)
    ClusterConfig(**data).to_yaml_file(str(path))
    return path


def trl_config(name: str) -> dict[str, Any]:
    """One of the accelerate configs TRL ships, found as ``trl --accelerate_config NAME``
    finds it, read by accelerate's own reader."""
    pytest.importorskip("trl")
    from accelerate.commands.config.config_args import load_config_from_file
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    flag, path = resolve_accelerate_config_argument(["--accelerate_config", name])[:2]
    assert flag == "--config_file"
    config = load_config_from_file(str(path)).to_dict()
    # What a person training on 2 CPU processes (and in fp32, to compare) changes.
    return {**config, "num_processes": 2, "mixed_precision": "no", "use_cpu": True}


def _trl_or_plain(name: str) -> dict[str, Any]:
    """TRL's shipped config ``name`` where TRL is installed, else accelerate's own fields
    for the same (FSDP2, or ZeRO-3), so the parity test runs either way."""
    try:
        import trl  # noqa: F401
    except ImportError:
        if name == "fsdp2":
            return {"fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True}}
        return {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}
    return trl_config(name)


def parallelism(**sizes: Any) -> dict[str, Any]:
    """A parallelism_config section as accelerate's questionnaire writes it."""
    return {f"parallelism_config_{k}": v for k, v in sizes.items()}


def source_keys(config: Mapping[str, Any]) -> set[str]:
    """Every key of an accelerate config, a section's keys as ``section.key``."""
    keys = set()
    for key, value in config.items():
        if key in SECTIONS and isinstance(value, Mapping) and value:
            keys |= {f"{key}.{k}" for k in value}
        else:
            keys.add(key)
    return keys


def listed(result: ImportResult, capsys: pytest.CaptureFixture[str], path: Path) -> set[str]:
    """The keys ``--json`` lists, after checking ``--explain`` lists the same."""
    assert main(["import", str(path), "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    keys = {m["key"] for m in data["mapped"]}
    assert main(["import", str(path), "--explain"]) in (0, 1)
    explained = capsys.readouterr().out
    assert all(f"{k} = " in explained for k in keys)
    assert keys == {m.key for m in result.mapped}
    return keys


# -- accelerate and TRL --------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["allgather", "alltoall"])
def test_accelerate_context_parallelism_is_the_cp_plugin(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], strategy: str) -> None:
    config = {"fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True},
              "parallelism_config": parallelism(dp_replicate_size=1, dp_shard_size=2,
                                                tp_size=1, cp_size=2,
                                                cp_comm_strategy=strategy)}
    path = accelerate_yaml(tmp_path / "cp.yaml", **config, num_processes=4)
    result = import_config(path)
    plan = result.plan()
    assert dict(plan.mesh.dims) == {"dp_shard": 2, "cp": 2}
    assert plan.plugin("cp").mode == strategy  # type: ignore[union-attr]
    assert "CP908" not in result.report.codes()
    assert ("CP915" in result.report.codes()) == (strategy == "alltoall")
    assert result.report.ok, result.report.format()
    # the sizes at 1 are listed too, not dropped
    assert source_keys(json.loads(json.dumps(config))) | {"compute_environment",
                                                         "distributed_type"} <= listed(
        result, capsys, path)


def test_every_key_of_trls_configs_is_listed(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("fsdp1", "fsdp2", "zero1", "zero2", "zero3", "multi_gpu", "single_gpu"):
        config = trl_config(name)
        path = accelerate_yaml(tmp_path / f"{name}.yaml", config)
        written = _yaml(path)
        result = import_config(path)
        missing = source_keys(written) - listed(result, capsys, path)
        assert not missing, (name, missing)


def test_trl_zero3_with_ulysses_is_cp_alltoall(tmp_path: Path) -> None:
    config = trl_config("zero3")
    path = accelerate_yaml(tmp_path / "ulysses.yaml", config, parallelism_config=parallelism(
        sp_size=2, sp_backend="deepspeed", sp_seq_length_is_variable=True,
        sp_attn_implementation="sdpa"))
    result = import_config(path)
    plan = result.plan()
    assert dict(plan.mesh.dims) == {"dp_shard": -1, "cp": 2}
    assert plan.plugin("cp").mode == "alltoall"  # type: ignore[union-attr]
    keys = {m.key for m in result.mapped}
    assert {"deepspeed_config.offload_optimizer_device", "deepspeed_config.offload_param_device",
            "parallelism_config.parallelism_config_sp_attn_implementation"} <= keys


def test_deepspeed_sequence_parallel_size_is_cp_alltoall(tmp_path: Path) -> None:
    config = json.loads((DATA / "ds_zero3.json").read_text())
    config["sequence_parallel_size"] = 2
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    result = import_config(path)
    plan = result.plan()
    assert dict(plan.mesh.dims)["cp"] == 2 and plan.plugin("cp").mode == "alltoall"  # type: ignore[union-attr]
    assert "CP908" not in result.report.codes()


def test_sections_the_distributed_type_does_not_read_are_listed(tmp_path: Path) -> None:
    path = accelerate_yaml(tmp_path / "ddp.yaml", distributed_type="MULTI_GPU",
                           fsdp_config={"fsdp_version": 2})
    result = import_config(path)
    found = {m.key: m.code for m in result.mapped}
    assert found["fsdp_config.fsdp_version"] == "CP917"
    path.write_text(path.read_text() + "megatron_lm_config: {}\n")  # an empty section
    assert "megatron_lm_config" in {m.key for m in import_config(path).mapped}
    assert "fsdp2" not in {p.name for p in result.plan().plugins}


def test_auto_values_say_where_they_go() -> None:
    result = import_config(DATA / "ds_zero3.json")
    fixes = [f.fix or "" for f in result.report.findings if f.code == "CP914"]
    assert fixes and all("in the plan" not in fix for fix in fixes), fixes
    assert any("per_device_train_batch_size" in fix or "mixed_precision" in fix
               for fix in fixes), fixes


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


# -- transformers' DistributedConfig -------------------------------------------------------


def _distributed(**fields: Any) -> Any:
    from transformers.distributed.configuration_utils import DistributedConfig

    return DistributedConfig(**fields)


@pytest.mark.parametrize(("fields", "mesh", "plugins"), [
    ({"fsdp_size": 4}, {"dp_shard": 4}, {"fsdp2"}),
    ({"fsdp_size": 4, "dp_replicate_size": 2}, {"dp_replicate": 2, "dp_shard": 4},
     {"hsdp", "fsdp2"}),
    ({"tp_size": 2, "tp_plan": "auto"}, {"tp": 2}, {"tp"}),
    ({"fsdp_size": 4, "ep_size": 2}, {"dp_shard": 2, "ep": 2}, {"fsdp2", "ep"}),
    ({"tp_size": 2, "pp_size": 2}, {"pp": 2, "tp": 2}, {"pp", "tp"}),
])
def test_distributed_config_becomes_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           fields: dict[str, Any], mesh: dict[str, int],
                                           plugins: set[str]) -> None:
    config = _distributed(**fields)
    result = import_distributed_config(config)
    plan = result.plan()
    assert dict(plan.mesh.dims) == mesh and {p.name for p in plan.plugins} == plugins
    assert {m.key for m in result.mapped} == set(config.to_dict())
    # the same from its own JSON file, told by its keys
    path = tmp_path / "distributed_config.json"
    config.to_json_file(str(path))
    assert import_config(path).toml == result.toml
    assert set(config.to_dict()) <= listed(import_config(path), capsys, path)


def test_distributed_config_fsdp_settings_and_overrides() -> None:
    result = import_distributed_config(_distributed(
        fsdp_size=2, fsdp_cpu_offload=True, fsdp_mixed_precision=True,
        fsdp_plan={"model.layers.*": "free_full_weight", "lm_head": "keep_full_weight"}))
    fsdp2 = result.plan().plugin("fsdp2")
    assert fsdp2.offload == "cpu"  # type: ignore[union-attr]
    assert str(fsdp2.mixed_precision.param_dtype).endswith("bfloat16")  # type: ignore[union-attr]
    assert fsdp2.reshard_units == {"model.layers.*": True, "lm_head": False}  # type: ignore[union-attr]
    overridden = import_distributed_config(_distributed(tp_size=2, tp_plan={"lm_head": "colwise"}))
    assert "CP918" in overridden.report.codes()


def test_a_model_config_with_and_without_a_distributed_config(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    model = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                        num_attention_heads=4)
    model.save_pretrained(str(tmp_path))
    with pytest.raises(ImportFailed, match="save_pretrained leaves distributed_config out"):
        import_config(tmp_path / "config.json", kind="transformers")
    data = json.loads((tmp_path / "config.json").read_text())
    data["distributed_config"] = _distributed(fsdp_size=2).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert dict(import_config(tmp_path / "config.json").plan().mesh.dims) == {"dp_shard": 2}


# -- training at parity --------------------------------------------------------------------


def _check(cases: list[Any]) -> None:
    from tests.composition_workers import check_cases

    for case, result in zip(cases, check_cases(cases, timeout=280), strict=True):
        try:
            result.assert_close()
        except AssertionError as exc:
            raise AssertionError(f"{case.task} {case.plan!r}: {exc}") from None


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_imported_context_parallel_plans_train_at_parity(tmp_path: Path) -> None:
    """accelerate's cp (both strategies, on TRL's fsdp2 config), accelerate's Ulysses on
    TRL's zero3 config, and DeepSpeed's sequence_parallel_size: 2 gloo ranks, 4 steps,
    at parity with one process (every rank's parameters)."""
    from composer_par.testing.parity import ParityCase

    sources = []
    fsdp2, zero3 = _trl_or_plain("fsdp2"), _trl_or_plain("zero3")
    for strategy in ("allgather", "alltoall"):
        sources.append(accelerate_yaml(
            tmp_path / f"cp-{strategy}.yaml", fsdp2,
            parallelism_config=parallelism(dp_shard_size=1, cp_size=2,
                                           cp_comm_strategy=strategy)))
    sources.append(accelerate_yaml(
        tmp_path / "ulysses.yaml", zero3,
        parallelism_config=parallelism(sp_size=2, sp_backend="deepspeed")))
    ds = json.loads((DATA / "ds_zero2.json").read_text())
    ds["sequence_parallel_size"] = 2
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    sources.append(tmp_path / "ds.json")
    cases = []
    for source in sources:
        result = import_config(source, world_size=2)
        assert result.report.ok, (source, result.report.format())
        plan = ParallelPlan.from_toml(result.toml)
        assert dict(plan.mesh.dims)["cp"] == 2, source
        cases.append(ParityCase("tests.cp_workers:llama", result.toml + META_INIT, 2,
                                steps=4))
    _check(cases)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_imported_distributed_config_trains_at_parity(tmp_path: Path) -> None:
    from composer_par.testing.parity import ParityCase

    path = tmp_path / "distributed_config.json"
    _distributed(fsdp_size=2).to_json_file(str(path))
    result = import_config(path)
    assert result.report.ok, result.report.format()
    _check([ParityCase("composer_par.testing.tasks:llama", result.toml + META_INIT, 2,
                       optimizer="adamw", lr=0.01, reference="accumulate")])
