"""The demo and examples/train.py train the mixture-of-experts Llama under expert
parallelism and report each step's routing: tokens per expert and per ep rank
(min/mean/max) and the tokens dropped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"
MODULES = [f"layers.{i}.moe.experts" for i in range(4)]


def _check_routing(step: dict[str, Any], pairs: int, ep: int) -> None:
    """One step's routing summary of rank 0's ep group, which routed ``pairs`` (token,
    slot) pairs through each experts module: consistent with its modules' counts."""
    assert [m["module"] for m in step["modules"]] == MODULES
    counts = [n for m in step["modules"] for n in m["tokens_per_expert"]]
    assert all(sum(m["tokens_per_expert"]) == pairs for m in step["modules"])
    assert (step["expert_min"], step["expert_max"]) == (min(counts), max(counts))
    assert step["expert_mean"] == pairs / 8 and step["rank_mean"] == pairs / ep
    assert step["rank_min"] == min(m["rank_min"] for m in step["modules"])
    assert step["rank_max"] == max(m["rank_max"] for m in step["modules"])
    assert step["rank_min"] <= step["rank_mean"] <= step["rank_max"]
    assert step["dropped"] == 0  # dropless


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_demo_trains_the_moe_llama_under_fsdp2_x_ep_and_reports_routing(
        tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "composer_par.cli", "demo", "--model", "moe-llama", "--json",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--seq-len", "16", "--steps", "2"],
        capture_output=True, text=True, timeout=360, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(result.stdout)
    assert data["ok"] is True and len(data["losses"]) == 2
    assert data["losses"][-1] < data["losses"][0]  # the aux loss included, it trains
    assert 'name = "ep"' in data["plan"]  # the default plan of the model: fsdp2 x ep 2 x 2
    assert [s["step"] for s in data["routing"]] == [1, 2]
    for step in data["routing"]:
        # Rank 0's ep group: 2 of the 4 data shards, 2 sequences of 16 tokens each, top-2.
        _check_routing(step, pairs=2 * 2 * 16 * 2, ep=2)
        assert step["text"] == (
            f"tokens per expert min/mean/max {step['expert_min']}/16.0/"
            f"{step['expert_max']}, per ep rank {step['rank_min']}/64.0/{step['rank_max']}, "
            "dropped 0")
    # The routers' losses, kept past a step, used to hold the model and its process groups.
    assert "still running at exit" not in result.stderr, result.stderr[-4000:]


def test_demo_refuses_an_ep_plan_for_the_dense_llama_before_any_process(
        tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "composer_par.cli", "demo", "--plan",
         str(EXAMPLES / "plans" / "fsdp_ep.toml"), "--checkpoint-dir", str(tmp_path / "c")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-4000:]
    assert "CP802" in result.stderr and "Llama has no experts module" in result.stderr
    assert not (tmp_path / "c").exists()  # nothing started


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_py_trains_the_moe_llama_and_logs_routing_each_step(tmp_path: Path) -> None:
    """fsdp_ep.toml plus activation checkpointing (its recomputation runs the routers
    again inside backward); the log is JSON lines off a terminal."""
    plan = tmp_path / "plan.toml"
    plan.write_text((EXAMPLES / "plans" / "fsdp_ep.toml").read_text()
                    + '\n[[plugins]]\nname = "activation_checkpoint"\n')
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "4", str(EXAMPLES / "train.py"), str(plan), "--model", "moe-llama", "--seq-len",
         "16", "--micro-batch", "2", "--steps", "2"],
        capture_output=True, text=True, cwd=tmp_path, timeout=240,
        env={**os.environ, "COMPOSER_PAR_TRAIN_SHOW_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    events = [json.loads(line) for line in (result.stdout + result.stderr).splitlines()
              if line.startswith("{")]
    routing = [e for e in events if e["event"] == "ep routing"]
    summaries = [e for e in routing if "module" not in e]
    assert [e["step"] for e in summaries] == [1, 2]
    # Each module's counts at the last step (and every tenth), after the step's summary.
    last = dict(summaries[-1], modules=[e for e in routing if "module" in e])
    assert all(m["step"] == 2 for m in last["modules"])
    # 2 data shards per ep group, 2 sequences each of 16 tokens, top-2.
    _check_routing(last, pairs=2 * 2 * 16 * 2, ep=2)
    assert any(e["event"] == "step" and e["step"] == 2 for e in events)
    for rank in range(4):
        assert f"rank {rank}: threads at exit: python ['MainThread'], native []" in \
            result.stderr, result.stderr[-4000:]


def test_routing_summary_folds_the_modules_of_a_step() -> None:
    from composer_par.plugins.ep.stats import RoutingStats, RoutingSummary

    stats = [RoutingStats("a", (4, 0, 2, 2), 4, 4.0, 4),
             RoutingStats("b", (1, 3, 3, 1), 2, 4.0, 6, dropped=3)]
    summary = RoutingSummary.of(stats, step=7)
    assert (summary.expert_min, summary.expert_mean, summary.expert_max) == (0, 2.0, 4)
    assert (summary.rank_min, summary.rank_mean, summary.rank_max) == (2, 4.0, 6)
    assert summary.dropped == 3 and summary.step == 7
    assert summary.format() == ("tokens per expert min/mean/max 0/2.0/4, per ep rank "
                                "2/4.0/6, dropped 3")
    assert summary.as_dict()["modules"][1] == stats[1].as_dict()
    with pytest.raises(ValueError, match="no experts module was dispatched"):
        RoutingSummary.of([])


def test_the_moe_llama_hands_its_aux_loss_out_once_and_keeps_none_from_a_recompute(
        ) -> None:
    """A block that kept its loss past the step kept the loss's autograd graph, and under
    FSDP2 the model and its process groups through it (the thread checks above)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from composer_par.models.moe_llama import MoE, MoELlama, moe_loss
    from tests.ep_workers import moe_llama

    torch.manual_seed(0)
    model: MoELlama = moe_llama.build()
    moe_loss(model, moe_llama.batch(0)).backward()
    assert all(m.aux_loss is None for m in model.modules() if isinstance(m, MoE))
    with pytest.raises(RuntimeError, match="no router run since the last aux_loss"):
        model.aux_loss()
    # Recomputed inside backward, a block computes its loss (recomputation must save
    # what the forward saved) and keeps none of it.
    block = model.layers[0]
    out = checkpoint(block, torch.randn(2, 8, 32, requires_grad=True), use_reentrant=False)
    loss = block.moe.aux_loss
    assert loss is not None
    block.moe.aux_loss = None
    (out.sum() + loss).backward()
    assert block.moe.aux_loss is None
