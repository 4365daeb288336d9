"""EP composed with TP on 4 ranks (ep 2 x tp 2), at parity with one process: losses with
the router's aux loss and every rank's full parameters; and expert tensor parallelism
(``EP(expert_tp=True)``: each expert split over tp), with its rules CP805 and CP806.

The dense layers follow TP's plan (the MoE Llama's Llama names; Mixtral's own
transformers tp plan) with ``replicate_rest`` on, its default: the router's weight is a
replicated DTensor. EP runs first in the stage; TP leaves the experts modules it finds
already distributed as they are (Mixtral's tp plan would otherwise split their weights
and sum their outputs over tp, and replicate_rest would hand their forward DTensors).
"""

from __future__ import annotations

import pytest

from composer_par.testing.parity import ParityCase, check_parity
from tests.test_ep import ep_plan

EP_WORKERS = "tests.ep_workers"
ETP = "expert_tp = true"


def ep_tp_plan(ep_options: str = "") -> str:
    """ep(2) x tp(2), EP (with ``ep_options``, plan-file lines) listed before TP."""
    plan = ep_plan(2, plugins=ep_options + '\n[[plugins]]\nname = "tp"\n')
    return plan.replace("ep = 2", "ep = 2\ntp = 2")


def _parity(task: str, plan: str) -> None:
    case = ParityCase(task=task, plan=plan, world_size=4, steps=3, lr=0.5,
                      reference="accumulate")
    result = check_parity(case)
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["moe_llama_shared", "mixtral", "qwen3_moe"])
def test_ep_with_tp_and_its_replicated_rest_matches_single_process(task: str) -> None:
    """Experts whole on both tp ranks of their ep rank; attention split over tp."""
    _parity(f"{EP_WORKERS}:{task}", ep_tp_plan())


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_tp_before_ep_is_refused_naming_the_order() -> None:
    """TP first would have replicated the experts over tp: EP refuses them, saying to
    list ep first."""
    from composer_par.testing import RankFailure, run_ranks

    plan = ep_tp_plan()
    tp_first = plan.replace('[[plugins]]\nname = "ep"\n', "").replace(
        '[[plugins]]\nname = "tp"\n', '[[plugins]]\nname = "tp"\n\n[[plugins]]\nname = "ep"\n')
    assert tp_first.index('"tp"') < tp_first.index('"ep"')
    with pytest.raises(RankFailure, match="List ep before the other model-parallel plugins"):
        run_ranks("tests.ep_tp_workers:apply_plan", 4, args=(tp_first,), timeout=100)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", [
    "tests.ep_workers:moe_llama_shared",
    "tests.ep_workers:mixtral",  # [gate; up] concatenated: each tp rank its part of both
    # Transposed weights, gate and up interleaved, biases: the down projection's is
    # whole on both tp ranks and added once to the sum of the partial outputs.
    "tests.ep_gpt_oss_workers:gpt_oss",
])
def test_expert_tensor_parallelism_matches_single_process(task: str) -> None:
    """Each ep rank's experts split over tp; their partial outputs summed over tp."""
    _parity(task, ep_tp_plan(ETP))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_expert_tensor_parallelism_splits_each_expert_over_tp() -> None:
    """Mixtral's experts: Shard(0) over ep (2 of 4 experts), then gate_up_proj [experts,
    2 x 128, 64] column-wise in both halves (strided), down_proj [experts, 64, 128]
    row-wise."""
    from composer_par.testing import run_ranks

    for view in run_ranks("tests.ep_tp_workers:layouts", 4, args=(ep_tp_plan(ETP), "mixtral")):
        assert view == {
            "gate_up_proj": (("ep", "tp"), ("S(0)", "_S(1, 2)"), (2, 128, 64)),
            "down_proj": (("ep", "tp"), ("S(0)", "S(2)"), (2, 64, 64)),
        }, view


# -- the option and its rules, no processes ------------------------------------------------


def _moe(expert_hidden: int = 32) -> object:
    import torch

    from composer_par.models.moe_llama import MoELlama, MoELlamaConfig

    with torch.device("meta"):
        return MoELlama(MoELlamaConfig(num_experts=4, expert_hidden=expert_hidden))


def _etp_plan(**mesh: int) -> object:
    from composer_par import EP, TP, MeshSpec, MetaInit, ParallelPlan

    plan = ParallelPlan(MeshSpec(**mesh)).use(EP(expert_tp=True))
    if "tp" in mesh:
        plan.use(TP())
    return plan.use(MetaInit())


def test_cp805_an_intermediate_size_tp_does_not_divide() -> None:
    found = _etp_plan(ep=2, tp=2).validate(_moe(33), world_size=4).findings  # type: ignore[attr-defined]
    cp805 = [f for f in found if f.code == "CP805"]
    assert len(cp805) == 2 and all(f.severity.value == "error" for f in cp805)
    assert "layers.0.moe.experts's experts have intermediate size 33" in cp805[0].message
    assert "make tp one of [1, 3, 11, 33]" in (cp805[0].fix or "")
    assert "CP805" not in _etp_plan(ep=2, tp=2).validate(  # type: ignore[attr-defined]
        _moe(32), world_size=4).codes()


def test_cp806_no_tp_dim_or_experts_it_cannot_split() -> None:
    found = _etp_plan(ep=2).validate(_moe(), world_size=2).findings  # type: ignore[attr-defined]
    cp806 = [f for f in found if f.code == "CP806"]
    assert len(cp806) == 1 and "expert_tp names mesh dim 'tp', which the mesh" in cp806[0].message

    model = _moe()
    for layer in model.layers:  # type: ignore[attr-defined]
        experts = layer.moe.experts
        experts.register_parameter("w4", experts._parameters.pop("w3"))
    found = _etp_plan(ep=2, tp=2).validate(model, world_size=4).findings  # type: ignore[attr-defined]
    cp806 = [f for f in found if f.code == "CP806"]
    assert len(cp806) == 2 and "holds w1, w2, w4" in cp806[0].message
    assert "leave expert_tp unset" in (cp806[0].fix or "")


def test_expert_tp_option_round_trips_and_explains() -> None:
    from composer_par import EP, ParallelPlan

    assert EP(expert_tp=True).expert_tp == "tp"
    assert EP(expert_tp="model").expert_tp == "model"
    assert EP(expert_tp=False).expert_tp is None and EP().expert_tp is None
    with pytest.raises(ValueError, match="expert_tp must be true"):
        EP(expert_tp=2)
    plan = ParallelPlan.from_toml(ep_tp_plan(ETP))
    assert 'expert_tp = "tp"' in plan.to_toml()
    assert ParallelPlan.from_toml(plan.to_toml()).to_toml() == plan.to_toml()
    assert "each expert split over tp (gate/up column-wise, down row-wise)" in str(
        plan.explain())


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("task", "ep_options"), [
    pytest.param("tests.ep_workers:moe_llama_shared", "", id="moe_llama"),
    pytest.param("tests.ep_workers:mixtral", "", id="mixtral"),
    pytest.param("tests.ep_workers:mixtral", ETP, id="mixtral_expert_tp"),
])
def test_fsdp2_with_ep_and_tp_on_eight_ranks_matches_single_process(
        task: str, ep_options: str) -> None:
    """dp_shard 2 x ep 2 x tp 2: FSDP2 shards the dense layers over dp_shard x ep (TP's
    parts within each), the experts over dp_shard; each expert whole or split over tp."""
    plan = ep_tp_plan(ep_options).replace("ep = 2", "dp_shard = 2\nep = 2") + (
        '\n[[plugins]]\nname = "fsdp2"\n')
    case = ParityCase(task=task, plan=plan, world_size=8, steps=3, lr=0.5,
                      reference="accumulate")
    result = check_parity(case)
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fsdp2_splits_packed_expert_tp_halves_on_a_dim_of_their_own() -> None:
    """Mixtral's gate_up_proj under dp_shard 2 x ep 2 x tp 2 with expert_tp: the [gate;
    up] halves strided over tp, so FSDP2 takes the hidden dim (a second strided placement
    on the experts' dim is one torch cannot gather); down_proj as elsewhere."""
    from composer_par.testing import run_ranks

    plan = ep_tp_plan(ETP).replace("ep = 2", "dp_shard = 2\nep = 2") + (
        '\n[[plugins]]\nname = "fsdp2"\n')
    for view in run_ranks("tests.ep_tp_workers:layouts", 8, args=(plan, "mixtral")):
        assert view["gate_up_proj"] == (("dp_shard", "ep", "tp"),
                                        ("S(2)", "S(0)", "_S(1, 2)"), (2, 128, 32))
        assert view["down_proj"] == (("dp_shard", "ep", "tp"),
                                     ("_S(0, 2)", "S(0)", "S(2)"), (1, 64, 64))



@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sequence_parallelism_beside_ep_is_refused_naming_the_experts() -> None:
    """With sequence_parallel the experts would receive sequence-split DTensors: TP
    refuses at apply, naming the modules EP distributed, rather than fail in the first
    forward inside DTensor's dispatch."""
    from composer_par.testing import RankFailure, run_ranks

    plan = ep_tp_plan().replace('name = "tp"\n', 'name = "tp"\nsequence_parallel = true\n')
    with pytest.raises(RankFailure, match=r"sequence_parallel = true with module\(s\) "
                       r"another plugin distributed already \(layers\.0\.moe\.experts"):
        run_ranks("tests.ep_tp_workers:apply_plan", 4, args=(plan, "moe_llama"), timeout=100)
