"""The compress plugin without processes: registration, plan files, options, its own
validation rules (CPC1xx), what explain says, and that every rule is documented."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
from composer_par import FSDP2, HSDP, MeshSpec, MetaInit, ParallelPlan, PlanFileError
from composer_par.cli.main import main
from composer_par.plugin.registry import Registry

from composer_par_compress import RULES, Compress

from compress_workers import compress, hsdp, plan, replicate_only

README = Path(__file__).resolve().parent.parent / "README.md"
TESTS = Path(__file__).resolve().parent


def hsdp_plan(*extra: object, replicate: int = 2, shard: int = 4) -> ParallelPlan:
    p = ParallelPlan(MeshSpec(dp_replicate=replicate, dp_shard=shard)).use(HSDP()).use(FSDP2())
    for plugin in extra:
        p.use(plugin)  # type: ignore[arg-type]
    return p.use(MetaInit(seed=0))


# -- packaging ------------------------------------------------------------------------------


def test_registered_through_the_entry_point() -> None:
    registry = Registry()
    info = registry.info("compress")
    assert info.distribution == "composer-par-compress"
    assert registry.get("compress") is Compress


def test_composer_par_plugins_lists_it() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(out.getvalue())["plugins"]}
    assert rows["compress"]["distribution"] == "composer-par-compress"
    assert rows["compress"]["stages"] == ["finalize"]
    assert {"method", "rank", "dim", "min_compress_numel"} <= set(rows["compress"]["options"])


def test_a_plan_file_names_it_and_round_trips() -> None:
    text = hsdp(compress("powersgd", rank=2, min_compress_numel=512, error_feedback=False))
    loaded = ParallelPlan.from_toml(text)
    plugin = loaded.plugin("compress")
    assert plugin == Compress(method="powersgd", rank=2, min_compress_numel=512,
                              error_feedback=False)
    again = ParallelPlan.from_toml(loaded.to_toml())
    assert again.plugin("compress") == plugin
    assert loaded.validate(world_size=4).ok


@pytest.mark.parametrize(("option", "message"), [
    ('method = "int8"', "method must be one of"),
    ("rank = 0", "rank must be an int >= 1"),
    ("min_compress_numel = -1", "min_compress_numel must be an int >= 0"),
    ('error_feedback = "yes"', "error_feedback must be true or false"),
])
def test_bad_options_fail_when_the_plan_file_is_read(option: str, message: str) -> None:
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml(hsdp(f'name = "compress"\n{option}'))
    assert info.value.report.codes() == ["CP506"]
    assert message in info.value.report.format()


def test_method_aliases() -> None:
    assert Compress(method="bfloat16").method == "bf16"
    assert Compress(method="float16").method == "fp16"
    assert Compress(method="off").method == "none"


# -- composition ----------------------------------------------------------------------------


def test_one_comm_hook_on_its_dim_or_none_when_off() -> None:
    p = hsdp_plan(Compress(method="powersgd"))
    (hook,) = p.hooks.comm_hooks()
    assert (hook.dim, hook.plugin, hook.collectives()) == ("dp_replicate", "compress",
                                                           ("all_reduce",))
    off = hsdp_plan(Compress(method="none"))
    assert off.hooks.comm_hooks() == []


def test_explain_says_what_it_does() -> None:
    text = hsdp_plan(Compress(method="powersgd", rank=2)).explain(world_size=8).format()
    assert "comm hook on dp_replicate's gradient all-reduce: PowerSGD rank 2" in text
    assert "over mesh (dp_shard)" in text  # FSDP2 leaves dp_replicate to the hook


# -- validation (CPC1xx, and the core's comm-hook rules) -------------------------------------


def test_valid_with_hsdp_and_with_replicate_only() -> None:
    for method in ("bf16", "fp16", "powersgd"):
        assert hsdp_plan(Compress(method=method)).validate(world_size=8).findings == ()
        alone = ParallelPlan(MeshSpec(dp_replicate=4)).use(HSDP()).use(Compress(method=method))
        assert alone.validate(world_size=4).findings == ()


def test_cpc101_powersgd_on_a_plan_with_no_replicate_dim() -> None:
    p = ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(Compress(method="powersgd"))
    report = p.validate(world_size=4)
    assert "CPC101" in report.codes()
    finding = next(f for f in report.errors if f.code == "CPC101")
    assert finding.plugin == "compress"
    assert "no plugin replicates over 'dp_replicate'" in finding.message
    assert "fsdp2 shards over dp_shard" in finding.message
    assert "replicate across nodes with HSDP" in finding.fix
    # The core says the same from its side: the hook's dim has no data-parallel owner.
    assert "CP218" in report.codes()


def test_cpc101_pointed_at_the_shard_dim() -> None:
    report = hsdp_plan(Compress(method="bf16", dim="dp_shard")).validate(world_size=8)
    assert sorted(report.codes()) == ["CP220", "CPC101"]
    finding = next(f for f in report.errors if f.code == "CPC101")
    assert finding.fix.startswith("set dim = 'dp_replicate'")


def test_cpc102_replicate_dim_of_size_one() -> None:
    report = hsdp_plan(Compress(), replicate=1).validate(world_size=4)
    assert report.codes() == ["CPC102"] and report.ok


def test_cpc103_powersgd_finds_nothing_to_compress() -> None:
    p = (ParallelPlan(MeshSpec(dp_replicate=2)).use(HSDP()).use(Compress(method="powersgd"))
         .use(MetaInit()))
    with torch.device("meta"):
        small = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
        wide = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
    report = p.validate(small, world_size=2)
    assert report.codes() == ["CPC103"] and report.ok
    assert "largest: [16, 16]" in report.warnings[0].message
    assert p.validate(wide, world_size=2).codes() == []
    # bf16 compresses every tensor: nothing to warn about.
    bf16 = (ParallelPlan(MeshSpec(dp_replicate=2)).use(HSDP()).use(Compress(method="bf16"))
            .use(MetaInit()))
    assert bf16.validate(small, world_size=2).codes() == []


def test_needs_a_data_parallel_plugin() -> None:
    p = ParallelPlan(MeshSpec(dp_replicate=1)).use(Compress())
    assert "CP206" in p.validate(world_size=1).codes()


def test_off_validates_nothing() -> None:
    p = ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(Compress(method="none"))
    assert p.validate(world_size=4).findings == ()


def test_plan_helpers_spell_valid_plan_files() -> None:
    assert ParallelPlan.from_toml(replicate_only(compress("fp16"))).validate(world_size=2).ok
    assert ParallelPlan.from_toml(plan("dp_shard = 2", 'name = "fsdp2"')).validate(
        world_size=2).ok


# -- the rule catalog of the plugin -----------------------------------------------------------


def _readme_sections() -> dict[str, tuple[str, str]]:
    text = README.read_text(encoding="utf-8")
    parts = re.split(r"^### (CPC\d{3}): (.+)$", text, flags=re.MULTILINE)
    return {code: (title.strip(), re.split(r"^##? ", body, flags=re.MULTILINE)[0])
            for code, title, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True)}


@pytest.mark.parametrize("code", sorted(RULES))
def test_every_rule_is_documented_and_tested(code: str) -> None:
    severity, title = RULES[code]
    sections = _readme_sections()
    assert code in sections, f"README.md has no '### {code}: ...' section"
    documented_title, body = sections[code]
    assert documented_title == title
    assert re.search(rf"\*\*Severity:\*\*\s*{severity.value}\b", body)
    assert "**Meaning:**" in body and "**Example:**" in body and "**Fix:**" in body
    assert re.search(rf"```text\n\s*{severity.value.upper()} {code}\b", body)
    tests = [p for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name]
    assert any(code in p.read_text(encoding="utf-8") for p in [*tests, Path(__file__)])


def test_readme_documents_exactly_the_rules() -> None:
    assert set(_readme_sections()) == set(RULES)
