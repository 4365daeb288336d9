"""The reduction check of ``validate --model`` (and of selfcheck's first rung): one forward
on fake tensors in which every tensor is typed per mesh dim (invariant, replicated,
varying, partial), so that a gradient needing a sum over a dim that gets none, or one
summed twice, is named with the parameter and the dim before launch (CP434).

The defects: DeepSeek-V2's latent-attention projection left whole beside split heads
(what TP's auto plan did with ``mla_kv_a_proj`` before it applied the style: written out
here as an explicit plan), which trains wrong on real gloo ranks; and a hand-planted one,
Qwen3's per-head norms declared replicated (``replicate``) while they run on this rank's
heads (tests/test_hf_models.py trains it: they drift apart across the tp ranks). Correct
plans, MoE and sequence parallel among them, pass: no false alarm.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from composer_par import ParallelPlan
from composer_par.tools.dryrun import dry_run, format_result

ROOT = Path(__file__).resolve().parent.parent
INIT = '\n[[plugins]]\nname = "meta_init"\nseed = 7\n'

# DeepSeek-V2's heads split, its kv_a_proj_with_mqa left to replicate_rest.
LATENT_LEFT_WHOLE = ('[mesh]\ntp = 2\n\n[[plugins]]\nname = "tp"\n[plugins.plan]\n'
                     '"model.layers.*.self_attn.q_proj" = "colwise"\n'
                     '"model.layers.*.self_attn.kv_b_proj" = "colwise"\n'
                     '"model.layers.*.self_attn.o_proj" = "rowwise"\n' + INIT)
# Qwen3's attention split, its q_norm/k_norm (on each rank's heads) declared replicated.
NORMS_REPLICATED = ('[mesh]\ntp = 2\n\n[[plugins]]\nname = "tp"\n[plugins.plan]\n'
                    '"model.embed_tokens" = "embedding_rowwise"\n'
                    + "".join(f'"model.layers.*.self_attn.{p}_proj" = "colwise"\n'
                              for p in "qkv")
                    + '"model.layers.*.self_attn.o_proj" = "rowwise"\n'
                    '"model.layers.*.self_attn.q_norm" = "replicate"\n'
                    '"model.layers.*.self_attn.k_norm" = "replicate"\n'
                    '"lm_head" = "colwise_gather"\n' + INIT)


TP = '[mesh]\ntp = 2\n\n[[plugins]]\nname = "tp"\n' + INIT
V2, V3 = "tests.ep_workers:deepseek_v2_model", "tests.ep_workers:deepseek_v3_model"


def _problems(plan: str, model: str, world: int = 2) -> list[str]:
    result = dry_run(ParallelPlan.from_toml(plan), model, world_size=world)
    assert all(r.failure is None for r in result.ranks), format_result(result)
    assert all(r.forward and r.forward[0] == "ran" for r in result.ranks), format_result(result)
    return [m for r in result.ranks for m in r.reductions]


def test_a_latent_projection_left_whole_beside_split_heads_is_named() -> None:
    found = _problems(LATENT_LEFT_WHOLE, V2)
    missing = [m for m in found if "kv_a_proj_with_mqa.weight: gradient needs a sum over "
               "tp and gets none" in m]
    # Both layers, on both ranks.
    assert len(missing) == 4, found
    assert all(m.startswith("ERROR CP434: rank ") for m in found)
    # The norm on the latent, guessed a neighbour of the split heads by the explicit plan
    # and given summed gradients, is summed twice.
    assert any("kv_a_layernorm.weight: gradient is summed over tp twice" in m for m in found)


def test_a_planted_missing_reduction_is_named() -> None:
    from torch.distributed.tensor import DTensor

    found = _problems(NORMS_REPLICATED, "tests.hf_workers:qwen3")
    # DTensor's boundaries are given back as they were (from_local a staticmethod).
    assert isinstance(DTensor.__dict__["from_local"], staticmethod)
    assert {m.split(": ")[2] for m in found} == {
        f"model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in "qk"}
    assert all("gradient needs a sum over tp and gets none" in m for m in found)


@pytest.mark.parametrize(("plan", "model", "world"), [
    # TP's own plan for latent attention (mla_kv_a_proj applied), alone and with FSDP2.
    (TP, V2, 2),
    ('[mesh]\ndp_shard = 2\ntp = 2\n\n[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\n'
     'name = "tp"\n' + INIT, V2, 4),
    (TP, V3, 2),
    # Qwen3's own plan: its per-head norms get their gradient summed.
    (TP, "tests.hf_workers:qwen3", 2),
    # Experts split over tp (local styles) and a grouped-mm MoE.
    (TP, "tests.hf_workers:mixtral", 2),
    # Sequence parallel: a residual stream of DTensors.
    ('[mesh]\ntp = 2\n\n[[plugins]]\nname = "tp"\nsequence_parallel = true\n' + INIT,
     "tests.hf_workers:gemma3", 2),
    # HSDP x FSDP2 and FSDP2 x context parallel.
    ('[mesh]\ndp_replicate = 2\ndp_shard = 2\n\n[[plugins]]\nname = "hsdp"\n\n'
     '[[plugins]]\nname = "fsdp2"\n' + INIT, "tests.hf_workers:llama", 4),
    ('[mesh]\ndp_shard = 2\ncp = 2\n\n[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\n'
     'name = "cp"\n' + INIT, "tests.selfcheck_models:llama", 4),
])
def test_correct_plans_raise_no_false_alarm(plan: str, model: str, world: int) -> None:
    assert _problems(plan, model, world) == []


def test_validate_model_refuses_with_the_parameter_and_the_dim(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(NORMS_REPLICATED)
    done = subprocess.run(
        [sys.executable, "-m", "composer_par.cli", "validate", str(path), "--model",
         "tests.hf_workers:qwen3", "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    doc = json.loads(done.stdout)
    found = [m for r in doc["dry_run"]["ranks"] for m in r["reductions"]]
    assert any("model.layers.0.self_attn.q_norm.weight: gradient needs a sum over tp" in m
               for m in found), found
    text = subprocess.run(
        [sys.executable, "-m", "composer_par.cli", "validate", str(path), "--model",
         "tests.hf_workers:qwen3"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert text.returncode == 1
    assert "gradient reductions: 4 problem(s)" in text.stdout
    assert "ERROR CP434: rank 0: model.layers.0.self_attn.q_norm.weight" in text.stdout


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_latent_projection_left_whole_trains_wrong_on_real_ranks() -> None:
    """What the check names is real: on two gloo ranks the plan that leaves DeepSeek-V2's
    kv_a_proj_with_mqa whole beside split heads leaves the single-process reference."""
    from composer_par.testing.parity import ParityCase, check_parity

    case = ParityCase(task="tests.ep_workers:deepseek_v2", plan=LATENT_LEFT_WHOLE,
                      world_size=2, steps=3, lr=0.5, reference="accumulate")
    result = check_parity(case, timeout=400)
    with pytest.raises(AssertionError, match="differ"):
        result.assert_close()
