"""The dry run of a pipeline plan (``validate --model``): which blocks on which pp rank,
parameters and bytes per stage and rank, and that it stops before the first step."""

from __future__ import annotations

import json

import pytest

from composer_par import ParallelPlan
from composer_par.cli.main import main as cli
from composer_par.tools.dryrun import dry_run, format_result

LLAMA8 = "tests.pp_workers:llama8.build"
PLAN = """[mesh]
pp = 2
dp_shard = 2

[[plugins]]
name = "pp"
schedule = "Interleaved1F1B"
stages_per_rank = 2

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "meta_init"
"""


def test_dry_run_shows_the_split_and_what_each_rank_holds() -> None:
    plan = ParallelPlan.from_toml(PLAN)
    result = dry_run(plan, LLAMA8, world_size=4, ranks=range(4))
    assert result.ok
    pipe = result.pipeline
    assert pipe is not None and pipe.placement == ((0, 2), (1, 3))
    assert pipe.split[0] == ("tok_embeddings", "layers.0", "layers.1")
    assert pipe.split[3] == ("layers.6", "layers.7", "norm", "output")
    full = 128 * 32 * 2 + 32 + 8 * 9280  # embedding, head, final norm, 8 blocks
    assert sum(pipe.stage_params) == full
    by_rank = {r.rank: r for r in result.ranks}
    # pp rank 0 (ranks 0, 1) holds stages 0 and 2; FSDP2 halves each over dp_shard.
    assert [s for s, _, _ in by_rank[1].stages] == [0, 2]
    assert [s for s, _, _ in by_rank[3].stages] == [1, 3]
    for stage, count, _ in by_rank[0].stages:
        assert count * 2 == pipe.stage_params[stage]
    names = {p.name for p in by_rank[2].params}
    assert "output.weight" in names and "tok_embeddings.weight" not in names
    assert sum(r.local_numel for r in result.ranks) == full  # halves of each stage, once
    text = format_result(result)
    assert "stage 1 on pp rank 1: layers.2-3" in text
    assert "stopped before the first step" in text


def test_validate_model_json_has_the_pipeline(tmp_path: pytest.TempPathFactory,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.toml"  # type: ignore[operator]
    plan.write_text(PLAN)
    code = cli(["validate", str(plan), "--model", LLAMA8, "--world-size", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    pipe = out["dry_run"]["pipeline"] if "dry_run" in out else out["pipeline"]
    assert pipe["stopped_before_first_step"] is True
    assert [s["pp_rank"] for s in pipe["stages"]] == [0, 1, 0, 1]
