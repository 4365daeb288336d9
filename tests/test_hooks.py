"""Hooks: stage order comes from the specs, not registration; after/before within a stage."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest
import torch

from composer_par import Claim, Declaration, MeshSpec, ParallelPlan, Plugin, Role, hookimpl
from composer_par.plugin import STAGES, Stage
from composer_par.plugin.caller import HookCaller
from composer_par.plugin.context import ApplyContext

CALLS: list[tuple[str, str]] = []


@attrs.frozen
class Recorder(Plugin):
    """Implements every stage hook (composer_par_convert, composer_par_tensor_parallel,
    composer_par_activation_checkpoint, composer_par_compile, composer_par_data_parallel,
    composer_par_materialize, composer_par_finalize) and records each call."""

    name: ClassVar[str] = "recorder"
    label: str = "recorder"
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()

    def declare(self) -> Declaration:
        return attrs.evolve(super().declare(), plugin=self.label)

    def _record(self, stage: str, ctx: ApplyContext) -> str:
        assert isinstance(ctx.model, torch.nn.Module)
        CALLS.append((stage, self.label))
        return f"{self.label} did {stage}"

    @hookimpl
    def composer_par_convert(self, ctx: ApplyContext) -> str:
        return self._record("convert", ctx)

    @hookimpl
    def composer_par_tensor_parallel(self, ctx: ApplyContext) -> str:
        return self._record("tensor_parallel", ctx)

    @hookimpl
    def composer_par_activation_checkpoint(self, ctx: ApplyContext) -> str:
        return self._record("activation_checkpoint", ctx)

    @hookimpl
    def composer_par_compile(self, ctx: ApplyContext) -> str:
        return self._record("compile", ctx)

    @hookimpl
    def composer_par_data_parallel(self, ctx: ApplyContext) -> str:
        return self._record("data_parallel", ctx)

    @hookimpl
    def composer_par_finalize(self, ctx: ApplyContext) -> str:
        return self._record("finalize", ctx)

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        return [("finalize", f"{self.label} finalizes"), ("convert", f"{self.label} converts")]


@attrs.frozen
class Materializer(Recorder):
    @hookimpl
    def composer_par_materialize(self, ctx: ApplyContext) -> str:
        return self._record("materialize", ctx)


@pytest.fixture(autouse=True)
def _clear() -> None:
    CALLS.clear()


def test_stages_run_in_spec_order_whatever_the_use_order() -> None:
    plan = ParallelPlan(MeshSpec()).use(Recorder(label="a")).use(Materializer(label="m"))
    plan.apply(torch.nn.Linear(2, 2))
    stages = [s.label for s in STAGES]
    seen = [stage for stage, _ in CALLS]
    assert seen == sorted(seen, key=stages.index)
    assert ("materialize", "m") in CALLS
    # One applied step per (stage, plugin), with the plugin's own description.
    assert [(s.stage, s.detail) for s in plan.applied][:2] == [
        ("convert", "a did convert"), ("convert", "m did convert")]


def test_after_and_before_order_plugins_within_a_stage() -> None:
    plan = ParallelPlan(MeshSpec())
    plan.use(Recorder(label="late", after=("middle",)))
    plan.use(Recorder(label="middle"))
    plan.use(Recorder(label="early", before=("middle",)))
    assert plan.validate().ok
    plan.apply(torch.nn.Linear(2, 2))
    assert [who for stage, who in CALLS if stage == "convert"] == ["early", "middle", "late"]


def test_a_cycle_is_refused_before_any_hook_runs() -> None:
    plan = ParallelPlan(MeshSpec())
    plan.use(Recorder(label="x", after=("y",))).use(Recorder(label="y", after=("x",)))
    with pytest.raises(Exception, match="CP205"):
        plan.apply(torch.nn.Linear(2, 2))
    assert CALLS == []


def test_describe_feeds_explain_in_stage_order() -> None:
    plan = ParallelPlan(MeshSpec()).use(Recorder(label="r"))
    steps = plan.explain().steps
    assert [(stage, text) for stage, _, text in steps] == [
        ("convert", "r converts"), ("finalize", "r finalizes")]


def test_plugins_without_describe_are_explained_by_their_stages() -> None:
    @attrs.frozen
    class Quiet(Plugin):
        name: ClassVar[str] = "quiet"

        @hookimpl
        def composer_par_compile(self, ctx: ApplyContext) -> None:
            return None

    steps = ParallelPlan(MeshSpec()).use(Quiet()).explain().steps
    assert steps == (("compile", "quiet", "compile"),)


def test_declare_carries_claims_and_capabilities() -> None:
    @attrs.frozen
    class Claimer(Plugin):
        name: ClassVar[str] = "claimer"
        provides: ClassVar[frozenset[str]] = frozenset({"data_parallel"})

        def claims(self) -> tuple[Claim, ...]:
            return (Claim("dp_shard", Role.SHARD),)

    (decl,) = HookCaller([Claimer()]).declarations()
    assert decl == Declaration(plugin="claimer", claims=(Claim("dp_shard", Role.SHARD),),
                               provides=frozenset({"data_parallel"}))


def test_stage_list_matches_the_hookspecs() -> None:
    from composer_par.plugin import hookspecs

    specs = {n for n in dir(hookspecs) if n.startswith("composer_par_")}
    assert {s.value for s in Stage} <= specs
    # Materialize and pipeline_split take one provider per plan: Recorder is used in twos.
    assert Recorder.stages() == tuple(
        s for s in STAGES if s not in (Stage.MATERIALIZE, Stage.PIPELINE_SPLIT))


def test_trace_switch_traces_every_hook_call_of_validate_and_explain(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COMPOSER_PAR_TRACE_HOOKS", "1")
    plan = ParallelPlan(MeshSpec()).use(Recorder())
    plan.validate()
    traced = capsys.readouterr().err
    for hook in ("composer_par_declare", "composer_par_block_spec", "composer_par_comm_hooks",
                 "composer_par_validate_plan"):
        assert hook in traced, hook
    plan.explain()
    assert "composer_par_describe" in capsys.readouterr().err

