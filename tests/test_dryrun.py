"""The dry run: a plan applied as chosen ranks of the full layout, in one process, over
torch's fake process-group backend, on a model built on meta (no memory, no peers)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan, Registry
from composer_par.models.llama import parameter_count
from composer_par.plugin import Plugin, hookimpl
from composer_par.tools.dryrun import (
    DryRunError,
    SkippedInDryRun,
    default_ranks,
    dry_run,
    format_result,
    resolve_factory,
)
from tests.cli_run import run
from tests.dryrun_models import SMALL

SMALL_MODEL = "tests.dryrun_models:small_llama"
MODEL_1B = "tests.dryrun_models:llama_1b"
INSTALLED = set(Registry().names())
needs_hsdp = pytest.mark.skipif("hsdp" not in INSTALLED, reason="the hsdp plugin is not installed")
needs_tp = pytest.mark.skipif("tp" not in INSTALLED, reason="the tp plugin is not installed")


def plan_text(mesh: str, plugins: list[str], nodes: int | None = None,
              devices: int | None = None) -> str:
    text = f"[mesh]\n{mesh}\n"
    if nodes:
        text += f"[topology]\nnodes = {nodes}\ndevices_per_node = {devices}\n"
    for plugin in plugins:
        name, _, options = plugin.partition(" ")
        text += f'[[plugins]]\nname = "{name}"\n' + options.replace(";", "\n") + "\n"
    return text


# -- MODULE:FACTORY --------------------------------------------------------------------------


def test_factories_resolve_like_uvicorn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_factory(SMALL_MODEL).__name__ == "small_llama"
    (tmp_path / "my_models.py").write_text(
        "import torch.nn as nn\n"
        "class Zoo:\n    @staticmethod\n    def tiny():\n        return nn.Linear(2, 2)\n")
    monkeypatch.chdir(tmp_path)  # the current directory is on the path, as uvicorn does
    assert resolve_factory("my_models:Zoo.tiny")().in_features == 2


@pytest.mark.parametrize(("spec", "message"), [
    ("no_colon", 'as "<module>:<factory>"'),
    ("tests.no_such_module:build", 'could not import module "tests.no_such_module"'),
    ("tests.dryrun_models:missing", 'attribute "missing" not found'),
    ("tests.dryrun_models:NOT_CALLABLE", "not a factory"),
])
def test_bad_factories_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(DryRunError, match=message):
        resolve_factory(spec)


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.dryrun_models:not_a_module", "not an nn.Module"),
    ("tests.dryrun_models:raises", "the factory broke"),
])
def test_factories_that_do_not_build_a_module(spec: str, message: str) -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit())
    with pytest.raises(DryRunError, match=message):
        dry_run(plan, spec, world_size=2)


# -- 8 ranks: every parameter's shard ---------------------------------------------------------


def test_eight_ranks_of_fsdp2_every_shard_adds_up() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2()).use(MetaInit(seed=1))
    result = dry_run(plan, SMALL_MODEL, world_size=8, ranks=range(8))
    assert result.ok and result.exit_code() == 0
    assert [r.rank for r in result.ranks] == list(range(8))
    first = result.ranks[0]
    params = {p.name: p for p in first.params}
    emb = params["tok_embeddings.weight"]
    assert (emb.global_shape, emb.local_shape) == ((256, 64), (32, 64))
    assert emb.bytes == 32 * 64 * 4 and emb.placements == "dp_shard:S(0)"
    assert first.skipped == ("meta_init",)
    assert ("materialize", "meta_init", "skipped in dry run: would materialize (tensors stay "
            "on meta)") in first.steps
    # MetaInit's own model-aware check ran with the real plugin: nothing to report here
    assert result.report.ok
    # every rank holds 1/8 (the sizes divide evenly): the shards add up to the model
    assert sum(r.local_numel for r in result.ranks) == first.global_numel
    assert first.local_bytes == sum(p.bytes for p in first.params)
    assert first.global_numel == parameter_count(SMALL)
    text = format_result(result)
    assert "rank 7 (dp_shard=7)" in text and "layers.*.attention.wq.weight x2" in text


def test_default_ranks_are_the_first_and_the_last() -> None:
    assert default_ranks(64) == [0, 63] and default_ranks(1) == [0]
    plan = ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(MetaInit())
    assert [r.rank for r in dry_run(plan, SMALL_MODEL, world_size=4).ranks] == [0, 3]


def test_the_stand_in_declares_what_the_materializer_declares() -> None:
    stand_in = SkippedInDryRun(MetaInit(seed=3))
    assert stand_in.declare() == MetaInit(seed=3).declare()


def test_ranks_outside_the_layout_and_a_live_process_group_are_refused() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(MetaInit())
    with pytest.raises(DryRunError, match="rank 4 is outside the layout of 4 ranks"):
        dry_run(plan, SMALL_MODEL, world_size=4, ranks=[4])
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(DryRunError, match="already initialized"):
            dry_run(plan, SMALL_MODEL, world_size=4)
    finally:
        dist.destroy_process_group()


@attrs.frozen
class Exploding(Plugin):
    name: ClassVar[str] = "exploding"

    @hookimpl
    def composer_par_finalize(self) -> str:
        raise RuntimeError("finalize blew up on this rank")


def test_a_failure_while_applying_is_reported_for_that_rank() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit()).use(Exploding())
    result = dry_run(plan, SMALL_MODEL, world_size=2)
    assert not result.ok and result.exit_code() == 1
    failure = result.ranks[0].failure
    assert failure is not None and "RuntimeError: finalize blew up" in failure
    assert "test_dryrun.py" in failure
    assert "applying the plan FAILED" in format_result(result)


# -- 64 and 512 ranks of a 1B model ----------------------------------------------------------


@needs_hsdp
def test_sixty_four_ranks_of_a_1b_model_in_seconds() -> None:
    plan = ParallelPlan.from_toml(plan_text(
        "dp_replicate = 8\ndp_shard = 8", ["hsdp", "fsdp2", "meta_init"], 8, 8))
    started = time.perf_counter()
    result = dry_run(plan, MODEL_1B)
    seconds = time.perf_counter() - started
    assert result.ok, format_result(result)
    assert result.world_size == 64 and [r.rank for r in result.ranks] == [0, 63]
    last = result.ranks[1]
    assert last.node == 7 and last.coordinate == {"dp_replicate": 7, "dp_shard": 7}
    wq = next(p for p in last.params if p.name == "layers.0.attention.wq.weight")
    assert wq.local_shape == (256, 2048)
    assert wq.placements == "dp_replicate:R, dp_shard:S(0)"
    assert last.global_numel == 1_100_048_384
    assert last.local_numel == pytest.approx(1_100_048_384 / 8, rel=1e-3)
    # "in seconds": loose for a loaded 2-core CI machine; benchmarks/bench_dryrun.py times it
    assert seconds < 60, seconds


@needs_hsdp
@needs_tp
def test_five_hundred_twelve_ranks_with_tp_sequence_parallel_and_checkpointing() -> None:
    plugins = ["hsdp", "fsdp2", "tp sequence_parallel = true", "meta_init"]
    if "activation_checkpoint" in INSTALLED:
        plugins.insert(0, "activation_checkpoint")
    plan = ParallelPlan.from_toml(plan_text(
        "dp_replicate = 16\ndp_shard = 8\ntp = 4", plugins, 64, 8))
    result = dry_run(plan, MODEL_1B)
    assert result.ok, format_result(result)
    last = result.ranks[-1]
    assert last.rank == 511 and last.node == 63
    assert last.coordinate == {"dp_replicate": 15, "dp_shard": 7, "tp": 3}
    params = {p.name: p for p in last.params}
    assert params["layers.3.attention.wq.weight"].local_shape == (64, 2048)  # 2048 / 4 / 8
    assert params["layers.3.attention.wo.weight"].local_shape == (256, 512)
    stages = [stage for stage, _, _ in last.steps]
    assert stages.index("tensor_parallel") < stages.index("data_parallel")


@needs_tp
def test_tp_8_on_a_model_with_4_kv_heads_is_found_before_anything_runs() -> None:
    plan = ParallelPlan.from_toml(plan_text(
        "dp_replicate = 8\ndp_shard = 8\ntp = 8", ["hsdp", "fsdp2", "tp", "meta_init"], 64, 8)
        if "hsdp" in INSTALLED else plan_text(
        "dp_shard = 64\ntp = 8", ["fsdp2", "tp", "meta_init"], 64, 8))
    result = dry_run(plan, MODEL_1B)
    assert "CP407" in result.report.codes()
    assert result.ranks == () and result.exit_code() == 1
    assert "not applied: the plan has errors" in format_result(result)


@needs_hsdp
def test_a_reversed_hsdp_mesh_on_4_nodes_of_8() -> None:
    plan = ParallelPlan.from_toml(plan_text(
        "dp_shard = 4\ndp_replicate = 8", ["hsdp", "fsdp2", "meta_init"], 4, 8))
    result = dry_run(plan, MODEL_1B)
    assert "CP301" in result.report.codes() and result.exit_code() == 1
    cp301 = next(f for f in result.report.findings if f.code == "CP301")
    assert "dp_replicate = 8 then dp_shard = 4" in cp301.fix


# -- the CLI -----------------------------------------------------------------------------------


@pytest.fixture
def small_plan(tmp_path: Path) -> str:
    path = tmp_path / "plan.toml"
    path.write_text(plan_text("dp_shard = 8", ["fsdp2", "meta_init"], 2, 4))
    return str(path)


def test_validate_with_a_model_text(small_plan: str) -> None:
    code, out, err = run(["validate", small_plan, "--model", SMALL_MODEL])
    assert code == 0, (out, err)
    assert "dry run of 8 ranks over torch's fake process-group backend" in out
    assert "rank 0 (node 0, dp_shard=0)" in out and "rank 7 (node 1, dp_shard=7)" in out
    assert "[materialize] meta_init: skipped in dry run" in out
    assert "applied" not in err  # the library's log events are captured, not printed
    code, out, _ = run(["validate", small_plan, "--model", SMALL_MODEL, "--rank", "3",
                        "--all-params"])
    assert "rank 3 (node 0, dp_shard=3)" in out and "layers.1.attention.wq.weight" in out


def test_validate_with_a_model_json_is_all_of_stdout(small_plan: str) -> None:
    code, out, _ = run(["validate", small_plan, "--model", SMALL_MODEL, "--json"])
    data = json.loads(out)
    assert code == 0 and data["exit_code"] == 0 and data["ok"]
    ranks = data["dry_run"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 7] and ranks[1]["node"] == 1
    emb = next(p for p in ranks[0]["params"] if p["name"] == "tok_embeddings.weight")
    assert emb["local_shape"] == [32, 64] and emb["bytes"] == 32 * 64 * 4
    assert ranks[0]["totals"]["global_params"] == sum(
        (p["global_shape"][0] * (p["global_shape"][1] if len(p["global_shape"]) > 1 else 1))
        for p in ranks[0]["params"])
    assert ranks[0]["skipped_in_dry_run"] == ["meta_init"]


@pytest.mark.parametrize(("extra", "expected"), [
    (["--model", "tests.dryrun_models:nope"], 2),
    (["--model", SMALL_MODEL, "--rank", "8"], 2),
    (["--model", SMALL_MODEL, "--rank", "-1"], 2),
    (["--model", SMALL_MODEL, "--world-size", "16"], 1),  # the mesh equation breaks
])
def test_validate_with_a_model_exit_codes(small_plan: str, extra: list[str],
                                          expected: int) -> None:
    code, out, err = run(["validate", small_plan, *extra, "--json"])
    assert code == expected, (out, err)
    assert json.loads(out)["exit_code"] == expected
    assert "Traceback" not in out + err


def test_model_aware_findings_come_with_the_dry_run(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(plan_text("dp_shard = 2", ["fsdp2 blocks = \"nowhere\"", "meta_init"]))
    code, out, _ = run(["validate", str(path), "--model", SMALL_MODEL])
    assert code == 1 and "CP401" in out and "not applied" in out


@pytest.fixture(autouse=True)
def _no_topology_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

