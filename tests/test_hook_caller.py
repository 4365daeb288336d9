"""The plan's hook caller keeps pluggy's promises while calling in the plan's order."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, ClassVar

import attrs
import pytest
import torch
import torch.nn as nn

from composer_par import MeshSpec, MetaInit, ParallelPlan
from composer_par.findings import Finding
from composer_par.plugin import Plugin, Stage, hookimpl, ordering_option
from composer_par.plugin.caller import HookCaller
from composer_par.plugin.view import PlanView


@attrs.frozen
class Says(Plugin):
    """Answers validate_plan and describe with its own name."""

    name: ClassVar[str] = "says"
    word: str = "a"
    after: tuple[str, ...] = ordering_option()

    @hookimpl
    def composer_par_validate_plan(self) -> list[Finding]:
        return [Finding("X001", self.word, severity="info")]

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        return [("finalize", self.word)]


def _sayer(name: str, **impl: Any) -> type[Plugin]:
    """A plugin class named ``name`` whose validate_plan has hookimpl options ``impl``."""

    def validate(self: Plugin) -> list[Finding]:
        return [Finding("X001", name, severity="info")]

    cls = type(name, (Plugin,), {
        "name": name,
        "composer_par_validate_plan": hookimpl(**impl)(validate),
    })
    return attrs.frozen(cls)


def _messages(plan: ParallelPlan) -> list[str]:
    return [f.message for f in plan.validate().findings if f.code == "X001"]


def test_implementations_run_in_use_order() -> None:
    plan = ParallelPlan(MeshSpec())
    for name in ("one", "two", "three"):
        plan.use(_sayer(name)())
    assert _messages(plan) == ["one", "two", "three"]


def test_after_reorders_every_hook() -> None:
    plan = ParallelPlan(MeshSpec()).use(Says("late", after="says2")).use(_sayer("says2")())
    assert _messages(plan) == ["says2", "late"]


def test_tryfirst_and_trylast_are_honoured() -> None:
    plan = (ParallelPlan(MeshSpec()).use(_sayer("plain")()).use(_sayer("last", trylast=True)())
            .use(_sayer("first", tryfirst=True)()))
    assert _messages(plan) == ["first", "plain", "last"]


def test_new_style_wrapper_sees_and_changes_the_result() -> None:
    seen: list[list[str]] = []

    @attrs.frozen
    class Filter(Plugin):
        name: ClassVar[str] = "filter"

        @hookimpl(wrapper=True)
        def composer_par_validate_plan(self) -> Generator[None, Any, Any]:
            answers = yield
            seen.append([f.message for group in answers for f in group])
            # Drop the findings saying "drop", add one of its own.
            kept = [[f for f in group if f.message != "drop"] for group in answers]
            return [*kept, [Finding("X001", "added by the wrapper")]]

    plan = ParallelPlan(MeshSpec()).use(Says("keep")).use(Filter()).use(Says("drop"))
    report = plan.validate()
    assert seen == [["keep", "drop"]]
    found = {f.message: f.plugin for f in report.findings if f.code == "X001"}
    # The wrapper's own finding names the wrapper: it ran as the current plugin.
    assert found == {"keep": "says", "added by the wrapper": "filter"}


def test_old_style_hookwrapper_runs_around_the_call() -> None:
    events: list[str] = []

    @attrs.frozen
    class Around(Plugin):
        name: ClassVar[str] = "around"

        @hookimpl(hookwrapper=True)
        def composer_par_describe(self) -> Generator[None, Any, None]:
            events.append("before")
            outcome = yield
            events.append(f"after {len(outcome.get_result())}")

    steps = ParallelPlan(MeshSpec()).use(Says("x")).use(Around()).explain().steps
    assert events == ["before", "after 1"]
    assert ("finalize", "says", "x") in steps


def test_firstresult_stops_at_the_first_answer() -> None:
    called: list[str] = []

    def materializer(name: str, answer: str | None) -> Plugin:
        def materialize(self: Plugin, ctx: Any) -> str | None:
            called.append(name)
            return answer

        cls = type(name, (Plugin,), {
            "name": name, "composer_par_materialize": hookimpl(materialize)})
        return attrs.frozen(cls)()

    caller = HookCaller([materializer("first", None), materializer("second", "done"),
                         materializer("third", "never")])
    result, calls = caller.call(Stage.MATERIALIZE.value, ctx=None)
    assert result == "done"
    assert called == ["first", "second"]
    assert [c.plugin.name for c in calls] == ["first", "second"]


def test_specname_implements_a_hook_under_another_method_name() -> None:
    @attrs.frozen
    class Named(Plugin):
        name: ClassVar[str] = "named"

        @hookimpl(specname="composer_par_finalize")
        def tidy_up(self, ctx: Any) -> str:
            return "tidied"

    assert Named.stages() == (Stage.FINALIZE,)
    model = nn.Linear(2, 2)
    plan = ParallelPlan(MeshSpec()).use(Named())
    plan.apply(model)
    assert [(s.stage, s.plugin, s.detail) for s in plan.applied] == [
        ("finalize", "named", "tidied")]


def test_hook_call_monitoring_sees_validate_calls() -> None:
    plan = ParallelPlan(MeshSpec()).use(Says("m"))
    hooks: list[str] = []
    plan.hooks.manager.add_hookcall_monitoring(
        lambda name, impls, kwargs: hooks.append(name), lambda *a: None)
    plan.validate()
    assert "composer_par_validate_plan" in hooks
    assert "composer_par_comm_hooks" in hooks


@pytest.mark.parametrize("action", ["validate", "explain", "apply"])
def test_one_caller_per_plan(monkeypatch: pytest.MonkeyPatch, action: str) -> None:
    built: list[HookCaller] = []
    original = HookCaller.__init__

    def counting(self: HookCaller, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(HookCaller, "__init__", counting)
    plan = ParallelPlan(MeshSpec()).use(MetaInit(seed=0)).use(_sayer("quiet")())
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    if action == "validate":
        plan.validate(model)
    elif action == "explain":
        plan.explain()
    else:
        plan.apply(model)
    assert len(built) == 1
    # Asked again, the plan reuses it; a plugin added later makes a new one.
    plan.validate()
    plan.explain()
    assert len(built) == 1
    plan.use(Says("t"))
    plan.validate()
    assert len(built) == 2


def test_hooks_get_a_read_only_view_without_plugin_objects() -> None:
    got: list[Any] = []

    @attrs.frozen
    class Looks(Plugin):
        name: ClassVar[str] = "looks"

        @hookimpl
        def composer_par_validate_plan(self, plan: Any) -> list[Finding]:
            got.append(plan)
            return []

    plan = ParallelPlan(MeshSpec(dp_shard=1)).use(Looks()).use(Says("v"))
    plan.validate()
    (view,) = got
    assert isinstance(view, PlanView)
    assert view.plugin_names == ("looks", "says")
    assert view.mesh == plan.mesh
    assert not hasattr(view, "plugins")
    with pytest.raises(AttributeError):
        view.mesh = MeshSpec()  # type: ignore[misc]


def test_plans_of_the_same_plugin_objects_share_one_manager() -> None:
    seen: list[Any] = []

    @attrs.frozen
    class Mesh(Plugin):
        name: ClassVar[str] = "mesh"

        @hookimpl
        def composer_par_validate_plan(self, plan: Any) -> list[Finding]:
            seen.append(plan.mesh)
            return []

    first = ParallelPlan(MeshSpec(dp_shard=2)).use(Mesh()).use(Says("s"))
    second = ParallelPlan(MeshSpec(dp_shard=4))
    for plugin in first.plugins:
        second.use(plugin)
    second.share_hooks(first)
    assert second.hooks.manager is first.hooks.manager
    # each plan's hooks see their own plan
    first.validate()
    second.validate()
    assert seen == [MeshSpec(dp_shard=2), MeshSpec(dp_shard=4)]
    # equal plugins are not the same objects: no sharing
    third = ParallelPlan(MeshSpec(dp_shard=4)).use(Mesh()).use(Says("s"))
    with pytest.raises(ValueError, match="different plugin objects"):
        third.share_hooks(first)


def test_nested_hook_calls_keep_attribution() -> None:
    """A hook that asks the plan view (another hook call) still names its own findings."""

    @attrs.frozen
    class Asks(Plugin):
        name: ClassVar[str] = "asks"

        @hookimpl
        def composer_par_validate_plan(self, plan: PlanView) -> list[Finding]:
            plan.replicate_dims()
            return [Finding("X001", "asked")]

    @attrs.frozen
    class Replicates(Plugin):
        name: ClassVar[str] = "replicates"

        @hookimpl
        def composer_par_replicate_dims(self) -> list[str]:
            return ["dp_replicate"]

    plan = ParallelPlan(MeshSpec()).use(Asks()).use(Replicates())
    (finding,) = [f for f in plan.validate().findings if f.code == "X001"]
    assert finding.plugin == "asks"
    assert plan.replicate_dims() == ["dp_replicate"]
