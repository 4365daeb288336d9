"""A typed facade over pluggy's hook caller, so core call sites are type-checked.

The facade also fixes the call order. pluggy calls implementations last-registered
first; composer_par calls them in the plan's order: ``use()`` order, adjusted within
a stage by the plugins' declared ``after``/``before``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from composer_par.findings import Finding
from composer_par.plugin import hookspecs
from composer_par.plugin.base import PROJECT, Declaration, Plugin, Stage

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.blocks import Block, BlockSpec
    from composer_par.estimate import Layout, ModelShape, Workload
    from composer_par.mesh import MeshSpec
    from composer_par.plan import ParallelPlan
    from composer_par.plugin.comm import CommHook
    from composer_par.plugin.context import ApplyContext
    from composer_par.topology import Topology

TRACE_ENV = "COMPOSER_PAR_TRACE_HOOKS"


class HookError(TypeError):
    """A plugin implements a hook wrongly (misspelled name, unknown argument)."""

    def __init__(self, message: str, plugin: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin


class Hooks:
    """The hooks of one plan's plugins, called in the plan's order."""

    def __init__(self, plugins: Sequence[Plugin]) -> None:
        self.plugins = list(plugins)
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(hookspecs)
        # pluggy refuses a plugin equal to one it holds (frozen attrs compare by value),
        # so an equal plugin used twice is registered once and answers for both; CP204
        # still reports it, as each use declares.
        self._held: dict[int, Plugin] = {}
        for index, plugin in enumerate(self.plugins):
            twin = next((p for p in self._held.values() if p == plugin), None)
            self._held[id(plugin)] = twin or plugin
            if twin is not None:
                continue
            try:
                self._pm.register(plugin, name=f"{plugin.name or type(plugin).__name__}#{index}")
            except pluggy.PluginValidationError as exc:
                raise HookError(f"plugin {plugin.name!r}: {exc}", plugin.name) from exc
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            owner = getattr(exc.plugin, "name", None)
            raise HookError(f"{exc} (hook names are listed in composer_par.plugin.hookspecs)",
                            owner) from exc
        if os.environ.get(TRACE_ENV):
            self._pm.trace.root.setwriter(print)
            self._pm.enable_tracing()
        self._declarations: list[tuple[Plugin, Declaration]] | None = None

    # -- generic ordered calling -----------------------------------------------------

    def _each(self, hook: str, **kwargs: Any) -> list[tuple[Plugin, Any]]:
        """Call ``hook`` on every implementing plugin in ``use()`` order."""
        caller = getattr(self._pm.hook, hook)
        by_plugin = {id(impl.plugin): impl for impl in caller.get_hookimpls()}
        results = []
        for plugin in self.plugins:
            impl = by_plugin.get(id(self._held[id(plugin)]))
            if impl is not None:
                args = {name: kwargs[name] for name in impl.argnames}
                results.append((plugin, impl.function(**args)))
        return results

    # -- declaration, validation, composition -----------------------------------------

    def declarations(self) -> list[Declaration]:
        return [d for _, d in self._declared()]

    def _declared(self) -> list[tuple[Plugin, Declaration]]:
        if self._declarations is None:
            self._declarations = [(p, d) for p, d in self._each("composer_par_declare") if d]
        return self._declarations

    def name_of(self, plugin: Plugin) -> str:
        """The name a plugin declared (what after/before refer to)."""
        return next((d.plugin for p, d in self._declared() if p is plugin), plugin.name)

    def validate_plan(
        self, plan: ParallelPlan, mesh: MeshSpec, topology: Topology | None
    ) -> list[Finding]:
        return _attributed(
            self._each("composer_par_validate_plan", plan=plan, mesh=mesh, topology=topology)
        )

    def validate_model(
        self, plan: ParallelPlan, model: nn.Module, blocks: list[Block], mesh: MeshSpec
    ) -> list[Finding]:
        return _attributed(self._each(
            "composer_par_validate_model", plan=plan, model=model, blocks=blocks, mesh=mesh
        ))

    def replicate_dims(self, plan: ParallelPlan) -> list[str]:
        dims: list[str] = []
        for _, answer in self._each("composer_par_replicate_dims", plan=plan):
            dims.extend(d for d in answer or () if d not in dims)
        return dims

    def comm_hooks(self, plan: ParallelPlan) -> list[CommHook]:
        """Every plugin's comm hooks, in plan order, each naming the plugin that gave it."""
        import attrs

        out: list[CommHook] = []
        for plugin, answer in self._each("composer_par_comm_hooks", plan=plan):
            for hook in answer or ():
                out.append(hook if hook.plugin else attrs.evolve(hook, plugin=self.name_of(plugin)))
        return out

    def block_specs(self, plan: ParallelPlan) -> list[tuple[str, BlockSpec]]:
        return [
            (p.name, spec) for p, spec in self._each("composer_par_block_spec", plan=plan) if spec
        ]

    def state_dict_adapters(self, plan: ParallelPlan, model: nn.Module) -> list[Any]:
        """The name-mapping adapters plugins contribute, in the plan's order."""
        return [a for _, a in self._each("composer_par_state_dict_adapter", plan=plan,
                                         model=model) if a is not None]

    def estimate_parts(
        self, plan: ParallelPlan, layout: Layout, model: ModelShape, workload: Workload
    ) -> list[tuple[str, Any]]:
        """(plugin name, answer) for each plugin answering the estimate hook, in plan order."""
        answers = self._each("composer_par_estimate", plan=plan, layout=layout, model=model,
                             workload=workload)
        return [(self.name_of(p), part) for p, part in answers if part is not None]

    def describe(self, plan: ParallelPlan) -> list[tuple[Plugin, str, str]]:
        described = {
            id(p): steps for p, steps in self._each("composer_par_describe", plan=plan) if steps
        }
        out: list[tuple[Plugin, str, str]] = []
        for plugin in self.ordered():
            steps = described.get(id(plugin)) or [
                (s.label, f"{s.label.replace('_', ' ')}") for s in plugin.stages()
            ]
            out.extend((plugin, stage, text) for stage, text in steps)
        return out

    # -- stages ----------------------------------------------------------------------

    def ordered(self, subset: Sequence[Plugin] | None = None) -> list[Plugin]:
        """Plugins in ``use()`` order adjusted by after/before (cycles: left as used)."""
        from composer_par.rules import ordering_edges

        pool = list(self.plugins if subset is None else subset)
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
        caller = getattr(self._pm.hook, stage.value)
        ids = {id(impl.plugin) for impl in caller.get_hookimpls()}
        return self.ordered([p for p in self.plugins if id(self._held[id(p)]) in ids])

    def call_stage(self, stage: Stage, plugin: Plugin, ctx: ApplyContext) -> str | None:
        caller = getattr(self._pm.hook, stage.value)
        for impl in caller.get_hookimpls():
            if impl.plugin is self._held[id(plugin)]:
                result = impl.function(**{name: ctx for name in impl.argnames})
                return None if result is None else str(result)
        raise HookError(f"plugin {plugin.name!r} does not implement {stage.value}")


def _attributed(results: list[tuple[Plugin, Any]]) -> list[Finding]:
    """Findings from a plugin's hook name that plugin unless they name another."""
    import attrs

    out: list[Finding] = []
    for plugin, findings in results:
        for finding in findings or ():
            out.append(finding if finding.plugin else attrs.evolve(finding, plugin=plugin.name))
    return out
