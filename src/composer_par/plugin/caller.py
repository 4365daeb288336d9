"""One plan's hook caller: every hook call goes through pluggy, in the plan's order.

pluggy calls the implementations of a hook last-registered first, after moving
``tryfirst`` ones to the front and ``trylast`` ones to the back, and runs wrappers
(``wrapper=True`` and old-style ``hookwrapper=True``) around them. The caller keeps all
of that: it registers the plan's plugins in the reverse of the plan's order (``use()``
order, adjusted by the plugins' declared ``after``/``before``), so that pluggy's own
hook calling yields the plan's order for every hook. Hook-call monitoring
(``add_hookcall_monitoring``), tracing (``COMPOSER_PAR_TRACE_HOOKS=1``), wrappers,
``tryfirst``/``trylast`` and ``firstresult`` therefore mean what pluggy says.

What pluggy does not say is which plugin gave which answer, and the plan needs that
(a finding names its plugin; ``explain`` lists each plugin's steps; ``apply`` logs one
event per applied step). Each plugin is therefore registered through a small proxy whose
hook functions call the plugin's own methods unchanged, and on the way record the
answer and the plugin that gave it, and set the plugin as the *current plugin*, which
:class:`~composer_par.findings.Finding` reads when no plugin is named.

A plan builds one caller (``ParallelPlan.hooks``) and rebuilds it only when its plugins
change; hooks reach it as ``ctx.hooks`` or through the plan view they are given.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import inspect
import os
import sys
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import pluggy

from composer_par.findings import CURRENT_PLUGIN, Finding
from composer_par.plugin import hookspecs
from composer_par.plugin.base import PROJECT, Declaration, FoldedDim, LaunchDim, Plugin, Stage

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.blocks import Block, BlockSpec
    from composer_par.estimate import Layout, ModelShape, Workload
    from composer_par.mesh import MeshSpec
    from composer_par.plan import ParallelPlan
    from composer_par.plugin.comm import CommHook
    from composer_par.plugin.context import ApplyContext
    from composer_par.plugin.view import PlanView
    from composer_par.topology import Topology

TRACE_ENV = "COMPOSER_PAR_TRACE_HOOKS"
_MARK = f"{PROJECT}_impl"


class HookError(TypeError):
    """A plugin implements a hook wrongly (misspelled name, unknown argument)."""

    def __init__(self, message: str, plugin: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin


@attrs.define
class Call:
    """One implementation's call during one hook call: who answered, what, how long."""

    plugin: Plugin
    hook: str
    answer: Any
    seconds: float


# The calls recorded during the hook call now in progress (nested hook calls, e.g. a
# hook asking the plan view for the replicate dims, record into their own list).
_CALLS: contextvars.ContextVar[list[Call] | None] = contextvars.ContextVar(
    "composer_par_hook_calls", default=None
)


class HookCaller:
    """The hooks of one plan's plugins, called through pluggy in the plan's order.

    ``plan`` is the read-only view handed to hooks that take a ``plan`` argument; None
    for a caller used on its own (tests, tools).
    """

    def __init__(self, plugins: Sequence[Plugin], plan: PlanView | None = None) -> None:
        self.plugins: tuple[Plugin, ...] = tuple(plugins)
        self.plan = plan
        self._proxies = [_Proxy(p, f"{p.name or type(p).__name__}#{i}")
                         for i, p in enumerate(self.plugins)]
        self._pm = self._manager(reversed(self._proxies))
        self._declarations: list[tuple[Plugin, Declaration]] | None = None
        self._order: list[Plugin] | None = None
        order = self.ordered()
        if order != list(self.plugins):
            by_plugin = {id(p.plugin): p for p in self._proxies}
            self._pm = self._manager(by_plugin[id(p)] for p in reversed(order))

    def _manager(self, proxies: Iterable[_Proxy]) -> pluggy.PluginManager:
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(hookspecs)
        for proxy in proxies:
            try:
                pm.register(proxy, name=proxy.registered_name)
            except pluggy.PluginValidationError as exc:
                raise HookError(f"plugin {proxy.plugin.name!r}: {exc}",
                                proxy.plugin.name) from exc
        try:
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            owner = getattr(getattr(exc.plugin, "plugin", None), "name", None)
            raise HookError(f"{exc} (hook names are listed in composer_par.plugin.hookspecs)",
                            owner) from exc
        if os.environ.get(TRACE_ENV):
            # stderr: stdout may carry a command's JSON answer.
            pm.trace.root.setwriter(sys.stderr.write)
            pm.enable_tracing()
        return pm

    def for_plan(self, plan: ParallelPlan) -> HookCaller:
        """This caller for another plan of these very plugin objects: pluggy's manager,
        the proxies and the order shared, the plan view its own. Building a caller
        registers every plugin with pluggy; suggest estimates thousands of plans of a
        few plugin sets."""
        from composer_par.plugin.view import PlanView

        caller = copy.copy(self)
        caller.plan = PlanView(plan, caller)
        return caller

    @property
    def manager(self) -> pluggy.PluginManager:
        """pluggy's manager, e.g. for ``add_hookcall_monitoring``."""
        return self._pm

    # -- calling -------------------------------------------------------------------------

    def call(self, hook: str, **kwargs: Any) -> tuple[Any, list[Call]]:
        """Call ``hook`` through pluggy; returns pluggy's result and the calls made.

        Arguments the hook's spec names but the caller does not give (``plan``) are
        filled from the caller.
        """
        caller = getattr(self._pm.hook, hook)
        if "plan" not in kwargs and "plan" in _spec_args(caller):
            kwargs["plan"] = self.plan
        calls: list[Call] = []
        token = _CALLS.set(calls)
        try:
            result = caller(**kwargs)
        finally:
            _CALLS.reset(token)
        return result, calls

    def answers(self, hook: str, **kwargs: Any) -> list[tuple[Plugin, Any]]:
        """Every non-None answer to ``hook`` with the plugin that gave it, in call order.

        An answer a wrapper put in place of the implementations' is attributed to the
        plugin of the implementation whose answer it replaced when that is known, else to
        the wrapping plugin when there is one.
        """
        result, calls = self.call(hook, **kwargs)
        caller = getattr(self._pm.hook, hook)
        results = [result] if _is_firstresult(caller) else list(result or ())
        owners = {id(c.answer): c.plugin for c in calls if c.answer is not None}
        wrappers = [impl.plugin.plugin for impl in caller.get_hookimpls()
                    if impl.wrapper or impl.hookwrapper]
        fallback = wrappers[0] if len(wrappers) == 1 else None
        out: list[tuple[Plugin, Any]] = []
        for answer in results:
            if answer is None:
                continue
            owner = owners.get(id(answer), fallback)
            if owner is not None:
                out.append((owner, answer))
        return out

    # -- declaration, validation, composition -----------------------------------------

    def declarations(self) -> list[Declaration]:
        return [d for _, d in self._declared()]

    def _declared(self) -> list[tuple[Plugin, Declaration]]:
        if self._declarations is None:
            answered = self.answers("composer_par_declare")
            by_plugin = {id(p): d for p, d in answered}
            # In use() order: the plan's order is computed from these.
            self._declarations = [(p, by_plugin[id(p)]) for p in self.plugins
                                  if id(p) in by_plugin]
        return self._declarations

    def name_of(self, plugin: Plugin) -> str:
        """The name a plugin declared (what after/before refer to)."""
        return next((d.plugin for p, d in self._declared() if p is plugin), plugin.name)

    def validate_plan(self, mesh: MeshSpec, topology: Topology | None) -> list[Finding]:
        return _findings(self.answers("composer_par_validate_plan", mesh=mesh,
                                      topology=topology), self)

    def validate_model(self, model: nn.Module, blocks: list[Block], mesh: MeshSpec
                       ) -> list[Finding]:
        return _findings(self.answers("composer_par_validate_model", model=model,
                                      blocks=blocks, mesh=mesh), self)

    def replicate_dims(self) -> list[str]:
        dims: list[str] = []
        for _, answer in self.answers("composer_par_replicate_dims"):
            dims.extend(d for d in answer if d not in dims)
        return dims

    def folded_dims(self) -> list[FoldedDim]:
        """Every plugin's folded dims, once each (the first answer for a dim kept)."""
        out: list[FoldedDim] = []
        for _, answer in self.answers("composer_par_folded_dims"):
            out.extend(f for f in answer if f.dim not in {o.dim for o in out})
        return out

    def launch_dims(self) -> list[LaunchDim]:
        """Every plugin's launch dims, once each (the first answer for a dim kept)."""
        out: list[LaunchDim] = []
        for _, answer in self.answers("composer_par_launch_dims"):
            out.extend(d for d in answer if d.dim not in {o.dim for o in out})
        return out

    def shard_apart(self, model: nn.Module) -> list[Any]:
        """Every plugin's ``ShardApart`` answers for ``model``, in plan order."""
        return [a for _, answer in self.answers("composer_par_shard_apart", model=model)
                for a in answer]

    def comm_hooks(self) -> list[CommHook]:
        """Every plugin's comm hooks, in plan order, each naming the plugin that gave it."""
        out: list[CommHook] = []
        for plugin, answer in self.answers("composer_par_comm_hooks"):
            for hook in answer:
                out.append(hook if hook.plugin else attrs.evolve(hook, plugin=self.name_of(plugin)))
        return out

    def step_begin(self, model: nn.Module) -> None:
        """Every plugin's ``composer_par_step_begin``, in plan order."""
        self.call("composer_par_step_begin", model=model)

    def step_commit(self, model: nn.Module, optimizer: Any) -> bool:
        """Whether every plugin lets this step apply (no answer is False); every plugin is
        asked, in plan order."""
        answers = self.answers("composer_par_step_commit", model=model, optimizer=optimizer)
        return all(answer is not False for _, answer in answers)

    def block_specs(self) -> list[tuple[str, BlockSpec]]:
        return [(self.name_of(p), spec) for p, spec in self.answers("composer_par_block_spec")]

    def state_dict_adapters(self, model: nn.Module) -> list[Any]:
        """The name-mapping adapters plugins contribute, in the plan's order."""
        return [a for _, a in self.answers("composer_par_state_dict_adapter", model=model)]

    def estimate_pipelines(self, layout: Layout, model: ModelShape, workload: Workload
                           ) -> list[tuple[str, Any]]:
        """(plugin name, answer) for each plugin stating a pipeline, in plan order."""
        answers = self.answers("composer_par_estimate_pipeline", layout=layout, model=model,
                               workload=workload)
        return [(self.name_of(p), answer) for p, answer in answers]

    def estimate_shapes(self, layout: Layout, model: ModelShape) -> list[tuple[str, Any]]:
        """(plugin name, answer) for each plugin stating the model one rank holds, in plan
        order (the estimator applies each to the one before)."""
        out: list[tuple[str, Any]] = []
        for plugin in self.ordered():
            answer = self._one(plugin, "composer_par_estimate_shape", layout=layout,
                               model=model)
            if answer is not None:
                out.append((self.name_of(plugin), answer))
                model = answer
        return out

    def estimate_parts(self, layout: Layout, model: ModelShape, workload: Workload,
                       stage: Any = None) -> list[tuple[str, Any]]:
        """(plugin name, answer) for each plugin answering the estimate hook, in plan order."""
        answers = self.answers("composer_par_estimate", layout=layout, model=model,
                               workload=workload, stage=stage)
        return [(self.name_of(p), part) for p, part in answers]

    def estimate_comm_hook(self, plugin: str, layout: Layout, model: ModelShape,
                           workload: Workload, collective: Any) -> Any:
        """What the plugin named ``plugin`` (whose comm hook customizes ``collective``'s
        mesh dim) says runs in place of ``collective``, or None."""
        for p in self.plugins:
            if self.name_of(p) == plugin:
                return self._one(p, "composer_par_estimate_comm_hook", layout=layout,
                                 model=model, workload=workload, collective=collective)
        return None

    def _one(self, plugin: Plugin, hook: str, **kwargs: Any) -> Any:
        """``plugin``'s own answer to ``hook`` (None when it does not implement it)."""
        caller = getattr(self._pm.hook, hook)
        if "plan" not in kwargs and "plan" in _spec_args(caller):
            kwargs["plan"] = self.plan
        for impl in caller.get_hookimpls():
            if impl.plugin.plugin is plugin and not (impl.wrapper or impl.hookwrapper):
                return impl.function(*(kwargs[a] for a in impl.argnames))
        return None
    def parallel_style(self, module: nn.Module, style: Any) -> Any:
        """The style plugins give ``module`` in place of ``style`` (the composition hook
        ``composer_par_parallel_style``), or ``style`` when none answers."""
        answers = self.answers("composer_par_parallel_style", module=module, style=style)
        if len(answers) > 1:
            names = " and ".join(self.name_of(p) for p, _ in answers)
            raise RuntimeError(f"{names} each give {type(module).__name__} a tensor-parallel "
                               "style of their own: at most one plugin may restyle a module")
        return answers[0][1] if answers else style

    def parameters_changed(self, model: nn.Module) -> None:
        """Tell every plugin that ``model``'s parameters may change before its next
        forward (``composer_par_parameters_changed``)."""
        self.call("composer_par_parameters_changed", model=model)

    def describe(self) -> list[tuple[Plugin, str, str]]:
        described: dict[int, list[tuple[str, str]]] = {}
        for plugin, steps in self.answers("composer_par_describe"):
            if steps:
                described.setdefault(id(plugin), []).extend(steps)
        out: list[tuple[Plugin, str, str]] = []
        for plugin in self.ordered():
            steps = described.get(id(plugin)) or [
                (s.label, s.label.replace("_", " ")) for s in self.stages_of(plugin)
            ]
            out.extend((plugin, stage, text) for stage, text in steps)
        return out

    # -- stages ----------------------------------------------------------------------

    def ordered(self, subset: Sequence[Plugin] | None = None) -> list[Plugin]:
        """Plugins in ``use()`` order adjusted by after/before (cycles: left as used)."""
        if self._order is None:
            self._order = self._sort(list(self.plugins))
        if subset is None:
            return list(self._order)
        chosen = {id(p) for p in subset}
        return [p for p in self._order if id(p) in chosen]

    def _sort(self, pool: list[Plugin]) -> list[Plugin]:
        from composer_par.rules import ordering_edges

        edges = ordering_edges(self.declarations())
        ordered: list[Plugin] = []
        while pool:
            waiting = {self.name_of(p) for p in pool}
            ready = [
                p for p in pool
                if not any(b == self.name_of(p) and a in waiting for a, b in edges)
            ]
            # No plugin ready means a cycle (reported as CP205): keep use() order.
            chosen = ready[0] if ready else pool[0]
            ordered.append(chosen)
            pool.remove(chosen)
        return ordered

    def implementers(self, stage: Stage) -> list[Plugin]:
        """The plugins implementing ``stage``, in the order pluggy will call them."""
        impls = getattr(self._pm.hook, stage.value).get_hookimpls()
        return [impl.plugin.plugin for impl in reversed(impls)
                if not (impl.wrapper or impl.hookwrapper)]

    def stages_of(self, plugin: Plugin) -> list[Stage]:
        """The stages ``plugin`` implements (pluggy's ``specname`` included)."""
        return [s for s in Stage if any(impl.plugin.plugin is plugin for impl in
                                        getattr(self._pm.hook, s.value).get_hookimpls())]

    def call_stage(self, stage: Stage, ctx: ApplyContext) -> list[Call]:
        """Run one stage of the apply order through pluggy: every implementing plugin,
        in plan order. Returns each implementation's call (answer: its description)."""
        _, calls = self.call(stage.value, ctx=ctx)
        return [c for c in calls if c.hook == stage.value]

    def estimate_settings(self) -> list[tuple[str, Any]]:
        """(plugin name, answer) for each plugin answering the estimate-settings hook, in
        plan order (the estimator merges and checks them)."""
        return [(self.name_of(p), answer)
                for p, answer in self.answers("composer_par_estimate_settings")]


def _spec_args(caller: Any) -> tuple[str, ...]:
    spec = getattr(caller, "spec", None)
    return tuple(spec.argnames) if spec is not None else ()


def _is_firstresult(caller: Any) -> bool:
    spec = getattr(caller, "spec", None)
    return bool(spec is not None and spec.opts.get("firstresult"))


def _findings(answers: list[tuple[Plugin, Any]], caller: HookCaller) -> list[Finding]:
    """Findings name the plugin whose hook made them (the current plugin while it ran);
    one made elsewhere, e.g. a constant, is attributed to the plugin that returned it."""
    out: list[Finding] = []
    for plugin, findings in answers:
        for finding in findings:
            if not finding.plugin:
                finding = attrs.evolve(finding, plugin=caller.name_of(plugin))
            out.append(finding)
    return out


# -- the proxies pluggy holds --------------------------------------------------------------


class _Proxy:
    """What pluggy registers for one plugin: its hook implementations, wrapped.

    Each wrapped function is a plain function carrying the original's hookimpl options
    and ``__wrapped__`` (from which pluggy reads the argument names), so pluggy sees
    exactly the implementation the plugin wrote.
    """

    def __init__(self, plugin: Plugin, registered_name: str) -> None:
        self.plugin = plugin
        self.registered_name = registered_name
        self._hooks: list[str] = []
        kind: Any = type(plugin)  # a class is hashable: the cache's key
        for attr in _hook_attributes(kind):
            opts = _hook_options(inspect.getattr_static(plugin, attr, None))
            if opts is not None:
                hook = opts.get("specname") or attr
                setattr(self, attr, _scoped(plugin, hook, getattr(plugin, attr), opts))
                self._hooks.append(attr)

    def __dir__(self) -> list[str]:
        # pluggy registers what dir() lists: the hook functions alone, so that it need
        # not inspect every attribute an object has (a plan builds a caller per layout
        # suggest estimates).
        return list(self._hooks)

    def __repr__(self) -> str:
        return f"<{self.registered_name}: {self.plugin!r}>"


def _hook_options(static: Any) -> dict[str, Any] | None:
    """The hookimpl options a class attribute carries (None: not a hook implementation)."""
    function = getattr(static, "__func__", static)
    opts = getattr(function, _MARK, None)
    return opts if isinstance(opts, dict) and callable(function) else None


@functools.cache
def _hook_attributes(cls: type) -> tuple[str, ...]:
    """The attributes of a plugin class that implement hooks, found once per class."""
    return tuple(attr for attr in dir(cls)
                 if _hook_options(inspect.getattr_static(cls, attr, None)) is not None)


def _scoped(plugin: Plugin, hook: str, method: Callable[..., Any], opts: dict[str, Any]
            ) -> Callable[..., Any]:
    """``method`` run with ``plugin`` as the current plugin, its answer recorded."""
    if opts.get("wrapper") or opts.get("hookwrapper"):
        # A generator function itself: pluggy checks that wrappers are.
        def wrap(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            return (yield from _scoped_generator(plugin, method(*args, **kwargs)))

        function: Callable[..., Any] = wrap
    else:
        def run(*args: Any, **kwargs: Any) -> Any:
            token = CURRENT_PLUGIN.set(plugin)
            started = time.perf_counter()
            try:
                answer = method(*args, **kwargs)
            finally:
                CURRENT_PLUGIN.reset(token)
            calls = _CALLS.get()
            if calls is not None:
                calls.append(Call(plugin, hook, answer, time.perf_counter() - started))
            return answer

        function = run
    function.__wrapped__ = method  # type: ignore[attr-defined]
    function.__name__ = getattr(method, "__name__", hook)
    function.__qualname__ = getattr(method, "__qualname__", hook)
    setattr(function, _MARK, opts)
    return function


def _scoped_generator(plugin: Plugin, inner: Generator[Any, Any, Any]
                      ) -> Generator[Any, Any, Any]:
    """A wrapper implementation's generator, each of its steps run as ``plugin``."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        token = CURRENT_PLUGIN.set(plugin)
        try:
            value = inner.throw(thrown) if thrown is not None else inner.send(sent)
        except StopIteration as stop:
            return stop.value
        finally:
            CURRENT_PLUGIN.reset(token)
        try:
            sent, thrown = (yield value), None
        except GeneratorExit:
            inner.close()
            raise
        except BaseException as exc:
            sent, thrown = None, exc


__all__ = ["Call", "HookCaller", "HookError"]
