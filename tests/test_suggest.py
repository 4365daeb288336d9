"""``suggest``: candidate layouts, what fits, the ranking, and why each runner-up lost."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from composer_par import ParallelPlan, Registry, Topology
from composer_par.cli.main import main
from composer_par.estimate import ModelShape, parse_bytes
from composer_par.tools.suggest import (
    Candidate,
    candidates,
    cp_candidates,
    format_suggestion,
    suggest,
)

GIB80 = parse_bytes("80GiB")
INSTALLED = set(Registry().names())


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_candidates_cover_fsdp_hsdp_splits_tp_and_checkpointing() -> None:
    model = ModelShape.from_numbers(params=7_000_000_000, layers=32, hidden=4096, heads=32,
                                    kv_heads=8)
    found = candidates(Topology(4, 8), model)
    layouts = {(c.replicate, c.shard, c.tp) for c in found}
    assert (1, 32, 1) in layouts and (4, 8, 1) in layouts and (32, 1, 1) in layouts
    assert (4, 4, 2) in layouts and (1, 4, 8) in layouts
    assert all(c.replicate * c.shard * c.tp == 32 for c in found)
    assert {c.ac for c in found} == {"none", "selective", "full"}
    # TP sizes divide the devices of a node and the head counts
    odd = ModelShape.from_numbers(params=1_000_000_000, layers=8, hidden=1536, heads=12,
                                  kv_heads=4)
    assert {c.tp for c in candidates(Topology(2, 8), odd)} == {1, 2, 4}


def test_candidate_meshes_and_plugins() -> None:
    assert Candidate(4, 8, 1, "none").mesh().to_dict() == {"dp_replicate": 4, "dp_shard": 8}
    assert Candidate(4, 1, 2, "full").mesh().to_dict() == {"dp_replicate": 4, "dp_shard": 1,
                                                           "tp": 2}
    names = [n for n, _ in Candidate(4, 1, 2, "full").plugins("bfloat16", True)]
    assert names == ["tp", "activation_checkpoint", "hsdp", "fsdp2", "meta_init"]
    assert Candidate(8, 1, 1, "none").label() == "replicate 8"


def test_picks_hsdp_when_a_node_holds_the_shards_and_inter_node_links_are_slow() -> None:
    model = ModelShape.from_numbers(params=13_000_000_000)
    result = suggest(model, Topology(4, 8), GIB80, seq=4096, inter_node_gbps=100)
    best = result.best
    assert best is not None
    assert (best.candidate.replicate, best.candidate.shard, best.candidate.tp) == (4, 8, 1)
    assert any(line.startswith("HSDP 4x8: all-gathers and reduce-scatters stay in groups of 8")
               for line in result.why)
    fsdp = next(r for r in result.ranked if r.candidate == Candidate(1, 32, 1, best.candidate.ac))
    assert fsdp.fits and fsdp.reason.startswith("slower:")
    assert "dp_shard(32) all-gathers, reduce-scatters across nodes" in fsdp.reason
    # with links between nodes as fast as inside them, sharding over more nodes wins
    fast = suggest(model, Topology(4, 8), GIB80, seq=4096, inter_node_gbps=3200)
    assert fast.best is not None and fast.best.candidate.shard > 8


def test_adds_tp_when_activations_do_not_fit() -> None:
    model = ModelShape.from_numbers(params=7_000_000_000, layers=32, hidden=4096, heads=32)
    # without the cp plugin (with it, CP splits the sequence instead: see below)
    result = suggest(model, Topology(2, 8), GIB80, seq=262_144, registry=Registry(block=["cp"]))
    assert any("the cp plugin is not installed" in note for note in result.notes)
    best = result.best
    assert best is not None and best.candidate.tp > 1
    why = next(line for line in result.why if line.startswith(f"TP {best.candidate.tp}:"))
    assert "no layout without TP fits" in why and "activations" in why
    plan = result.plan_toml or ""
    assert 'name = "tp"' in plan and "sequence_parallel = true" in plan


def test_adds_tp_when_a_block_s_parameters_do_not_fit() -> None:
    # one enormous block: gathering it unsharded (FSDP's working set) does not fit
    model = ModelShape.from_numbers(layers=1, hidden=65536, heads=512)
    result = suggest(model, Topology(8, 8), GIB80, seq=2048)
    best = result.best
    assert best is not None and best.candidate.tp > 1
    why = next(line for line in result.why if line.startswith("TP"))
    assert "communication buffers" in why


def test_nothing_fits() -> None:
    model = ModelShape.from_numbers(params=175_000_000_000)
    result = suggest(model, Topology(1, 8), GIB80, seq=2048)
    assert result.best is None and result.plan_toml is None
    assert all(r.reason.startswith("does not fit") for r in result.ranked)
    assert any("no layout fits" in note for note in result.notes)
    assert "best plan:" not in format_suggestion(result)


def test_runners_up_say_why_they_lost() -> None:
    model = ModelShape.from_numbers(params=13_000_000_000)
    result = suggest(model, Topology(4, 8), GIB80, seq=4096, inter_node_gbps=100)
    reasons = [r.reason for r in result.ranked[1:]]
    assert any(r.startswith("same communication, but recomputes more") for r in reasons)
    assert any(r.startswith("slower:") for r in reasons)
    assert any(r.startswith("does not fit: needs") for r in reasons)
    # fitting layouts first, by communication time (to 3 significant digits)
    seconds = [float(f"{r.estimate.seconds:.3g}") for r in result.ranked if r.fits]
    assert seconds == sorted(seconds)
    assert [r.fits for r in result.ranked] == sorted((r.fits for r in result.ranked),
                                                     reverse=True)


ARGV = ["suggest", "--params", "13e9", "--nodes", "4", "--devices-per-node", "8",
        "--device-memory", "80GiB", "--inter-node-gbps", "100", "--seq", "4096"]


def test_suggest_command_text(tmp_path: Path) -> None:
    output = tmp_path / "best.toml"
    code, out, _ = run([*ARGV, "--top", "3", "--output", str(output)])
    assert code == 0
    assert "best plan:" in out and "```toml" in out and "candidates (best first):" in out
    assert "WHY NOT" in out and f"plan file written to {output}" in out
    text = output.read_text()
    assert "dp_replicate = 4\ndp_shard = 8" in text and "inter_node_gbps = 100" in text
    if {"hsdp", "fsdp2", "meta_init"} <= INSTALLED:
        plan = ParallelPlan.from_toml(text)
        assert plan.validate(world_size=32).ok
        assert plan.topology == Topology(4, 8, inter_node_gbps=100.0)


def test_suggest_command_json_and_exit_codes() -> None:
    code, out, _ = run([*ARGV, "--json"])
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["exit_code"] == 0
    assert data["best"]["mesh"] == {"dp_replicate": 4, "dp_shard": 8}
    assert data["estimate"]["communication_seconds"] == data["best"]["communication_seconds"]
    assert len(data["candidates"]) == 54 and data["candidates"][0]["reason"] == ""
    code, out, _ = run(["suggest", "--params", "175e9", "--nodes", "1", "--devices-per-node",
                        "8", "--device-memory", "80GiB", "--seq", "2048", "--json"])
    assert code == 1 and json.loads(out)["best"] is None
    for bad in (["--device-memory", "lots"], ["--nodes", "0"]):
        argv = [*ARGV]
        argv[argv.index(bad[0]) + 1] = bad[1]
        assert run(argv)[0] == 2
    assert run(["suggest", "--nodes", "4", "--devices-per-node", "8", "--device-memory",
                "80GiB", "--seq", "4096"])[0] == 2  # no model


@pytest.mark.skipif("tp" not in INSTALLED, reason="the tp plugin is not installed")
def test_suggest_with_a_model() -> None:
    code, out, _ = run(["suggest", "--model", "tests.dryrun_models:llama_1b", "--nodes", "2",
                        "--devices-per-node", "8", "--device-memory", "24GiB", "--seq", "8192",
                        "--json"])
    data = json.loads(out)
    assert code == 0 and data["model"]["kv_heads"] == 4
    # TP sizes must divide the 4 KV heads: no TP 8 candidate
    assert all(c["mesh"].get("tp", 1) <= 4 for c in data["candidates"])


# Llama 3 8B's shape (as docs/estimate.md gives it to suggest)
LLAMA_8B = ModelShape.from_numbers(params=8_000_000_000, layers=32, hidden=4096, heads=32,
                                   kv_heads=8, ffn_hidden=14336, vocab=128256)


def test_cp_candidates_divide_a_node_the_sequence_and_for_alltoall_the_heads() -> None:
    found = cp_candidates(Topology(8, 8), LLAMA_8B, seq=131_072)
    sizes = {(c.tp, c.cp) for c in found}
    # cp x tp inside a node of 8; TP 8 leaves no room for cp there
    assert sizes == {(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}
    assert all(c.replicate * c.shard * c.cp * c.tp == 64 for c in found)
    assert {c.ac for c in found} == {"none", "selective", "full"}
    # alltoall where cp divides a tp rank's heads (32 / tp) and K/V heads (8 / tp)
    alltoall = {(c.tp, c.cp) for c in found if c.cp_mode == "alltoall"}
    assert alltoall == {(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}
    # 6 heads, 2 K/V heads: cp 2 alone divides both; TP 2 leaves one K/V head per rank
    few_heads = ModelShape.from_numbers(layers=2, hidden=384, heads=6, kv_heads=2)
    assert {(c.tp, c.cp) for c in cp_candidates(Topology(8, 8), few_heads, seq=131_072)
            if c.cp_mode == "alltoall"} == {(1, 2)}
    # 2 x cp must divide the sequence: 12 tokens allow cp 2 (chunks of 3) only
    assert {c.cp for c in cp_candidates(Topology(8, 8), LLAMA_8B, seq=12)} == {2}
    # across nodes: the multiples of a node's share that the world holds
    across = cp_candidates(Topology(8, 8), LLAMA_8B, seq=131_072, within_node=False)
    assert {(c.tp, c.cp) for c in across if c.tp == 1} == {(1, 16), (1, 32), (1, 64)}


def test_suggests_cp_for_llama_8b_at_128k_tokens_on_8_nodes() -> None:
    """No layout without CP fits 64 GiB (the smallest needs its activations' ~73 GiB);
    suggest proposes CP, and the plan file it writes reads back and validates."""
    gib64 = parse_bytes("64GiB")
    result = suggest(LLAMA_8B, Topology(8, 8), gib64, seq=131_072)
    without = [r for r in result.ranked if r.candidate.cp == 1]
    assert without and not any(r.fits for r in without)
    best = result.best
    assert best is not None and best.candidate.cp > 1
    assert best.estimate.memory.total <= gib64
    # a cp rank's activations are those of seq / cp tokens
    assert best.estimate.layout.sequence_split == best.candidate.cp
    why = next(line for line in result.why if line.startswith(f"CP {best.candidate.cp}:"))
    assert "no layout without CP fits" in why
    assert any(n.startswith("context-parallel layouts considered (nothing without CP fits)")
               for n in result.notes)
    plan_toml = result.plan_toml or ""
    assert f"cp = {best.candidate.cp}" in plan_toml and 'name = "cp"' in plan_toml
    assert "seq_len = 131072" in plan_toml
    if {"cp", "hsdp", "fsdp2", "activation_checkpoint", "meta_init"} <= INSTALLED:
        assert result.report is not None and result.report.ok
        plan = ParallelPlan.from_toml(plan_toml)
        assert plan.validate(world_size=64).ok
        assert plan.world_size() == 64
    # ranked by the same rules: fitting first, by communication time to 3 digits
    seconds = [float(f"{r.estimate.seconds:.3g}") for r in result.ranked if r.fits]
    assert seconds == sorted(seconds)
    # with 80 GiB a TP 8 layout fits, but its activations lead its memory: CP is still
    # considered, and communicates less than it
    roomy = suggest(LLAMA_8B, Topology(8, 8), GIB80, seq=131_072)
    assert any(r.fits and r.candidate.cp == 1 for r in roomy.ranked)
    assert roomy.best is not None and roomy.best.candidate.cp > 1
    tp8 = min((r for r in roomy.ranked if r.fits and r.candidate.cp == 1),
              key=lambda r: r.seconds)
    assert roomy.best.seconds < tp8.seconds


def test_cp_is_not_considered_when_activations_are_small() -> None:
    result = suggest(ModelShape.from_numbers(params=13_000_000_000), Topology(4, 8), GIB80,
                     seq=4096)
    assert all(r.candidate.cp == 1 for r in result.ranked)
