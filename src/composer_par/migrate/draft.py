"""The plan an import builds up: mesh dims, plugins and their options, findings, and for
every source key what it became (the ``--explain`` listing).

Each reader (accelerate, DeepSpeed, the Trainer's arguments, FSDP1's Python arguments)
walks its source once and tells a :class:`Draft` what each key means; :meth:`Draft.finish`
then builds the plan through the plan-file reader (so every option is checked as a plan
file's would be) and validates it. Nothing here imports torch or a built-in plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.findings import Finding, Report
from composer_par.planfile import PlanFileError, parts_from_data, toml_value

if TYPE_CHECKING:
    from composer_par.plan import ParallelPlan

#: Mesh dims in the order a plan file lists them: the rank layout, outermost first.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
#: Plugins in the order the written plan lists them.
PLUGIN_ORDER = ("pp", "hsdp", "fsdp2", "ep", "cp", "tp", "activation_checkpoint", "compile")


#: The longest a source value is shown in a message or the listing: a config's values
#: are short, and a long one is cut rather than copied into every line that names it.
SHOWN_CHARS = 200


def shown(value: Any) -> str:
    """A source value as the listing shows it (cut after :data:`SHOWN_CHARS`)."""
    parts: list[str] = []
    _show(value, parts, [0])
    text = "".join(parts)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _show(value: Any, parts: list[str], used: list[int]) -> None:
    """Append ``value``'s text to ``parts``, stopping once they pass SHOWN_CHARS (a
    value with aliases expanded may be huge: it is never written out whole)."""
    if used[0] > SHOWN_CHARS:
        return
    if isinstance(value, (Mapping, list, tuple)):
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        parts.append("{" if isinstance(value, Mapping) else "[")
        for i, (key, item) in enumerate(items):
            if used[0] > SHOWN_CHARS:
                break
            head = (", " if i else "") + (f"{key}: " if isinstance(value, Mapping) else "")
            parts.append(head)
            used[0] += len(head)
            _show(item, parts, used)
        parts.append("}" if isinstance(value, Mapping) else "]")
        return
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = value
    else:
        text = repr(value)
    text = text[:SHOWN_CHARS + 1]
    parts.append(text)
    used[0] += len(text)


@attrs.frozen
class Mapped:
    """One source key: its value, the plan lines it became, and the code of the finding
    it gave (None when it has an equal in the plan)."""

    key: str
    value: str
    plan: tuple[str, ...] = ()
    code: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "plan": list(self.plan),
                "code": self.code}


class ImportFailed(Exception):
    """The source could not be imported at all; ``.report`` says why (CP901, CP902, CP913)."""

    def __init__(self, report: Report, source: str = "") -> None:
        self.report = report
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}cannot import\n{report.format()}")


@attrs.define
class Draft:
    """The plan taking shape while a source is read."""

    tool: str  # "accelerate", "deepspeed", "Trainer", "FSDP1": the label of its findings
    mesh: dict[str, int] = attrs.field(factory=dict)
    plugins: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    topology: dict[str, int] | None = None
    findings: list[Finding] = attrs.field(factory=list)
    mapped: list[Mapped] = attrs.field(factory=list)
    # Errors that stop the import: the plan cannot be written.
    fatal: list[Finding] = attrs.field(factory=list)

    # -- what a key becomes ---------------------------------------------------------------

    def dim(self, name: str, size: int) -> str:
        self.mesh[name] = size
        return f"[mesh] {name} = {size}"

    def use(self, plugin: str) -> str:
        self.plugins.setdefault(plugin, {})
        return f"[[plugins]] {plugin}"

    def option(self, plugin: str, option: str, value: Any) -> str:
        self.plugins.setdefault(plugin, {})[option] = value
        return f"[[plugins]] {plugin}: {option} = {toml_value(value)}"

    def has(self, plugin: str) -> bool:
        return plugin in self.plugins

    def map(self, key: str, value: Any, *plan: str) -> None:
        """``key = value`` has an equal: the plan lines ``plan`` (none: nothing to do)."""
        self.mapped.append(Mapped(key, shown(value), tuple(plan)))

    def find(self, code: str, key: str, value: Any, message: str, fix: str,
             *plan: str) -> None:
        """``key = value`` has no (exact) equal: finding ``code``; ``plan`` what the plan
        does instead."""
        self.findings.append(Finding(code, f"{key} = {shown(value)}: {message}", fix=fix,
                                     plugin=self.tool))
        self.mapped.append(Mapped(key, shown(value), tuple(plan), code))

    def note(self, code: str, key: str, value: Any) -> None:
        """``key = value`` is one of several that one finding (:meth:`report`) covers."""
        self.mapped.append(Mapped(key, shown(value), (), code))

    def report(self, code: str, message: str, fix: str) -> None:
        self.findings.append(Finding(code, message, fix=fix, plugin=self.tool))

    def refuse(self, code: str, key: str, value: Any, message: str, fix: str) -> None:
        """``key = value`` makes the plan impossible to write (an error)."""
        finding = Finding(code, f"{key} = {shown(value)}: {message}", fix=fix, plugin=self.tool)
        self.fatal.append(finding)
        self.mapped.append(Mapped(key, shown(value), (), code))

    # -- the plan ----------------------------------------------------------------------------

    def data(self) -> dict[str, Any]:
        """The plan file as a dict, in the order a plan file lists it."""
        mesh = {d: self.mesh[d] for d in MESH_ORDER if d in self.mesh}
        mesh.update({d: s for d, s in self.mesh.items() if d not in mesh})
        names = [p for p in PLUGIN_ORDER if p in self.plugins]
        names += [p for p in self.plugins if p not in names]
        out: dict[str, Any] = {"mesh": mesh}
        if self.topology is not None:
            out["topology"] = dict(self.topology)
        out["plugins"] = [{"name": n, **self.plugins[n]} for n in names]
        return out

    def finish(self, source: str, world_size: int | None) -> ImportResult:
        """The imported plan, validated; raises :class:`ImportFailed` when it cannot be
        written (an error of the source, or a plan the plan-file reader refuses)."""
        from composer_par.plan import ParallelPlan

        if self.fatal:
            raise ImportFailed(Report.of([*self.fatal, *self.findings]), source)
        try:
            plan = ParallelPlan.from_parts(parts_from_data(self.data(), name=source))
        except PlanFileError as exc:  # an option value the plugin refuses
            raise ImportFailed(Report.of([*exc.report.findings, *self.findings]),
                               source) from exc
        if world_size is None and self.topology is not None:
            world_size = self.topology["nodes"] * self.topology["devices_per_node"]
        validation = plan.validate(world_size=world_size)
        return ImportResult(self.tool, source, plan.to_toml(), tuple(self.mapped),
                            Report.of([*self.findings, *validation.findings]), world_size)


@attrs.frozen
class ImportResult:
    """What ``composer-par import`` gives: the plan file's text, every source key with what
    it became, and the report (the import's findings, then the plan's validation)."""

    tool: str
    source: str
    toml: str
    mapped: tuple[Mapped, ...]
    report: Report
    world_size: int | None = None

    def plan(self) -> ParallelPlan:
        """The imported plan (read back from its text, as a user's run would)."""
        from composer_par.plan import ParallelPlan

        return ParallelPlan.from_toml(self.toml)

    def text(self) -> str:
        """The plan file, headed by where it comes from."""
        head = (f"# imported from {self.source} ({self.tool}) by composer-par import;\n"
                "# run `composer-par import --explain` to see what each setting became\n")
        return head + self.toml

    def explain(self) -> str:
        """Each source key beside the plan lines it became (or the finding it gave)."""
        width = min(48, max((len(m.key) + len(m.value) + 3 for m in self.mapped), default=0))
        lines = []
        for m in self.mapped:
            left = f"{m.key} = {m.value}"
            if m.code is not None:
                right = [*m.plan, f"see {m.code}"] if m.plan else [f"(left out: see {m.code})"]
            else:
                right = list(m.plan) or ["(nothing to set: the plan's default)"]
            lines.append(f"{left:<{width}}  ->  {'; '.join(right)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"tool": self.tool, "source": self.source, "plan": self.toml,
                "world_size": self.world_size,
                "mapped": [m.to_dict() for m in self.mapped], **self.report.to_dict()}
