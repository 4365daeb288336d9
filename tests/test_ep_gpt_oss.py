"""EP trains gpt-oss exactly like a single process: its experts' biases, transposed and
interleaved weights and clamped SwiGLU go through EP's dispatch untouched (the module's
own forward runs on the received pairs with this rank's slice of every per-expert
tensor, the 2-D biases included), under transformers' default grouped-mm kernel and the
class's own per-expert loop.

Every rank's view of every parameter is compared with the reference; the loss includes
the router's auxiliary loss (``reference="accumulate"``: the reference computes it per
data shard, as each rank does).
"""

from __future__ import annotations

import pytest

from composer_par import EP, MeshSpec, MetaInit, ParallelPlan, Topology
from composer_par.testing.parity import ParityCase, check_parity
from tests.test_ep import FSDP2_EP, ep_plan

WORKERS = "tests.ep_gpt_oss_workers"


def _parity(task: str, plan: str, world: int) -> None:
    case = ParityCase(task=f"{WORKERS}:{task}", plan=plan, world_size=world, steps=3,
                      lr=0.5, reference="accumulate")
    result = check_parity(case)
    result.assert_close()
    assert len(set(result.losses)) == len(result.losses), result.losses  # it trained


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["gpt_oss", "gpt_oss_eager"])
def test_ep_trains_gpt_oss_like_one_process(task: str) -> None:
    """ep(2): two of four experts per rank, their biases with them."""
    _parity(task, ep_plan(2), 2)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ep_with_fsdp2_trains_gpt_oss_like_one_process() -> None:
    """dp_shard(2) x ep(2): the dense layers (attention sinks, the router's weight and
    bias) over all four ranks, the experts and their biases over dp_shard per ep rank."""
    _parity("gpt_oss", FSDP2_EP, 4)


def test_ep_finds_gpt_oss_experts_with_their_biases() -> None:
    """The 2-D biases are split per expert with the 3-D weights; the width a token moves
    is the hidden size although the weights are stored [experts, in, out]."""
    import torch
    import transformers
    from composer_par.plugins.ep import find_experts

    from tests.ep_gpt_oss_workers import config

    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config())
    sites = find_experts(model)
    assert [(s.path, s.num_experts, s.hidden) for s in sites] == [
        (f"model.layers.{i}.mlp.experts", 4, 64) for i in range(2)]
    assert {s.names for s in sites} == {
        ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    spread = ParallelPlan(MeshSpec(ep=4), topology=Topology(nodes=2, devices_per_node=2))
    found = spread.use(EP()).use(MetaInit()).validate(model).findings
    cp803 = [f for f in found if f.code == "CP803"]
    # 4 passes x hidden 64 (not the 96 of gate_up_proj's last dim) x 4 bytes x 2 blocks
    # x 3/4 of the pairs leaving the rank.
    assert len(cp803) == 1 and "1,536 bytes per step" in cp803[0].message
