"""EP (expert parallelism) trains exactly like a single process, on the MoE Llama and on
Hugging Face MoE families, and its rules (CP801-CP803) name what is wrong.

Every rank's view of every parameter (the experts' full_tensor() included) is compared
with the reference; the loss includes the router's auxiliary load-balancing loss, whose
per-shard value the reference computes per micro-batch (``reference="accumulate"``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_par import EP, FSDP2, MeshSpec, MetaInit, ParallelPlan, Topology
from composer_par.plugin import FoldedDim
from composer_par.testing.parity import ParityCase, check_parity

WORKERS = "tests.ep_workers"


def ep_plan(ep: int, *, mesh: str = "", plugins: str = "") -> str:
    return f"""
[mesh]
{mesh}
ep = {ep}

[[plugins]]
name = "ep"
{plugins}

[[plugins]]
name = "meta_init"
seed = 7
"""


def _parity(task: str, plan: str, world: int, steps: int = 3) -> None:
    case = ParityCase(task=f"{WORKERS}:{task}", plan=plan, world_size=world, steps=steps,
                      lr=0.5, reference="accumulate")
    result = check_parity(case)
    result.assert_close()
    # Vacuous if nothing trained: the losses move (DeepSeek-V3's tiny model does not
    # fall in three steps at this rate; it moves).
    if task == "deepseek_v3":
        assert len(set(result.losses)) == len(result.losses), result.losses
    else:
        assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("task", "world"), [
    ("moe_llama_shared", 4),  # 8 experts, 2 per rank, and a shared expert
    ("moe_llama_forced", 2),  # every token to experts 0 and 1: rank 1 receives nothing
    ("mixtral", 2),
    ("qwen3_moe", 4),
    ("qwen2_moe", 2),  # a gated shared expert beside the routed ones
    ("olmoe", 2),
    ("deepseek_v3", 2),  # grouped routing with a correction bias, a shared expert
])
def test_ep_matches_single_process(task: str, world: int) -> None:
    _parity(task, ep_plan(world), world)


FSDP2_EP = ep_plan(2, mesh="dp_shard = 2", plugins="") + """
[[plugins]]
name = "fsdp2"
"""


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["moe_llama_shared", "mixtral"])
def test_ep_with_fsdp2_matches_single_process(task: str) -> None:
    """dp_shard(2) x ep(2): the dense layers sharded over all four ranks, the experts
    over the two dp_shard ranks of their ep rank, their gradients divided by four."""
    _parity(task, FSDP2_EP, 4)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ep_with_fsdp2_shards_experts_apart() -> None:
    """torchtitan's arrangement, through the composer_par_shard_apart hook: experts
    Shard(0) over ep (2 of 4 experts) then over dp_shard (1 each); dense weights over
    dp_shard x ep flattened."""
    from composer_par.testing import run_ranks

    for view in run_ranks(f"{WORKERS}:layouts", 4, args=(FSDP2_EP,)):
        assert view["expert"] == (("dp_shard", "ep"), ("_S(0, 2)", "S(0)"), (1, 32, 32))
        assert view["dense"] == (("dp_shard_ep",), ("S(0)",), (8, 32))


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_checkpoint_saved_under_ep_x_fsdp2_loads_into_ep_and_one_process(
        tmp_path: Path) -> None:
    """Saved under dp_shard(2) x ep(2) after two AdamW steps; loaded into EP 2 and into
    one process: model and optimizer state bitwise, in every rank's view."""
    from composer_par.testing import run_ranks
    from tests.test_checkpoint_dist import agreed, assert_every_rank_bitwise

    root = str(tmp_path / "fsdp2_ep")
    saved = agreed(run_ranks(f"{WORKERS}:save_trained", 4, args=("fsdp2_ep_2x2", root),
                             timeout=300), "saved")
    assert any(k.endswith("moe.experts.w1.exp_avg") for k in saved)  # optimizer state
    for layout, world in (("ep_2", 2), ("one_process", 1)):
        views = run_ranks(f"{WORKERS}:load_saved", world, args=(layout, root), timeout=300)
        assert_every_rank_bitwise(saved, views, f"fsdp2_ep_2x2 -> {layout}")


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("task", ["moe_llama", "moe_llama_forced", "mixtral", "qwen3_moe"])
def test_ep_with_activation_checkpointing_matches_single_process(task: str,
                                                                 mode: str) -> None:
    """Full checkpointing's recomputation in backward issues the block's all-to-alls
    again; selective checkpointing hands it their saved outputs (a rank that received
    nothing among them): every rank's parameters as in one process."""
    _parity(task, ep_plan(2, plugins='[[plugins]]\nname = "activation_checkpoint"\n'
                                     f'mode = "{mode}"'), 2)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ep_with_tp_matches_single_process() -> None:
    """ep(2) x tp(2): attention split over tp, experts over ep (whole on both tp ranks,
    which read the same samples). replicate_rest=false: the norms and the router stay
    plain tensors (with it on, its default: tests/test_ep_tp.py)."""
    plan = ep_plan(2, plugins='[[plugins]]\nname = "tp"\nreplicate_rest = false')
    _parity("moe_llama", plan.replace("ep = 2", "ep = 2\ntp = 2"), 4)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["moe_llama", "mixtral", "qwen3_moe"])
def test_ep_with_hsdp_alone_matches_single_process(task: str) -> None:
    """dp_replicate(2) x ep(2), HSDP alone: the dense layers replicated over both dims,
    the experts (shard apart) over dp_replicate only, their gradients divided by four."""
    plan = ep_plan(2, mesh="dp_replicate = 2", plugins='[[plugins]]\nname = "hsdp"')
    _parity(task, plan, 4)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_routing_stats_count_tokens_per_expert_and_per_ep_rank() -> None:
    """Every token of the global batch (8 x 8) to experts 0 and 1, both on rank 0: each
    receives 64 pairs, rank 0 computes 128 and rank 1 none; every rank reports the same."""
    from composer_par.testing import run_ranks

    views = run_ranks(f"{WORKERS}:routing_after_one_step", 2)
    expected = [{"module": f"layers.{i}.moe.experts", "tokens_per_expert": (64, 64, 0, 0),
                 "rank_min": 0, "rank_mean": 64.0, "rank_max": 128, "dropped": 0}
                for i in range(2)]
    assert views == [expected, expected]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_capacity_factor_drops_the_pairs_beyond_capacity_cp804() -> None:
    """capacity_factor = 1: each rank sends each expert at most 64 pairs / 4 experts = 16;
    of its 32 pairs for each of experts 0 and 1 it drops 16 (64 over both ranks)."""
    from composer_par.testing import run_ranks

    views = run_ranks(f"{WORKERS}:routing_after_one_step", 2,
                      args=("capacity_factor = 1.0",))
    expected = [{"module": f"layers.{i}.moe.experts", "tokens_per_expert": (32, 32, 0, 0),
                 "rank_min": 0, "rank_mean": 32.0, "rank_max": 64, "dropped": 64}
                for i in range(2)]
    assert views == [expected, expected]
    found = ParallelPlan(MeshSpec(ep=2)).use(EP(capacity_factor=1.25)).use(MetaInit()) \
        .validate(_moe(), world_size=2).findings  # type: ignore[arg-type]
    cp804 = [f for f in found if f.code == "CP804"]
    assert len(cp804) == 1 and cp804[0].severity.value == "info"
    assert "capacity_factor=1.25" in cp804[0].message
    assert "CP804" not in ParallelPlan(MeshSpec(ep=2)).use(EP()).use(MetaInit()).validate(
        _moe(), world_size=2).codes()  # type: ignore[arg-type]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_hugging_face_weights_out_of_and_into_ep(tmp_path: Path) -> None:
    """Mixtral exported from dp_shard(2) x ep(2) is what from_pretrained loads exactly;
    LoadSafetensors reads it back into ep(2) bitwise, each rank less than the file (its
    own experts, not the others')."""
    import torch
    import transformers

    from composer_par.testing import run_ranks
    from tests import hf_workers
    from tests.ep_workers import MOE_CONFIG
    from tests.test_checkpoint_dist import agreed, assert_every_rank_bitwise

    directory = tmp_path / "mixtral"
    saved = agreed(run_ranks(f"{WORKERS}:export_mixtral", 4,
                             args=("fsdp2_ep_2x2", str(directory)), timeout=300), "exported")
    hf_workers.config("mixtral", **MOE_CONFIG["mixtral"]).save_pretrained(directory)
    theirs = transformers.MixtralForCausalLM.from_pretrained(directory).state_dict()
    assert_every_rank_bitwise(saved, [{f"model.{k}": v for k, v in theirs.items()}],
                              "from_pretrained")
    file_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    views = run_ranks(f"{WORKERS}:load_mixtral", 2, args=("ep_2", str(directory)),
                      timeout=300)
    experts = sum(v.numel() * v.element_size() for k, v in saved.items() if "experts" in k)
    for view in views:
        # Each ep rank reads its half of the experts (and every dense weight) only.
        assert 0 < view.pop("bytes_read") <= file_bytes - experts // 2
    assert_every_rank_bitwise(saved, views, "LoadSafetensors into ep(2)")
    assert all(isinstance(v, torch.Tensor) for v in saved.values())


# -- the plugin's answers, no processes --------------------------------------------------


def _moe(num_experts: int = 4) -> object:
    import torch

    from composer_par.models.moe_llama import MoELlama, MoELlamaConfig

    with torch.device("meta"):
        return MoELlama(MoELlamaConfig(num_experts=num_experts))


def test_ep_folds_its_dim_into_data_parallelism() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=2, ep=2)).use(FSDP2()).use(EP()).use(MetaInit())
    assert plan.folded_dims() == [FoldedDim("ep", distinct_samples=True)]
    assert plan.data_parallel_dims() == ["dp_shard", "ep"]
    # Rank 1 is (dp_shard 0, ep 1): the second of four data shards.
    assert plan.data_shard(1, 4) == (1, 4)


def test_ep_finds_the_experts_of_the_moe_llama_and_hugging_face() -> None:
    from composer_par.plugins.ep import find_experts

    from tests import hf_workers

    sites = find_experts(_moe())  # type: ignore[arg-type]
    assert [(s.path, s.num_experts, s.names) for s in sites] == [
        (f"layers.{i}.moe.experts", 4, ("w1", "w3", "w2")) for i in range(2)]
    for family in ("mixtral", "qwen3_moe"):
        sites = find_experts(hf_workers.build(family))
        assert [s.path for s in sites] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
        assert {s.names for s in sites} == {("gate_up_proj", "down_proj")}


def test_cp801_experts_that_ep_does_not_divide() -> None:
    plan = ParallelPlan(MeshSpec(ep=4)).use(EP()).use(MetaInit())
    found = plan.validate(_moe(6), world_size=4).findings  # type: ignore[arg-type]
    cp801 = [f for f in found if f.code == "CP801"]
    assert len(cp801) == 2 and all(f.severity.value == "error" for f in cp801)
    assert "layers.0.moe.experts holds 6 experts" in cp801[0].message
    assert "[1, 2, 3, 6]" in (cp801[0].fix or "")
    assert not [f for f in plan.validate(_moe(8), world_size=4).findings  # type: ignore[arg-type]
                if f.code == "CP801"]


def test_cp802_a_model_without_experts() -> None:
    import torch

    from composer_par.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        dense = Llama(LlamaConfig())
    found = ParallelPlan(MeshSpec(ep=2)).use(EP()).use(MetaInit()).validate(
        dense, world_size=2).findings
    assert [f.code for f in found if f.plugin == "ep"] == ["CP802"]
    assert "Llama has no experts module" in found[0].message


def test_cp803_ep_across_nodes_warns_with_the_bytes() -> None:
    spread = ParallelPlan(MeshSpec(ep=4), topology=Topology(nodes=2, devices_per_node=2))
    found = spread.use(EP()).use(MetaInit()).validate(_moe()).findings  # type: ignore[arg-type]
    cp803 = [f for f in found if f.code == "CP803"]
    assert len(cp803) == 1 and cp803[0].severity.value == "warning"
    # The core's CP302 (an error for a model-parallel dim across nodes) leaves ep to EP.
    assert "CP302" not in {f.code for f in found}
    # 4 passes x hidden 64 x 4 bytes x 2 blocks x 3/4 of the pairs leaving the rank.
    assert "1,536 bytes per step" in cp803[0].message
    inside = ParallelPlan(MeshSpec(ep=2), topology=Topology(nodes=1, devices_per_node=2))
    assert not [f for f in inside.use(EP()).use(MetaInit()).validate(_moe()).findings  # type: ignore[arg-type]
                if f.code == "CP803"]


def test_ep_answers_the_composition_hooks() -> None:
    """composer_par_folded_dims: ep, read by data parallelism; composer_par_shard_apart:
    nothing before EP dispatches (the experts it answers are those it sharded)."""
    plugin = EP(dim="experts")
    assert plugin.composer_par_folded_dims() == [FoldedDim("experts", distinct_samples=True)]
    assert plugin.composer_par_shard_apart(_moe()) == []  # type: ignore[arg-type]


def test_ep_in_a_plan_file_round_trips_and_explains() -> None:
    text = ep_plan(2, mesh="dp_shard = 2", plugins="capacity_factor = 1.5") \
        + '\n[[plugins]]\nname = "fsdp2"\n'
    plan = ParallelPlan.from_toml(text)
    assert ParallelPlan.from_toml(plan.to_toml()).to_toml() == plan.to_toml()
    assert 'capacity_factor = 1.5' in plan.to_toml()
    explained = str(plan.explain())
    assert "num_experts / ep(2) whole experts" in explained
    assert "capacity factor 1.5" in explained
    with pytest.raises(ValueError, match="capacity_factor must be a number > 0"):
        EP(capacity_factor=0)
