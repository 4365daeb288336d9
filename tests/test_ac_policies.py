"""ActivationCheckpoint's policies: what each recomputes, which collectives its backward
issues again under TP (and FSDP2 x TP), and that every rank's gradients stay those of
training without checkpointing."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from composer_par.plugins.activation_checkpoint import CheckpointHow, checkpoint_block
from torch.utils.checkpoint import CheckpointPolicy, set_checkpoint_early_stop

from composer_par import ActivationCheckpoint, MeshSpec, MetaInit, ParallelPlan, PlanError
from composer_par.testing.distributed import run_ranks
from composer_par.testing.tasks import LlamaTask, llama
from tests.ac_policy_workers import CountOps, calls, save_nothing


def build(*plugins: Any, task: Any = llama) -> torch.nn.Module:
    plan = ParallelPlan(MeshSpec())
    for plugin in plugins:
        plan.use(plugin)
    plan.use(MetaInit(seed=5))
    with torch.device("meta"):
        model = task.build()
    return plan.apply(model)


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = []
    for param in model.parameters():
        assert param.grad is not None
        grads.append(param.grad)
    return grads


def step(model: torch.nn.Module, task: Any = llama) -> tuple[Counter[str], list[torch.Tensor]]:
    """The aten ops of one backward, and the gradients."""
    loss = task.loss(model, task.batch(0))
    with CountOps() as counter:
        loss.backward()
    return counter.ops, grads_of(model)


def matmuls_per_block(task: Any = llama) -> int:
    with torch.device("meta"):
        block = task.build().layers[0]
    return sum(isinstance(m, torch.nn.Linear) for m in block.modules())


def save_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


# -- single process: what is recomputed ---------------------------------------------------


def test_matmul_every_counts_per_region_and_forward_and_recompute_agree() -> None:
    # An odd number of matmuls per block: a count running across blocks would start the
    # second block on the other foot and recompute a different number of them there.
    task = LlamaTask(n_layers=3)
    per_block = matmuls_per_block(task)
    assert per_block % 2 == 1
    plain_ops, plain_grads = step(build(task=task), task)
    for n in (1, 2, 3):
        ops, grads = step(build(ActivationCheckpoint(mode="selective", matmul_every=n),
                                task=task), task)
        saved = math.ceil(per_block / n)  # the 1st, (n+1)-th, ... of each block
        assert ops["mm"] == plain_ops["mm"] + task.n_layers * (per_block - saved), n
        for grad, ref in zip(grads, plain_grads, strict=True):
            assert torch.equal(grad, ref)


def test_early_stop_on_and_off() -> None:
    plain_ops, plain_grads = step(build())
    per_block = matmuls_per_block()
    counts = {}
    for early_stop in (None, True, False):
        ops, grads = step(build(ActivationCheckpoint(early_stop=early_stop)))
        counts[early_stop] = ops["mm"] - plain_ops["mm"]
        for grad, ref in zip(grads, plain_grads, strict=True):
            assert torch.equal(grad, ref)
    # Off: the whole forward of each block again. On (torch's default): recomputation ends
    # when the block's last saved tensors (the last matmul's inputs, saved before it
    # runs) are back, so the last matmul is not run again.
    assert counts[False] == llama.n_layers * per_block
    assert counts[True] == counts[None] == llama.n_layers * (per_block - 1)


def test_early_stop_is_the_plugins_whatever_encloses_the_step() -> None:
    plain_ops, _ = step(build())
    model = build(ActivationCheckpoint(early_stop=False))
    loss = llama.loss(model, llama.batch(0))
    with set_checkpoint_early_stop(True), CountOps() as counter:
        loss.backward()
    assert counter.ops["mm"] - plain_ops["mm"] == llama.n_layers * matmuls_per_block()
    # Unset, torch's own setting at forward time holds (here: off).
    model = build(ActivationCheckpoint())
    with set_checkpoint_early_stop(False):
        loss = llama.loss(model, llama.batch(0))
    with CountOps() as counter:
        loss.backward()
    assert counter.ops["mm"] - plain_ops["mm"] == llama.n_layers * matmuls_per_block()


def test_a_user_policy_decides_every_op() -> None:
    plain_ops, plain_grads = step(build())
    full_ops, _ = step(build(ActivationCheckpoint()))
    for policy, ops_like in ((save_nothing, full_ops), (save_everything, plain_ops),
                             ("tests.ac_policy_workers:save_nothing", full_ops)):
        ops, grads = step(build(ActivationCheckpoint(mode="selective", policy=policy)))
        assert ops["mm"] == ops_like["mm"], policy
        assert ops["silu"] == ops_like["silu"], policy
        for grad, ref in zip(grads, plain_grads, strict=True):
            assert torch.equal(grad, ref)


def test_checkpoint_block_takes_a_how() -> None:
    block = torch.nn.Linear(2, 2)
    checkpoint_block(block, CheckpointHow("selective", ("matmul",), 2))
    assert block.__dict__["_composer_par_checkpoint"] == "selective"
    out = block(torch.ones(3, 2, requires_grad=True)).sum()
    out.backward()
    assert block.weight.grad is not None


# -- options --------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"mode": "selective", "early_stop": False}, "early_stop applies to mode='full'"),
    ({"matmul_every": 2}, "use mode='selective', or drop matmul_every"),
    ({"save": ["matmul"]}, "use mode='selective', or drop save"),
    ({"policy": "tests.ac_policy_workers:save_nothing"}, "use mode='selective', or drop policy"),
    ({"mode": "selective", "policy": save_nothing, "matmul_every": 2},
     "save and matmul_every would be ignored"),
    ({"mode": "selective", "save": []}, "use mode='full'"),
    ({"mode": "selective", "save": ["collectives"], "matmul_every": 2},
     "add 'matmul' to save, or drop matmul_every"),
    ({"mode": "selective", "save": ["matmuls"]}, "does not know"),
    ({"mode": "selective", "save": ["matmul", "matmul"]}, "twice"),
    ({"mode": "selective", "matmul_every": 0}, "matmul_every must be an int >= 1"),
    ({"mode": "selective", "policy": "no colon"}, "'package.module:function'"),
    ({"mode": "selective", "policy": 3}, "'package.module:function'"),
    ({"early_stop": 1}, "early_stop must be true or false"),
])
def test_bad_options_and_combinations_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ActivationCheckpoint(**options)


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_module_anywhere:policy", "cannot import module 'no_such_module_anywhere'"),
    ("tests.ac_policy_workers:no_such_policy", "has no 'no_such_policy'"),
    ("tests.ac_policy_workers:not_callable", "is a int, not a callable"),
])
def test_a_policy_string_that_does_not_resolve_is_cp210_before_anything_changes(
        spec: str, message: str) -> None:
    with torch.device("meta"):
        model = llama.build()
    plan = (ParallelPlan(MeshSpec()).use(ActivationCheckpoint(mode="selective", policy=spec))
            .use(MetaInit()))
    # (a package not installed here is also CP224, the model-less warning)
    (finding,) = [f for f in plan.validate(model).findings if f.code != "CP224"]
    assert finding.code == "CP210" and finding.plugin == "activation_checkpoint"
    assert spec in finding.message and message in finding.message
    assert "importable on every rank" in finding.fix
    with pytest.raises(PlanError):
        plan.apply(model)
    assert not any("_composer_par_checkpoint" in layer.__dict__ for layer in model.layers)


def test_a_policy_whose_package_is_missing_is_found_without_a_model(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Model-less validation (a laptop, before launch) imports no user code: a package not
    installed here is CP224, a warning (it may be installed where the job runs); a missing
    function inside an installed package needs the import, found once the model is there.
    With the model the string is imported: CP210 as well, an error."""
    from composer_par.cli.main import main

    def plan(spec: str) -> ParallelPlan:
        return ParallelPlan(MeshSpec()).use(ActivationCheckpoint(mode="selective", policy=spec))

    (finding,) = plan("no_such_module_anywhere:policy").validate().findings
    assert finding.code == "CP224" and finding.severity.value == "warning"
    assert "no module 'no_such_module_anywhere' is installed here" in finding.message
    assert plan("tests.ac_policy_workers:no_such_policy").validate().findings == ()
    assert plan("tests.ac_policy_workers:save_nothing").validate().findings == ()
    with torch.device("meta"):
        model = llama.build()
    report = plan("no_such_module_anywhere:policy").use(MetaInit()).validate(model)
    assert sorted(report.codes()) == ["CP210", "CP224"] and not report.ok
    path = tmp_path / "plan.toml"
    path.write_text('[mesh]\ndp_shard = 1\n\n[[plugins]]\nname = "activation_checkpoint"\n'
                    'mode = "selective"\n'
                    'policy = "no_such_module_anywhere:policy"\n')
    assert main(["validate", str(path)]) == 0  # a warning
    out = capsys.readouterr().out
    assert "WARNING CP224" in out and "no module 'no_such_module_anywhere'" in out


def test_plan_file_round_trip_of_every_option() -> None:
    from composer_par import PlanFileError

    text = ('[mesh]\ntp = 2\n[[plugins]]\nname = "tp"\n[[plugins]]\n'
            'name = "activation_checkpoint"\nmode = "selective"\nsave = ["matmul"]\n'
            'matmul_every = 2\n')
    plan = ParallelPlan.from_toml(text)
    assert plan.plugin("activation_checkpoint") == ActivationCheckpoint(
        mode="selective", save=("matmul",), matmul_every=2)
    assert ParallelPlan.from_toml(plan.to_toml()).plugins == plan.plugins
    for extra in ('policy = "tests.ac_policy_workers:save_nothing"\n', ""):
        text = ('[mesh]\n[[plugins]]\nname = "activation_checkpoint"\nmode = "selective"\n'
                + extra)
        plan = ParallelPlan.from_toml(text)
        assert ParallelPlan.from_toml(plan.to_toml()).plugins == plan.plugins
    full = ParallelPlan.from_toml('[mesh]\n[[plugins]]\nname = "activation_checkpoint"\n'
                                  "early_stop = false\n")
    assert full.plugin("activation_checkpoint") == ActivationCheckpoint(early_stop=False)
    assert "early_stop = false" in full.to_toml()
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml('[mesh]\n[[plugins]]\nname = "activation_checkpoint"\n'
                               'mode = "selective"\nearly_stop = true\n')
    assert info.value.report.codes() == ["CP506"]
    assert "drop early_stop, or use mode='full'" in str(info.value)
    with pytest.raises(ValueError, match="'policy'"):
        ParallelPlan(MeshSpec()).use(
            ActivationCheckpoint(mode="selective", policy=save_nothing)).to_toml()


@pytest.mark.parametrize(("options", "text"), [
    ({}, "full checkpointing of every block: recompute the whole block in backward"),
    ({"early_stop": False}, "(early stop off: the whole forward is recomputed)"),
    ({"early_stop": True}, "(early stop on: recomputation ends once backward has what it"),
    ({"mode": "selective"}, "save matmul and collective outputs, recompute the rest (no "
     "collective issued again in backward)"),
    ({"mode": "selective", "save": "matmul"}, "save matmul outputs, recompute the rest"),
    ({"mode": "selective", "matmul_every": 2}, "save 1 in 2 matmul and collective outputs"),
    ({"mode": "selective", "policy": "tests.ac_policy_workers:save_nothing"},
     "the op policy tests.ac_policy_workers:save_nothing decides what is saved"),
    ({"mode": "selective", "policy": save_nothing}, "the op policy save_nothing decides"),
])
def test_describe_declare_and_estimate_settings(options: dict[str, Any], text: str) -> None:
    plugin = ActivationCheckpoint(**options)
    plan = ParallelPlan(MeshSpec()).use(plugin)
    assert text in str(plan.explain())
    assert plugin.declare().checkpointing == plugin.mode
    settings = plugin.composer_par_estimate_settings()
    assert settings.activation_checkpoint == plugin.mode and settings.checkpoint_every == 1


# Dynamo reads .grad of the activations it traces (see tests/test_compile.py).
@pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_compiled_policies_train_like_eager() -> None:
    from torch._dynamo.utils import counters

    from composer_par import Compile

    _, plain_grads = step(build())
    for options in ({"early_stop": False}, {"mode": "selective", "matmul_every": 2},
                    {"mode": "selective", "policy": save_nothing}):
        torch._dynamo.reset()
        counters.clear()
        model = build(ActivationCheckpoint(**options), Compile(backend="aot_eager"))
        llama.loss(model, llama.batch(0)).backward()
        grads = grads_of(model)
        # One graph for both blocks: early_stop in particular must not break it.
        assert not counters["graph_break"], (options, dict(counters["graph_break"]))
        assert counters["stats"]["unique_graphs"] == 1, options
        for grad, ref in zip(grads, plain_grads, strict=True):
            torch.testing.assert_close(grad, ref, rtol=1.3e-6, atol=1e-6)


# -- real ranks: the collectives backward issues again --------------------------------


def expected_reissued(structure: dict[str, Any]) -> dict[str, int]:
    """The tp collectives each policy's backward issues beyond training without
    checkpointing, from the blocks' structure: under TP without sequence parallelism a
    block's forward all-reduces the output of each row-split Linear, and nothing else.
    Recomputing the whole forward issues them all again; stopping early (torch's
    default) ends at the block's last saved tensors, the inputs of its last Linear,
    before the all-reduce of a row-split last Linear. Saving collective outputs issues
    none again."""
    order, rowwise, blocks = structure["call_order"], structure["rowwise"], structure["blocks"]
    before_last = [n for n in rowwise if order.index(n) < order.index(order[-1])]
    early = blocks * len(before_last)
    return {
        "full": early,
        "full, early_stop off": blocks * len(rowwise),
        "selective (matmul + collectives)": 0,
        "selective (matmul only)": early,
        "selective, 1 in 2 matmuls": 0,
        "policy: save nothing": early,
    }


def check_ranks(results: list[dict[str, Any]], mesh: MeshSpec) -> None:
    dims = mesh.names
    for rank, result in enumerate(results):
        structure = result["structure"]
        assert structure["rowwise"] == ["attention.wo", "feed_forward.w2"]
        reference = result["none"]
        assert calls(reference["backward"], "tp") > 0, rank
        for label, extra in expected_reissued(structure).items():
            if label not in result:
                continue
            got = result[label]
            where = f"rank {rank}, {label}"
            assert got["loss"] == reference["loss"], where
            assert got["unequal_grads"] == [], where
            assert got["grads"] == reference["grads"], where
            assert got["forward"] == reference["forward"], where
            assert calls(got["backward"], "tp") == calls(reference["backward"], "tp") + extra, \
                where
            for dim in dims:
                if dim != "tp":  # FSDP2 gathers a block's weights again in any case
                    assert got["backward"].get(dim) == reference["backward"].get(dim), where
    # The ranks of one data shard (differing only in tp) compute the same loss.
    shards: dict[int, set[float]] = {}
    for rank, result in enumerate(results):
        shards.setdefault(mesh.coordinate(rank).get("dp_shard", 0), set()).add(
            result["none"]["loss"])
    assert all(len(losses) == 1 for losses in shards.values()), shards


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_backward_collectives_of_each_policy_under_tp2() -> None:
    results = run_ranks("tests.ac_policy_workers:one_step", 2, args=({"tp": 2},),
                        timeout=200)
    check_ranks(results, MeshSpec(tp=2))
    per_block = len(results[0]["structure"]["call_order"])
    blocks = results[0]["structure"]["blocks"]
    for result in results:
        mm = {label: r["ops"]["mm"] for label, r in result.items() if label != "structure"}
        assert mm["selective (matmul + collectives)"] == mm["none"]
        assert mm["selective, 1 in 2 matmuls"] == mm["none"] + blocks * (per_block // 2)
        assert mm["full, early_stop off"] == mm["none"] + blocks * per_block
        assert mm["full"] == mm["policy: save nothing"] == mm["none"] + blocks * (per_block - 1)
        held = {label: r["activation_bytes"] for label, r in result.items()
                if label != "structure"}
        assert held["full"] < held["selective, 1 in 2 matmuls"] < held[
            "selective (matmul + collectives)"] < held["none"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_backward_collectives_under_fsdp2_x_tp_2x2() -> None:
    results = run_ranks("tests.ac_policy_workers:one_step", 4,
                        args=({"dp_shard": 2, "tp": 2},), timeout=260)
    check_ranks(results, MeshSpec(dp_shard=2, tp=2))
    for result in results:
        assert calls(result["none"]["backward"], "dp_shard") > 0


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_selective_issues_no_collective_again_under_sequence_parallel() -> None:
    # Sequence parallelism adds all-gathers and reduce-scatters inside each block (into and
    # out of attention and the MLP): saved by default, as TP's all-reduces are.
    variants = ("none", "selective (matmul + collectives)", "selective (matmul only)")
    results = run_ranks("tests.ac_policy_workers:one_step", 2, args=({"tp": 2},),
                        kwargs={"variants": variants, "sequence_parallel": True}, timeout=200)
    for rank, result in enumerate(results):
        reference = result["none"]
        kinds = set(reference["forward"]["tp"])
        assert {"all_gather", "reduce_scatter"} <= kinds, kinds
        for label in variants[1:]:
            assert result[label]["unequal_grads"] == [], (rank, label)
            assert result[label]["loss"] == reference["loss"], (rank, label)
        extra = {label: calls(result[label]["backward"], "tp") - calls(reference["backward"], "tp")
                 for label in variants[1:]}
        assert extra["selective (matmul + collectives)"] == 0, (rank, extra)
        assert extra["selective (matmul only)"] > 0, (rank, extra)
