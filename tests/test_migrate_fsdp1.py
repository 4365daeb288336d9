"""FSDP1's Python arguments -- torch's own ShardingStrategy, wrap policies, MixedPrecision
and CPUOffload -- as a plan: ``composer_par.migrate.fsdp1_plan``."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from composer_par.migrate import ImportFailed, fsdp1_plan
from composer_par.models.llama import DecoderLayer


def _options(result: object) -> dict[str, dict[str, object]]:
    plan = result.plan()  # type: ignore[attr-defined]
    return {p.name: p.options() for p in plan.plugins}


@pytest.mark.parametrize(("strategy", "mesh", "reshard"), [
    (ShardingStrategy.FULL_SHARD, {"dp_shard": -1}, True),
    (ShardingStrategy.SHARD_GRAD_OP, {"dp_shard": -1}, False),
    (ShardingStrategy.HYBRID_SHARD, {"dp_replicate": 2, "dp_shard": -1}, True),
    (ShardingStrategy._HYBRID_SHARD_ZERO2, {"dp_replicate": 2, "dp_shard": -1}, False),
    (ShardingStrategy.NO_SHARD, {"dp_replicate": -1}, None),
])
def test_every_sharding_strategy(strategy: ShardingStrategy, mesh: dict[str, int],
                                 reshard: bool | None) -> None:
    result = fsdp1_plan(strategy, nodes=2)
    plan = result.plan()
    assert dict(plan.mesh.dims) == mesh
    fsdp2 = plan.plugin("fsdp2")
    if reshard is None:
        assert fsdp2 is None and plan.plugin("hsdp") is not None
    else:
        assert fsdp2.reshard_after_forward is reshard  # type: ignore[union-attr]
    assert plan.validate(world_size=8).ok
    assert result.mapped[0].value == strategy.name


def test_wrap_policies_mixed_precision_and_offload() -> None:
    transformer = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={DecoderLayer})
    for policy in (transformer, ModuleWrapPolicy({DecoderLayer})):
        result = fsdp1_plan(
            ShardingStrategy.FULL_SHARD, auto_wrap_policy=policy,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32),
            cpu_offload=CPUOffload(offload_params=True))
        assert _options(result) == {"fsdp2": {
            "reshard_after_forward": True, "blocks": ["DecoderLayer"], "offload": "cpu",
            "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32",
                                "cast_forward_inputs": True}}}
        assert result.report.findings == ()


def test_what_has_no_equal_is_found() -> None:
    result = fsdp1_plan(
        ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=10),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16))
    assert result.report.codes() == ["CP905", "CP908"]
    assert "size_based_auto_wrap_policy" in result.report.findings[0].message
    # NO_SHARD replicates: CPU offload needs the sharding plugin.
    replicated = fsdp1_plan("NO_SHARD", cpu_offload=CPUOffload(offload_params=True))
    assert replicated.report.codes() == ["CP906"]


def test_strategy_names_and_errors() -> None:
    assert _options(fsdp1_plan("shard_grad_op")) == {"fsdp2": {"reshard_after_forward": False}}
    with pytest.raises(ImportFailed) as unknown:
        fsdp1_plan("ZERO3")
    assert unknown.value.report.codes() == ["CP902"]
    with pytest.raises(ImportFailed) as hybrid:
        fsdp1_plan(ShardingStrategy.HYBRID_SHARD)
    assert hybrid.value.report.codes() == ["CP913"]


def test_the_plan_applies_to_a_model_on_meta() -> None:
    """The plan built from FSDP1's arguments is a real plan: it validates against the model
    it would shard, finding the blocks the wrap policy named."""
    from composer_par.models.llama import Llama, LlamaConfig

    plan = fsdp1_plan(ShardingStrategy.FULL_SHARD,
                      auto_wrap_policy=ModuleWrapPolicy({DecoderLayer})).plan()
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                                  ffn_hidden=32, max_seq_len=8))
    report = plan.validate(model, world_size=2)
    assert "CP401" not in report.codes(), report.format()
