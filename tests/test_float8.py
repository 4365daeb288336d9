"""Float8 (torchao): which layers convert, the rule codes CP961-CP969, the numerics against
bf16, and training on real gloo ranks at parity with one process running the same
emulated float8 model: FSDP2 (its float8 all-gather and the scale precompute), FSDP2 x
TP (torchao's float8 styles), EP x FSDP2, activation checkpointing, checkpoints."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao", reason="the float8 extra (torchao) is not installed")

from composer_par.plugins.float8 import (
    Float8,
    torchao_api,
)
from composer_par.plugins.float8.estimate import float8_terms
from composer_par.plugins.float8.findings import device_findings

from composer_par import FSDP2, HSDP, MeshSpec, MetaInit, ParallelPlan
from composer_par.findings import Report
from composer_par.plugin import CommHook, Plugin, hookimpl
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ATOL
from composer_par.testing.tasks import llama
from tests import float8_workers as workers
from tests.composition_workers import check_cases

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def codes(report: Report) -> list[str]:
    return [f.code for f in report.findings]


def meta(model_fn: Any) -> nn.Module:
    with torch.device("meta"):
        return model_fn()  # type: ignore[no-any-return]


def one_process(float8: Float8) -> ParallelPlan:
    return ParallelPlan(MeshSpec()).use(float8).use(MetaInit())


class Odd(nn.Module):
    """Blocks of a Linear that fits float8 and one whose dims are not multiples of 16."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.layers = nn.ModuleList(nn.ModuleDict({"fit": nn.Linear(32, 32),
                                                   "odd": nn.Linear(32, 20)})
                                    for _ in range(2))
        self.head = nn.Linear(32, 16)


# -- which layers convert ---------------------------------------------------------------


def test_blocks_convert_and_the_ends_and_odd_dims_stay_in_high_precision() -> None:
    plan = one_process(Float8())
    model = meta(Odd)
    report = plan.validate(model)
    [info] = report.findings
    assert info.code == "CP969" and info.severity.value == "info"
    assert "embed: the model's first or last layer" in info.message
    assert "head: the model's first or last layer" in info.message
    assert "layers.0.odd: in 32 x out 20: not multiples of 16" in info.message
    applied = plan.apply(model)
    converted = [n for n, m in applied.named_modules() if torchao_api.is_float8_linear(m)]
    assert converted == ["layers.0.fit", "layers.1.fit"]
    # The convert step says the same, and the user's notes hold the choice.
    assert "2 Linear layer(s) to float8" in plan.applied[0].detail
    assert plan.notes["float8"].converted == ("layers.0.fit", "layers.1.fit")


def test_convert_ends_modules_and_skip() -> None:
    ends = one_process(Float8(convert_ends=True)).apply(meta(Odd))
    assert {n for n, m in ends.named_modules() if torchao_api.is_float8_linear(m)} == {
        "embed", "head", "layers.0.fit", "layers.1.fit"}
    named = one_process(Float8(modules=("layers.*.fit", "head"), skip=("layers.1.*",)))
    model = named.apply(meta(Odd))
    assert {n for n, m in model.named_modules() if torchao_api.is_float8_linear(m)} == {
        "layers.0.fit", "head"}


def test_the_plugin_converts_as_torchao_itself_does() -> None:
    """The plugin's model and torchao's own convert_to_float8_training of the same Llama
    and config compute the same loss and gradients, bit for bit (emulated)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    plugin_model = one_process(Float8(emulate=True)).apply(meta(llama.build))
    theirs = one_process(Float8(modules=())).apply(meta(llama.build))  # converts nothing
    theirs.load_state_dict(plugin_model.state_dict())
    import dataclasses

    convert_to_float8_training(
        theirs, config=dataclasses.replace(Float8LinearConfig(), emulate=True),
        module_filter_fn=lambda m, path: path != "output")
    batch = llama.batch(0)
    for model in (plugin_model, theirs):
        llama.loss(model, batch).backward()
    assert torch.equal(llama.loss(plugin_model, batch), llama.loss(theirs, batch))
    for (name, a), (_, b) in zip(plugin_model.named_parameters(), theirs.named_parameters(),
                                 strict=True):
        assert torch.equal(a.grad, b.grad), name


def _snr(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Signal-to-noise ratio in dB, as torchao's tests compute it (compute_error)."""
    reference, other = reference.detach().double(), other.detach().double()
    return float(20 * torch.log10(reference.norm() / (reference - other).norm()))


@pytest.mark.parametrize("recipe", RECIPES)
def test_outputs_and_gradients_against_bf16(recipe: str) -> None:
    """torchao's own thresholds: the output of a float8 model within 18 dB of the bf16
    model's, its weight gradients within 17 dB (a Llama of multiples of 16, emulated)."""
    task = attrs.evolve(llama, dim=128, n_heads=4, n_kv_heads=4, global_batch=8, seq_len=32)
    base = one_process(Float8(modules=())).apply(meta(task.build)).to(torch.bfloat16)
    converted = one_process(Float8(recipe=recipe)).apply(meta(task.build))
    converted.load_state_dict(base.state_dict())
    converted = converted.to(torch.bfloat16)
    batch = task.batch(0)
    outputs = [model(batch) for model in (base, converted)]
    for out in outputs:
        out.float().square().mean().backward()
    assert _snr(outputs[0], outputs[1]) >= 18.0, recipe
    for (name, ref), (_, ours) in zip(base.named_parameters(), converted.named_parameters(),
                                      strict=True):
        if name.endswith(".weight") and ref.ndim == 2 and name.startswith("layers"):
            assert _snr(ref.grad, ours.grad) >= 17.0, (recipe, name)


# -- rules -------------------------------------------------------------------------------


def test_cp961_a_named_layer_float8_cannot_take() -> None:
    report = one_process(Float8(modules=("layers.*.odd",))).validate(meta(Odd))
    assert codes(report).count("CP961") == 2
    error = report.errors[0]
    assert "layers.0.odd (in 32 x out 20)" in error.message and "16" in error.message
    assert one_process(Float8(modules=("layers.*.fit",))).validate(meta(Odd)).ok


def test_cp962_float8_all_gather_without_fsdp2() -> None:
    hsdp = ParallelPlan(MeshSpec(dp_replicate=2)).use(HSDP()).use(
        Float8(all_gather="float8")).use(MetaInit())
    assert codes(hsdp.validate(world_size=2)) == ["CP962"]
    auto = ParallelPlan(MeshSpec(dp_replicate=2)).use(HSDP()).use(Float8()).use(MetaInit())
    assert auto.validate(world_size=2).ok


def test_cp963_float8_all_gather_with_a_rowwise_recipe() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(
        Float8(recipe="rowwise", all_gather="float8")).use(MetaInit())
    report = plan.validate(world_size=2)
    assert codes(report) == ["CP963"] and "tensorwise" in report.errors[0].fix
    # auto gathers a rowwise recipe's weights in high precision, and says so
    auto = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Float8(recipe="rowwise"))
    assert auto.use(MetaInit()).validate(world_size=2).ok
    assert any("high precision" in text for _, _, text in auto.explain().steps)


@attrs.frozen
class GatherHook(Plugin):
    """A plugin customizing the dp_shard all-gather (as a compression plugin would)."""

    name: ClassVar[str] = "gather_hook"

    @hookimpl
    def composer_par_comm_hooks(self) -> list[CommHook]:
        return [CommHook("dp_shard", all_gather=lambda setup: None)]


def test_cp964_float8_all_gather_with_a_custom_all_gather() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Float8()).use(GatherHook())
    report = plan.use(MetaInit()).validate(world_size=2)
    assert codes(report) == ["CP964"] and "uint8" in report.errors[0].message
    plain = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(
        Float8(all_gather="high_precision")).use(GatherHook()).use(MetaInit())
    assert plain.validate(world_size=2).ok


def test_cp965_and_cp966_the_device() -> None:
    cuda = torch.device("cuda")
    old = device_findings(cuda, False, "NVIDIA A100 (SM80)", "auto", True)
    assert [f.code for f in old] == ["CP966"] and "A100 (SM80)" in old[0].message
    assert device_findings(cuda, False, "NVIDIA A100 (SM80)", True, True) == []
    eager = device_findings(cuda, True, "NVIDIA H100 (SM90)", "auto", False)
    assert [f.code for f in eager] == ["CP965"] and "compile" in eager[0].fix
    assert device_findings(cuda, True, "NVIDIA H100 (SM90)", "auto", True) == []
    cpu = torch.device("cpu")
    assert device_findings(cpu, False, "a cpu device", "auto", False) == []
    assert [f.code for f in device_findings(cpu, False, "a cpu device", False, False)] == [
        "CP966"]


def test_cp966_on_ranks_without_float8_hardware(fake_world: Any) -> None:
    fake_world(2)
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Float8(emulate=False))
    report = plan.use(MetaInit()).validate(meta(llama.build), world_size=2)
    assert "CP966" in codes(report) and "a cpu device" in report.errors[0].message


def test_cp967_without_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchao_api, "installed", lambda: False)
    report = one_process(Float8()).validate()
    assert codes(report) == ["CP967"] and "composer-par[float8]" in report.errors[0].fix


def test_cp968_a_pattern_naming_no_layer() -> None:
    report = one_process(Float8(modules=("layers.*.atention.wq",))).validate(
        meta(llama.build))
    assert "CP968" in codes(report) and report.ok


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="recipe"):
        Float8(recipe="blockwise")
    with pytest.raises(ValueError, match="emulate"):
        Float8(emulate="sometimes")
    assert ParallelPlan.from_toml(
        '[mesh]\n\n[[plugins]]\nname = "float8"\nrecipe = "rowwise"\nmodules = ["a.*"]\n'
    ).plugin("float8") == Float8(recipe="rowwise", modules=("a.*",))


# -- hooks -------------------------------------------------------------------------------


@attrs.frozen
class Counter(Plugin):
    name: ClassVar[str] = "counter"
    seen: list[str] = attrs.field(factory=list, eq=False)

    @hookimpl
    def composer_par_parameters_changed(self, model: nn.Module) -> None:
        self.seen.append(type(model).__name__)


def test_the_training_step_tells_plugins_before_and_after_each_step() -> None:
    counter = Counter()
    plan = one_process(Float8()).use(counter)
    model = plan.apply(meta(llama.build))
    step = plan.training_step(model, lambda out, t: llama.loss(model, t))
    step.step(llama.batch(0), llama.batch(0))
    assert counter.seen == ["Llama", "Llama"]


def test_the_adapters_tell_plugins_after_each_optimizer_step() -> None:
    from composer_par.training import tell_plugins_after_steps

    counter = Counter()
    plan = one_process(Float8()).use(counter)
    model = plan.apply(meta(llama.build))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert tell_plugins_after_steps(plan, [model], optimizer)
    assert not tell_plugins_after_steps(plan, [model], optimizer)  # once per optimizer
    llama.loss(model, llama.batch(0)).backward()
    optimizer.step()
    optimizer.step()
    assert counter.seen == ["Llama", "Llama"]


def test_float8_gives_tp_its_float8_styles() -> None:
    """composer_par_parallel_style: a tensorwise float8 layer gets torchao's float8
    styles with the layouts TP chose; rowwise layers and plain ones keep torch's."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    for recipe, expected in (("tensorwise", (Float8ColwiseParallel, Float8RowwiseParallel)),
                             ("rowwise", (ColwiseParallel, RowwiseParallel))):
        plan = one_process(Float8(recipe=recipe))
        model = plan.apply(meta(llama.build))
        layer = model.get_submodule("layers.0.attention.wq")
        colwise = plan.hooks.parallel_style(layer, ColwiseParallel(output_layouts=Shard(1)))
        rowwise = plan.hooks.parallel_style(layer, RowwiseParallel())
        assert (type(colwise), type(rowwise)) == expected, recipe
        assert colwise.output_layouts == (Shard(1),)
        plain = ColwiseParallel()
        assert plan.hooks.parallel_style(model.output, plain) is plain


# -- torchao's symbols -------------------------------------------------------------------


@pytest.mark.parametrize("symbol", [s.symbol for s in torchao_api.SYMBOLS if ":" in s.symbol])
def test_every_torchao_symbol_exists(symbol: str) -> None:
    torchao_api._reach(symbol)


def test_only_torchao_api_reaches_torchao() -> None:
    home = ROOT / "plugins" / "float8"
    for path in sorted(home.glob("*.py")):
        if path.name == "torchao_api.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = [n for node in ast.walk(tree) if isinstance(node, ast.ImportFrom | ast.Import)
                    for n in ([node.module or ""] if isinstance(node, ast.ImportFrom)
                              and node.level == 0 else [] if isinstance(node, ast.ImportFrom)
                              else [a.name for a in node.names])]
        assert not [m for m in imported if m.startswith("torchao")], path.name
        privates = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                    and node.attr == "_precomputed_scale"}
        assert not privates, path.name


# -- estimate ------------------------------------------------------------------------------


def _gathered(est: Any) -> int:
    """The all-gather bytes of one step over dp_shard by ``est``."""
    return sum(c.payload for t in est.traffic if t.dim.name == "dp_shard"
               for c in t.collectives if c.kind == "all_gather")


def test_estimate_states_the_gather_and_the_amax_all_reduce() -> None:
    from composer_par.estimate import ModelShape, Workload, estimate_plan

    shape = ModelShape.from_numbers(layers=4, hidden=256, heads=8, ffn_hidden=512, vocab=1000)
    plan = ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(Float8())
    est = estimate_plan(plan, shape, Workload(seq=1024), world_size=4)
    dp = next(t for t in est.traffic if t.dim.name == "dp_shard")
    amax = [c for c in dp.collectives if c.kind == "all_reduce"]
    # q, k, v, o and the three MLP matrices of each of 4 blocks: one fp32 amax each
    assert [(c.payload, c.calls) for c in amax] == [(4 * 7 * 4, 1)]
    _, memory, notes = float8_terms(
        shape, dim="dp_shard", shard=4, gathers=2, param_dtype="bfloat16",
        recipe="tensorwise", float8_gather=True)
    block = 4 * 256 * 256 + 3 * 256 * 512
    assert memory == {}  # FSDP2's terms count the unsharded float8 weights
    assert f"gather {4 * block} bytes per pass over the blocks instead of {8 * block}" \
        in notes[1]
    assert f"{4 * block * 2} bytes less per step at most (2 passes" in notes[1]
    # FSDP2's terms count the converted weights' all-gathers at one byte an element
    # (the float8 plugin marks them in the shape): fp32 parameters here, 3 bytes less
    # for each, in forward (4 blocks) and again in backward (all but the last block,
    # which FSDP2 keeps gathered for it)
    high = estimate_plan(ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(
        Float8(all_gather="high_precision")), shape, Workload(seq=1024), world_size=4)
    assert _gathered(high) - _gathered(est) == block * 3 * (4 + 3)
    rowwise = float8_terms(shape, dim="dp_shard", shard=4, gathers=2,
                           param_dtype="bfloat16", recipe="rowwise", float8_gather=False)
    assert rowwise[0] == () and "high precision" in rowwise[2][1]


# -- on gloo ranks -------------------------------------------------------------------------


# The resolution of float8 training, for comparisons past the first step where a rounding
# boundary is crossed (test_fsdp2_x_tp_parity): one e4m3 step is an eighth of a value.
FLOAT8_ATOL = 1e-4


def _check(cases: list[Any], timeout: float, atols: list[float] | None = None) -> None:
    """Each case against its reference: the fp32 tolerance, or the case's own in atols."""
    results = check_cases(cases, timeout=timeout)
    for case, result, atol in zip(cases, results, atols or [ATOL] * len(cases), strict=True):
        try:
            result.assert_close(atol=atol)
        except AssertionError as exc:
            raise AssertionError(f"{case.task} {case.plan!r}: {exc}") from None
        assert len(result.losses) == 1 or result.losses[-1] != result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp2_parity_for_every_recipe_with_and_without_checkpointing() -> None:
    """dp_shard 2: tensorwise (float8 all-gather), rowwise and rowwise_with_gw_hp (high
    precision all-gathers), each with and without activation checkpointing, equal to one
    process training the same emulated float8 Llama: losses and every rank's parameters."""
    _check([workers.case(workers.LLAMA, "fsdp2", recipe, 2, ac=ac)
            for recipe in RECIPES for ac in (False, True)], timeout=280)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp2_with_compile_parity() -> None:
    """dp_shard 2, tensorwise, the blocks compiled (aot_eager: dynamo and AOTAutograd
    trace torchao's float8 tensors; eager kernels) and checkpointed: equal to one process
    running the same float8 model uncompiled."""
    _check([workers.case(workers.LLAMA, "fsdp2", "tensorwise", 2, ac=True, compile_=True,
                         steps=2)], timeout=280)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp2_x_tp_parity() -> None:
    """dp_shard 2 x tp 2 with torchao's float8 TP styles (tensorwise) and torch's (rowwise),
    the weights 2-D DTensors gathered in float8 over dp_shard.

    The rowwise recipe's first step is held to the fp32 tolerance, its third to float8's
    resolution: it casts the weight gradient's operands to float8 with a scale per row,
    and the last-bit fp32 differences TP's vocabulary-split embedding and head leave after
    a step (7.5e-9 here) carry a few elements across a float8 rounding boundary, one e4m3
    step each (2.4e-5 in a weight after three steps; rowwise_with_gw_hp, which keeps that
    gradient in high precision, stays at 7.5e-9, as tp alone shows the same)."""
    _check([workers.case(workers.LLAMA, "fsdp2_tp", "tensorwise", 4),
            workers.case(workers.LLAMA, "fsdp2_tp", "rowwise", 4, ac=True, steps=1),
            workers.case(workers.LLAMA, "fsdp2_tp", "rowwise", 4, ac=True)],
           timeout=280, atols=[ATOL, ATOL, FLOAT8_ATOL])
    views = run_ranks(workers.tp_styles, 4, args=(workers.plan("fsdp2_tp", "tensorwise"),),
                      timeout=200)
    for view in views:
        assert view["layer"] == "Float8Linear"
        assert any("Float8ColwiseParallel" in h for h in view["pre_hooks"]), view
        # FSDP2 over dp_shard of TP's Shard(0): strided, then tp's
        assert view["placements"] == ["_S(0, 2)", "S(0)"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ep_x_fsdp2_parity_on_the_moe_llama_and_mixtral() -> None:
    """dp_shard 2 x ep 2: the dense layers in float8, the routed experts in high precision;
    the MoE Llama with and without checkpointing, and Mixtral."""
    _check([workers.case(workers.MOE, "fsdp2_ep", "tensorwise", 4),
            workers.case(workers.MOE, "fsdp2_ep", "rowwise", 4, ac=True),
            workers.case(workers.MIXTRAL, "fsdp2_ep", "tensorwise", 4)], timeout=280)


def _estimate_of(plan_text: str) -> Any:
    """The estimate of ``plan_text`` on 2 ranks for the Llama task's model and batch."""
    from composer_par.estimate import ModelShape, Workload, estimate_plan

    plan = ParallelPlan.from_toml(plan_text)
    with torch.device("meta"):
        model = llama.build()
    shape = ModelShape.from_module(model, plan.block_spec())
    return estimate_plan(plan, shape, Workload(seq=llama.seq_len,
                                               micro_batch=llama.global_batch // 2),
                         world_size=2)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_float8_all_gather_moves_half_the_bytes_of_bf16_and_one_amax_all_reduce() -> None:
    """The same Llama under FSDP2 with bf16 mixed precision: tensorwise float8 all-gathers
    gather each converted weight in one byte instead of two (the norms and the output
    head stay bf16; no scale is gathered), and the scales cost one all-reduce of one fp32
    amax per converted weight, once per step."""
    mixed = 'mixed_precision = { param_dtype = "bfloat16", reduce_dtype = "float32" }'
    float8 = run_ranks(workers.gathered_bytes, 2, timeout=200, args=(
        workers.plan("fsdp2", "tensorwise", fsdp2=mixed), 3))
    bf16 = run_ranks(workers.gathered_bytes, 2, timeout=200, args=(
        workers.plan("fsdp2", "tensorwise", fsdp2=mixed, float8='all_gather = '
                     '"high_precision"'), 1))
    weights = float8[0]["weights"]
    assert weights == llama.n_layers * 7
    # bytes the converted weights gather per step in bf16 (forward and backward gathers)
    converted = llama.n_layers * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    for rank in range(2):
        f8, hp = float8[rank]["steps"], bf16[rank]["steps"][0]
        assert hp["gather_dtypes"] == ["bfloat16"]
        assert "uint8" in f8[0]["gather_dtypes"]
        # every block gathers in forward, all but the last (kept gathered) again in
        # backward: 2 - 1 bytes less per element each time
        passes = 2 * llama.n_layers - 1
        assert hp["all_gather"] - f8[1]["all_gather"] == passes * converted // llama.n_layers, (
            hp, f8[1])
        # the rest (norms, embedding, head) gathers in bf16 either way
        assert f8[1]["all_gather"] / hp["all_gather"] < 0.65
    # and the plans' estimates count the same bytes
    for text, steps in ((workers.plan("fsdp2", "tensorwise", fsdp2=mixed), float8),
                        (workers.plan("fsdp2", "tensorwise", fsdp2=mixed, float8='all_gather'
                                      ' = "high_precision"'), bf16)):
        assert _gathered(_estimate_of(text)) == steps[0]["steps"][-1]["all_gather"], text
        for step in f8:
            amax = [b for b in step["all_reduce"] if b == 4 * weights]
            assert amax == [4 * weights], step["all_reduce"]  # one, of every amax
        assert float8[rank]["refreshes"] == [3]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_the_accelerate_adapter_refreshes_the_scales_after_each_optimizer_step() -> None:
    """FSDP2 x float8 tensorwise through accelerate (the loop its users write): after
    every optimizer step the plugins are told (composer_par_parameters_changed), so the
    next forward computes the scales again, once per step; the losses are those of the
    same plan through plan.training_step."""
    pytest.importorskip("accelerate")
    results = run_ranks(workers.accelerate_and_training_step, 2, timeout=220, args=(
        workers.plan("fsdp2", "tensorwise"), 3))
    for result in results:
        adapter = result["adapter"]
        assert adapter["told"] == [True, True, True]
        assert adapter["refreshes"] == [3]
        assert adapter["losses"] == result["training_step"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_checkpoint_round_trip_and_safetensors_export(tmp_path: Path) -> None:
    """A float8 run under FSDP2 saves and loads bitwise (weights and AdamW state: the next
    step is the same step), and its safetensors export (the high-precision master
    weights) loads into a plain Llama with no float8 layer."""
    from safetensors.torch import load_file

    results = run_ranks(workers.checkpoint_round_trip, 2, timeout=220, args=(
        workers.plan("fsdp2", "tensorwise"), str(tmp_path)))
    for result in results:
        assert result["same_loaded"] and result["same_after"]
        assert result["losses"][0] == result["losses"][1]
    export = Path(results[0]["exported"])
    tensors = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in
               load_file(f).items()}
    assert all(t.dtype == torch.float32 for t in tensors.values())
    plain = llama.build()
    plain.load_state_dict(tensors)
    assert not any(torchao_api.is_float8_linear(m) for m in plain.modules())
    for name, param in plain.named_parameters():
        assert torch.equal(param, results[0]["params"][name]), name
    assert math.isfinite(float(llama.loss(plain, llama.batch(0)).detach()))
