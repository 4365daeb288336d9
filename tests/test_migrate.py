"""composer-par import: accelerate configs as ``accelerate config`` writes them, the
DeepSpeed examples of the Hugging Face docs, and the Trainer's --fsdp values become plans
that validate, with a finding (CP9xx) for every setting with no equal."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from composer_par.cli.main import main
from composer_par.findings import CORE_RULES, Severity
from composer_par.migrate import ImportFailed, ImportResult, import_config, import_trainer_args
from composer_par.plan import ParallelPlan

DATA = Path(__file__).parent / "data" / "migrate"


def plugins(result: ImportResult) -> dict[str, dict[str, Any]]:
    """The written plan's plugins and options, read back through the plan-file reader."""
    plan = ParallelPlan.from_toml(result.toml)
    return {p.name: p.options() for p in plan.plugins}


def mesh(result: ImportResult) -> dict[str, int]:
    return dict(ParallelPlan.from_toml(result.toml).mesh.dims)


def codes(result: ImportResult) -> set[str]:
    return set(result.report.codes())


def validates(result: ImportResult, world_size: int) -> None:
    report = ParallelPlan.from_toml(result.toml).validate(world_size=world_size)
    assert report.ok, report.format()


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# -- accelerate ------------------------------------------------------------------------------


def test_accelerate_fsdp1_full_shard() -> None:
    result = import_config(DATA / "accelerate_fsdp1.yaml")
    assert mesh(result) == {"dp_shard": -1}
    assert plugins(result) == {"fsdp2": {
        "reshard_after_forward": True, "blocks": ["LlamaDecoderLayer"],
        "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32",
                            "cast_forward_inputs": True}}}
    validates(result, 8)
    assert result.world_size == 8
    # use_orig_params, sync_module_states, prefetch: FSDP2 does without; RAM-efficient
    # loading: no equal; state dict type: composer_par's own; launch keys.
    assert codes(result) == {"CP903", "CP909", "CP910", "CP911"}
    cp910 = next(f for f in result.report.findings if f.code == "CP910")
    assert cp910.severity is Severity.WARNING
    assert "fsdp_cpu_ram_efficient_loading = true" in cp910.message
    assert "load_safetensors" in cp910.fix


def test_accelerate_fsdp1_hybrid_zero2_on_two_nodes() -> None:
    result = import_config(DATA / "accelerate_fsdp1_hybrid.yaml")
    assert mesh(result) == {"dp_replicate": 2, "dp_shard": -1}
    found = plugins(result)
    assert list(found) == ["hsdp", "fsdp2", "activation_checkpoint"]
    assert found["fsdp2"]["reshard_after_forward"] is False
    assert found["fsdp2"]["offload"] == "cpu"
    validates(result, 16)
    # reshard_after_forward=false under HSDP: the plan's own warning, validated.
    assert "CP216" in codes(result)


@pytest.mark.parametrize(("strategy", "expected_mesh", "expected"), [
    ("FULL_SHARD", {"dp_shard": -1}, {"fsdp2": {"reshard_after_forward": True}}),
    ("SHARD_GRAD_OP", {"dp_shard": -1}, {"fsdp2": {"reshard_after_forward": False}}),
    ("NO_SHARD", {"dp_replicate": -1}, {"hsdp": {}}),
    ("HYBRID_SHARD", {"dp_replicate": 1, "dp_shard": -1},
     {"hsdp": {}, "fsdp2": {"reshard_after_forward": True}}),
    ("_HYBRID_SHARD_ZERO2", {"dp_replicate": 1, "dp_shard": -1},
     {"hsdp": {}, "fsdp2": {"reshard_after_forward": False}}),
    (1, {"dp_shard": -1}, {"fsdp2": {"reshard_after_forward": True}}),  # older accelerate
])
def test_fsdp1_strategies(tmp_path: Path, strategy: Any, expected_mesh: dict[str, int],
                          expected: dict[str, Any]) -> None:
    config = write(tmp_path, "c.yaml", "distributed_type: FSDP\nnum_machines: 1\n"
                   f"fsdp_config:\n  fsdp_version: 1\n  fsdp_sharding_strategy: {strategy}\n")
    result = import_config(config)
    assert mesh(result) == expected_mesh
    assert plugins(result) == expected
    validates(result, 4)


def test_accelerate_fsdp2_with_parallelism_config() -> None:
    result = import_config(DATA / "accelerate_fsdp2_parallelism.yaml")
    assert mesh(result) == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert list(plugins(result)) == ["hsdp", "fsdp2", "tp"]
    validates(result, 8)
    assert codes(result) == {"CP909", "CP911"}


def test_accelerate_fsdp2_default_config() -> None:
    result = import_config(DATA / "accelerate_fsdp2.yaml")
    assert mesh(result) == {"dp_shard": -1}
    assert plugins(result)["fsdp2"]["reshard_after_forward"] is True
    validates(result, 8)


def test_accelerate_deepspeed_keys() -> None:
    result = import_config(DATA / "accelerate_deepspeed.yaml")
    assert plugins(result)["fsdp2"]["reshard_after_forward"] is False  # zero_stage: 2
    keys = {m.key: m for m in result.mapped}
    assert keys["deepspeed_config.zero_stage"].plan == (
        "[mesh] dp_shard = -1", "[[plugins]] fsdp2: reshard_after_forward = false")
    assert keys["deepspeed_config.gradient_clipping"].code == "CP909"
    validates(result, 8)


def test_every_key_is_mapped_or_found() -> None:
    import yaml

    path = DATA / "accelerate_fsdp1.yaml"
    config = yaml.safe_load(path.read_text())
    result = import_config(path)
    keys = {m.key for m in result.mapped}
    expected = {k for k in config if k not in ("fsdp_config",)}
    expected |= {f"fsdp_config.{k}" for k in config["fsdp_config"]}
    assert keys == expected
    for m in result.mapped:
        if m.code is not None:
            assert m.code in codes(result), m


def test_unknown_key_gets_did_you_mean(tmp_path: Path) -> None:
    config = write(tmp_path, "c.yaml", "distributed_type: FSDP\nfsdp_config:\n"
                   "  fsdp_version: 2\n  fsdp_ofload_params: true\n")
    result = import_config(config)
    finding = next(f for f in result.report.findings if f.code == "CP912")
    assert "did you mean 'fsdp_offload_params'" in finding.message
    assert finding.severity is Severity.WARNING


def test_size_based_wrap_and_context_parallelism(tmp_path: Path) -> None:
    config = write(tmp_path, "c.yaml", "distributed_type: FSDP\nfsdp_config:\n"
                   "  fsdp_version: 2\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n"
                   "  fsdp_min_num_params: 100000000\nparallelism_config:\n"
                   "  parallelism_config_dp_shard_size: 2\n  parallelism_config_cp_size: 2\n")
    result = import_config(config)
    assert "CP905" in codes(result) and "CP908" not in codes(result)
    # context parallelism is the cp plugin's: the plan keeps what the config is for
    assert mesh(result) == {"dp_shard": 2, "cp": 2}
    assert result.plan().plugin("cp").mode == "allgather"  # type: ignore[union-attr]
    validates(result, 4)


def test_fp16_and_compile(tmp_path: Path) -> None:
    config = write(tmp_path, "c.yaml", "distributed_type: FSDP\nmixed_precision: fp16\n"
                   "fsdp_config:\n  fsdp_version: 2\ndynamo_config:\n"
                   "  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n")
    result = import_config(config)
    found = plugins(result)
    assert found["fsdp2"]["mixed_precision"]["param_dtype"] == "float16"
    assert found["compile"] == {"mode": "max-autotune"}
    cp907 = next(f for f in result.report.findings if f.code == "CP907")
    assert "ShardedGradScaler" in cp907.fix


# -- DeepSpeed ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected_mesh", "expected", "expected_codes"), [
    ("ds_zero0.json", {"dp_replicate": -1}, {"hsdp": {}}, {"CP914"}),
    ("ds_zero1.json", {"dp_shard": -1}, {"fsdp2": {"reshard_after_forward": False}},
     {"CP908"}),
    ("ds_zero2.json", {"dp_shard": -1},
     {"fsdp2": {"reshard_after_forward": False, "offload": "cpu"}},
     {"CP903", "CP904", "CP906", "CP909", "CP914"}),
    ("ds_zero3.json", {"dp_shard": -1},
     {"fsdp2": {"reshard_after_forward": True, "offload": "cpu"}},
     {"CP903", "CP904", "CP906", "CP909", "CP911", "CP914"}),
])
def test_deepspeed_stages(name: str, expected_mesh: dict[str, int], expected: dict[str, Any],
                          expected_codes: set[str]) -> None:
    result = import_config(DATA / name)
    assert result.tool == "deepspeed"
    assert mesh(result) == expected_mesh
    assert plugins(result) == expected
    assert codes(result) == expected_codes
    validates(result, 4)


def test_deepspeed_auto_values_are_left_to_the_trainer() -> None:
    result = import_config(DATA / "ds_zero3.json")
    auto = [f for f in result.report.findings if f.code == "CP914"]
    assert {f.message.partition(" = ")[0] for f in auto} >= {
        "bf16", "fp16", "gradient_accumulation_steps", "train_batch_size"}
    assert all(f.severity is Severity.INFO for f in auto)


def test_deepspeed_hpz_nvme_and_zeropp() -> None:
    result = import_config(DATA / "ds_zero3_nvme_hpz.json")
    found = plugins(result)["fsdp2"]
    assert found["reshard_after_forward"] == 8  # hpZ: a second shard over 8 ranks
    assert found["mixed_precision"]["param_dtype"] == "bfloat16"
    nvme = next(f for f in result.report.findings if f.code == "CP906")
    assert "NVMe" in nvme.message
    assert sum(f.code == "CP908" for f in result.report.findings) == 2  # qwZ, qgZ
    validates(result, 16)


def test_deepspeed_mics_is_hsdp(tmp_path: Path) -> None:
    path = write(tmp_path, "ds.json", json.dumps(
        {"zero_optimization": {"stage": 3, "mics_shard_size": 4}}))
    result = import_config(path)
    assert mesh(result) == {"dp_replicate": -1, "dp_shard": 4}
    assert list(plugins(result)) == ["hsdp", "fsdp2"]
    validates(result, 8)


def test_deepspeed_bad_stage_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "ds.json", '{"zero_optimization": {"stage": 4}}')
    with pytest.raises(ImportFailed) as caught:
        import_config(path)
    assert caught.value.report.codes() == ["CP902"]
    assert "0, 1, 2 or 3" in caught.value.report.findings[0].message


# -- the Trainer -------------------------------------------------------------------------------


def test_trainer_fsdp_string() -> None:
    result = import_trainer_args(fsdp="full_shard auto_wrap offload", fsdp_config={
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "activation_checkpointing": True}, bf16=True)
    found = plugins(result)
    assert found["fsdp2"]["reshard_after_forward"] is True
    assert found["fsdp2"]["offload"] == "cpu"
    assert found["fsdp2"]["blocks"] == ["LlamaDecoderLayer"]
    assert "activation_checkpoint" in found
    assert result.report.findings == ()
    keys = [m.key for m in result.mapped]
    assert "--fsdp full_shard" in keys and "--fsdp offload" in keys


def test_trainer_fsdp1_hybrid_needs_nodes() -> None:
    with pytest.raises(ImportFailed) as caught:
        import_trainer_args(fsdp="hybrid_shard", fsdp_config={"version": 1})
    assert caught.value.report.codes() == ["CP913"]
    result = import_trainer_args(fsdp="hybrid_shard", fsdp_config={"version": 1}, nodes=2)
    assert mesh(result) == {"dp_replicate": 2, "dp_shard": -1}


def test_trainer_fsdp2_refuses_fsdp1_only_strategies() -> None:
    with pytest.raises(ImportFailed) as caught:
        import_trainer_args(fsdp="hybrid_shard")
    assert caught.value.report.codes() == ["CP902"]
    assert "version" in caught.value.report.findings[0].fix


def test_trainer_deepspeed_file() -> None:
    result = import_trainer_args(deepspeed=DATA / "ds_zero3.json")
    assert plugins(result)["fsdp2"]["reshard_after_forward"] is True
    assert any(m.key == "--deepspeed zero_optimization.stage" for m in result.mapped)


# -- reading -----------------------------------------------------------------------------------


def test_unreadable_sources(tmp_path: Path) -> None:
    with pytest.raises(ImportFailed) as missing:
        import_config(tmp_path / "nope.yaml")
    assert missing.value.report.codes() == ["CP901"]
    with pytest.raises(ImportFailed) as neither:
        import_config(write(tmp_path, "x.yaml", "hello: world\n"))
    assert "neither an accelerate config" in neither.value.report.findings[0].message
    with pytest.raises(ImportFailed) as bad_json:
        import_config(write(tmp_path, "x.json", "{"))
    assert "not valid JSON" in bad_json.value.report.findings[0].message


def test_yaml_without_pyyaml_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(ImportFailed) as caught:
        import_config(DATA / "accelerate_fsdp2.yaml")
    finding = caught.value.report.findings[0]
    assert finding.code == "CP901"
    assert "pip install pyyaml" in finding.fix


def test_the_import_codes_are_core_rules() -> None:
    for number in range(901, 915):
        assert f"CP{number}" in CORE_RULES


# -- the command -------------------------------------------------------------------------------


def test_cli_writes_a_plan_that_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    out = tmp_path / "plan.toml"
    assert main(["import", str(DATA / "accelerate_fsdp1.yaml"), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert main(["validate", str(out)]) == 0
    assert ParallelPlan.from_toml(out).plugin("fsdp2") is not None


def test_cli_explain_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import", str(DATA / "ds_zero3.json"), "--explain"]) == 0
    text = capsys.readouterr().out
    assert ("zero_optimization.stage = 3" in text
            and "[[plugins]] fsdp2: reshard_after_forward = true" in text)
    assert "(left out: see CP904)" in text
    assert main(["import", "--json", str(DATA / "ds_zero1.json")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 0 and data["tool"] == "deepspeed"
    assert [f["code"] for f in data["findings"]] == ["CP908"]
    assert ParallelPlan.from_toml(data["plan"]).plugin("fsdp2") is not None


def test_cli_trainer_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import", "--fsdp", "shard_grad_op auto_wrap", "--fsdp-config",
                 '{"transformer_layer_cls_to_wrap": "DecoderLayer"}', "--fp16"]) == 0
    text = capsys.readouterr().out
    assert "reshard_after_forward = false" in text and "CP907" in text


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import", str(tmp_path / "missing.json")]) == 2
    assert "CP901" in capsys.readouterr().out
    bad = write(tmp_path, "c.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n"
                "  fsdp_sharding_strategy: FULLSHARD\n")
    assert main(["import", "--json", str(bad)]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["findings"][0]["code"] == "CP902"
    # a plan whose mesh cannot hold the world size: the written plan has errors
    assert main(["import", str(DATA / "accelerate_fsdp2_parallelism.yaml"),
                 "--world-size", "6"]) == 1
    assert "CP101" in capsys.readouterr().out
    assert main(["import"]) == 2
    assert main(["import", "--help"]) == 0


def test_every_deepspeed_key_is_mapped_or_found() -> None:
    path = DATA / "ds_zero3.json"
    config = json.loads(path.read_text())
    result = import_config(path)
    keys = {m.key for m in result.mapped}
    expected = {k for k in config if k != "zero_optimization"}
    expected |= {f"zero_optimization.{k}" for k in config["zero_optimization"]}
    assert keys == expected


def test_accelerate_config_naming_a_deepspeed_file(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text((DATA / "ds_zero3.json").read_text())
    config = write(tmp_path, "c.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                   "  deepspeed_config_file: ds.json\n  zero3_init_flag: true\n")
    result = import_config(config)
    assert plugins(result)["fsdp2"]["reshard_after_forward"] is True
    assert any(m.key == "ds.json: zero_optimization.stage" for m in result.mapped)
    # the accelerate keys beside the file are read too
    assert next(m for m in result.mapped
                if m.key == "deepspeed_config.zero3_init_flag").code == "CP910"
    missing = write(tmp_path, "m.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                    "  deepspeed_config_file: nowhere.json\n")
    with pytest.raises(ImportFailed) as caught:
        import_config(missing)
    assert caught.value.report.codes() == ["CP901"]
