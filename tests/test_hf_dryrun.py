"""The dry run (``composer-par validate --model``) of real Hugging Face models and of a
model with torchtitan's Llama 3 naming at 64 ranks, in this process, over torch's fake
process group: problems are named before launch (head counts, feature sizes, tied
weights), and each chosen rank runs one forward and backward on fake tensors, so a plan
that validates but would fail in its first step fails here; where the forward cannot be
checked the result says why."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_par import FSDP2, TP, ActivationCheckpoint, MeshSpec, MetaInit, ParallelPlan
from composer_par.tools.dryrun import dry_run, format_result
from tests import hf_workers

# One worker runs the whole module, so its module-scoped (cached) launch runs once.
pytestmark = pytest.mark.xdist_group("hf_dryrun")

ROOT = Path(__file__).resolve().parent.parent
WORLD = 64


def fsdp_tp(tp: TP | None = None, tp_size: int = 2) -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_shard=WORLD // tp_size, tp=tp_size)).use(FSDP2())
            .use(tp or TP()).use(MetaInit()))


@pytest.fixture(scope="module", autouse=True)
def _transformers() -> None:
    pytest.importorskip("transformers")


def test_llama_at_64_ranks_runs_a_step_on_fake_tensors() -> None:
    plan = fsdp_tp(TP(sequence_parallel=True)).use(ActivationCheckpoint())
    result = dry_run(plan, "tests.hf_workers:llama", world_size=WORLD)
    assert result.ok, format_result(result)
    assert [r.rank for r in result.ranks] == [0, 63]
    for rank in result.ranks:
        assert rank.forward is not None and rank.forward[0] == "ran", rank.forward
        assert "input_ids [1, 64], labels [1, 64]" in rank.forward[1]
    assert "first step: one forward and backward ran on fake tensors" in format_result(result)
    assert result.report.codes() == ["CP422", "CP425"]  # infos: no cache; own FSDP units


def test_problems_are_named_before_launch() -> None:
    # tp 8 on 2 KV heads (and 4 heads): the head counts, by config field
    result = dry_run(fsdp_tp(tp_size=8), "tests.hf_workers:qwen3", world_size=WORLD)
    assert not result.ranks and "CP407" in result.report.codes()
    messages = " ".join(f.message for f in result.report.findings if f.code == "CP407")
    assert "Qwen3ForCausalLM.config.num_key_value_heads=2" in messages
    assert "Qwen3ForCausalLM.config.num_attention_heads=4" in messages
    # a vocabulary tp 4 does not divide: the modules, by name
    odd = functools.partial(hf_workers.build, "llama", vocab_size=102)
    result = dry_run(fsdp_tp(tp_size=4), odd, world_size=WORLD)
    found = [f.message for f in result.report.findings if f.code == "CP406"]
    assert any(m.startswith("model.embed_tokens") and "num_embeddings=102" in m
               for m in found), found
    assert any(m.startswith("lm_head") and "out_features=102" in m for m in found), found
    # tied weights: a tie two styles would split two ways, a block splitting a tie
    plan = fsdp_tp(TP(plan={**hf_workers.HANDWRITTEN, "model.embed_tokens": "embedding_colwise"}))
    result = dry_run(plan, "tests.hf_workers:gemma", world_size=WORLD)
    assert any("model.embed_tokens.weight is tied to lm_head.weight" in f.message
               for f in result.report.findings if f.code == "CP409")
    split_tie = FSDP2(blocks=["BertEmbeddings", "BertLayer"])
    plan = ParallelPlan(MeshSpec(dp_shard=WORLD)).use(split_tie).use(MetaInit())
    result = dry_run(plan, "tests.hf_workers:bert", world_size=WORLD)
    assert "CP424" in result.report.codes() and not result.ranks


def test_a_forward_fake_tensors_cannot_run_is_reported_not_checked() -> None:
    # The demo's mixture-of-experts Llama counts its tokens per expert with bincount, a
    # data-dependent op: its own unparallelized forward does not run on fake tensors
    # either, which the result says; that is not the plan's failure.
    plan = (ParallelPlan(MeshSpec(dp_shard=WORLD)).use(FSDP2()).use(MetaInit()))
    result = dry_run(plan, "composer_par.tools.demo:demo_moe_model", world_size=WORLD,
                     ranks=[5])
    assert result.ok, format_result(result)
    status, detail = result.ranks[0].forward or ("", "")
    assert status == "not checked", detail
    assert "unparallelized, does not run on fake tensors either" in detail
    assert "first step not checked:" in format_result(result)


def test_grouped_experts_run_their_fake_step_in_bfloat16() -> None:
    # transformers' experts call grouped_mm, whose fake kernel takes bfloat16 only: the
    # step (and its reduction check) runs on a bfloat16 copy of the model, and says so.
    result = dry_run(fsdp_tp(), "tests.hf_workers:mixtral", world_size=WORLD, ranks=[5])
    assert result.ok, format_result(result)
    status, detail = result.ranks[0].forward or ("", "")
    assert status == "ran" and detail.endswith("takes bfloat16 only)"), detail
    assert result.ranks[0].reductions == ()


# -- torchtitan's Llama 3 naming ----------------------------------------------------------


def test_torchtitan_llama3_names_apply_and_step() -> None:
    for factory in ("titan_llama3", "titan_llama3_fused"):
        result = dry_run(fsdp_tp(tp_size=4), f"tests.hf_workers:{factory}", world_size=WORLD)
        assert result.ok, format_result(result)
        assert all(r.forward and r.forward[0] == "ran" for r in result.ranks), factory
    result = dry_run(fsdp_tp(TP(sequence_parallel=True), tp_size=4),
                     "tests.hf_workers:titan_llama3", world_size=WORLD)
    assert result.ok and all(r.forward and r.forward[0] == "ran" for r in result.ranks)
    # The fused projection is left whole with its attention, and says so.
    result = dry_run(fsdp_tp(tp_size=4), "tests.hf_workers:titan_llama3_fused",
                     world_size=WORLD)
    fallback = [f for f in result.report.findings if f.code == "CP420"]
    assert len(fallback) == 1 and "wqkv holds q, k and v" in fallback[0].message
    params = {p.name: p.placements for p in result.ranks[0].params}
    for name in ("layers.0.attention.wqkv.weight", "layers.0.attention.wo.weight"):
        assert params[name].endswith("tp:R"), params[name]
    assert params["layers.0.feed_forward.w2.weight"].endswith("tp:S(1)")
    # Sequence parallel has no layout for an attention left whole: refused, with why.
    result = dry_run(fsdp_tp(TP(sequence_parallel=True), tp_size=4),
                     "tests.hf_workers:titan_llama3_fused", world_size=WORLD)
    assert not result.ranks and "CP408" in result.report.codes()
    assert any("layers.*.attention whole" in f.message for f in result.report.findings)


def test_a_plan_that_validates_but_fails_its_first_step_fails_the_dry_run() -> None:
    # wqkv left whole while wo is split: validation cannot see it, the first step can.
    plan = fsdp_tp(TP(plan=hf_workers.TITAN_SPLIT_WO_ONLY), tp_size=4)
    assert plan.validate(hf_workers.titan_llama3_fused(), world_size=WORLD).ok
    result = dry_run(plan, "tests.hf_workers:titan_llama3_fused", world_size=WORLD)
    assert not result.ok and result.exit_code() == 1
    status, detail = result.ranks[0].forward or ("", "")
    assert status == "failed" and "must have same reduction dim" in detail, detail
    assert "first step FAILED: RuntimeError" in format_result(result)


def test_validate_model_on_the_command_line_runs_the_step(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text('[mesh]\ndp_shard = 16\ntp = 4\n\n[[plugins]]\nname = "fsdp2"\n\n'
                    '[[plugins]]\nname = "tp"\n\n[plugins.plan]\n'
                    + "".join(f'"{k}" = "{v}"\n' for k, v in hf_workers.TITAN_SPLIT_WO_ONLY.items())
                    + '\n[[plugins]]\nname = "meta_init"\n')
    done = subprocess.run(
        [sys.executable, "-m", "composer_par.cli", "validate", str(plan), "--world-size",
         str(WORLD), "--model", "tests.hf_workers:titan_llama3_fused", "--rank", "0",
         "--json"], capture_output=True, text=True, cwd=ROOT, timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr[-2000:]
    data = json.loads(done.stdout)
    forward = data["dry_run"]["ranks"][0]["forward"]
    assert forward["status"] == "failed" and "reduction dim" in forward["detail"]
