"""``--model`` given a Hugging Face ``config.json`` (or a model directory holding one), as
transformers' own ``save_pretrained`` writes it: ``estimate`` measures the model the
config describes, in the config's dtype, MoE shape included; ``validate`` dry-runs the
plan on it. A config naming its repository's own code builds transformers' own class for
its model_type; where transformers has none, it is refused with exit 2, as is a JSON that
is no model config, naming the file, before anything runs."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from tests import hf_workers
from tests.cli_run import run

pytest.importorskip("transformers")

PLAN = '[mesh]\ndp_shard = 2\n\n[[plugins]]\nname = "fsdp2"\n'


def saved(tmp_path: Path, family: str, **overrides: object) -> tuple[Path, int]:
    """``family``'s tiny config saved by transformers in bfloat16, and its parameter
    count (the model built from it)."""
    import torch

    config = hf_workers.config(family, dtype="bfloat16", **overrides)
    directory = tmp_path / family
    config.save_pretrained(directory)
    model = hf_workers.build(family, **overrides)
    count = sum(p.numel() for p in model.parameters())
    # Built from the config object, the model is float32: a bfloat16 estimate comes from
    # the saved file's dtype.
    assert isinstance(count, int) and not any(p.dtype == torch.bfloat16
                                              for p in model.parameters())
    return directory, count


@pytest.fixture
def plan(tmp_path: Path) -> Path:
    path = tmp_path / "plan.toml"
    path.write_text(PLAN)
    return path


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("as_file", [False, True])
def test_estimate_measures_the_configs_model(tmp_path: Path, plan: Path, family: str,
                                             as_file: bool) -> None:
    directory, count = saved(tmp_path, family)
    spec = str(directory / "config.json") if as_file else str(directory)
    code, out, err = run(["estimate", str(plan), "--model", spec, "--seq", "64", "--json"])
    assert code == 0, err
    model = json.loads(out)["model"]
    assert model["params"] == count and model["dtype"] == "bfloat16"
    assert model["layers"] == hf_workers.COMMON["num_hidden_layers"]
    assert (model["moe"] is not None) == (family == "qwen3_moe"), model["moe"]


def test_validate_dry_runs_the_plan_on_the_configs_model(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path, "llama")
    plan = tmp_path / "materialized.toml"
    plan.write_text(PLAN + '\n[[plugins]]\nname = "meta_init"\n')
    code, out, err = run(["validate", str(plan), "--model", str(directory)])
    assert code == 0, out + err
    assert "LlamaForCausalLM" in out and "first step" in out, out


@pytest.mark.parametrize("known", [True, False])
def test_a_config_naming_its_own_code_runs_none_of_it(tmp_path: Path, plan: Path,
                                                      known: bool) -> None:
    """auto_map beside a model_type transformers has (DeepSeek-V3's config.json): its own
    class, the custom names ignored; beside one it lacks: refused, with no question on
    stdin (transformers asks whether to run the code unless told not to)."""
    directory, count = saved(tmp_path, "llama")
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data["auto_map"] = {"AutoConfig": "configuration_mine.MyConfig",
                        "AutoModelForCausalLM": "modeling_mine.MyModel"}
    data["architectures"] = ["MyModel"]
    if not known:
        data["model_type"] = "mine"
    path.write_text(json.dumps(data))
    argv = ["estimate", str(plan), "--model", str(directory), "--seq", "64", "--json"]
    stdin, sys.stdin = sys.stdin, io.StringIO("y\n")  # a question would read this
    try:
        code, out, err = run(argv)
    finally:
        sys.stdin = stdin
    if known:
        assert code == 0 and json.loads(out)["model"]["params"] == count, err
    else:
        assert code == 2 and "auto_map" in err and "MODULE:FACTORY" in err, err


def test_a_json_that_is_no_model_config_is_refused(tmp_path: Path, plan: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text('{"learning_rate": 0.1}')
    code, _, err = run(["estimate", str(plan), "--model", str(path), "--seq", "64"])
    assert code == 2 and str(path) in err and "transformers cannot read it" in err, err


def test_a_path_that_names_no_config_says_so(tmp_path: Path, plan: Path) -> None:
    for spec, said in ((tmp_path, "is a directory without a config.json"),
                       (tmp_path / "gone" / "config.json", "no such file or directory"),
                       (plan, "is not a .json file")):
        code, _, err = run(["estimate", str(plan), "--model", str(spec), "--seq", "64"])
        assert code == 2 and f"{spec}" in err and said in err, err
