"""Findings, reports, and the catalog of rule codes.

Every rule has a stable code. Codes group by what they look at:

* ``CP1xx`` mesh and world size
* ``CP2xx`` plugins: claims, ordering, requirements
* ``CP3xx`` topology: which mesh dims cross nodes
* ``CP4xx`` the model (found at apply or by ``validate --model``)
* ``CP5xx`` the plan file itself (the CLI exits 2 on these)

The core rules live in :mod:`composer_par.rules`; plugins add findings through the
validation hooks using codes from this catalog (third parties use their own prefix).
"""

from __future__ import annotations

import contextvars
import difflib
import enum
import json
from collections.abc import Iterable
from typing import Any

import attrs


class Severity(enum.StrEnum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@attrs.frozen
class Rule:
    code: str
    severity: Severity
    title: str


RULES: dict[str, Rule] = {
    r.code: r
    for r in [
        Rule("CP101", Severity.ERROR, "mesh sizes do not multiply to the world size"),
        Rule("CP102", Severity.ERROR, "topology does not match the world size"),
        Rule("CP201", Severity.ERROR, "a mesh dim of size > 1 is owned by no plugin"),
        Rule("CP202", Severity.ERROR, "a mesh dim is claimed by two plugins"),
        Rule("CP203", Severity.ERROR, "a plugin claims a mesh dim the mesh does not have"),
        Rule("CP204", Severity.ERROR, "the same plugin is used twice"),
        Rule("CP205", Severity.ERROR, "plugins' after/before declarations form a cycle"),
        Rule("CP206", Severity.ERROR, "a plugin's requirement is met by no plugin in the plan"),
        Rule("CP207", Severity.ERROR, "two plugins provide a single-provider stage"),
        Rule("CP208", Severity.ERROR, "plugins disagree on where the blocks are"),
        Rule("CP209", Severity.WARNING, "after/before names a plugin that is not in the plan"),
        Rule("CP210", Severity.ERROR, "a plugin option has an invalid value"),
        Rule("CP211", Severity.ERROR, "a plugin implements a hook that does not exist"),
        Rule("CP212", Severity.ERROR, "a TP plan entry names an unknown style"),
        Rule("CP213", Severity.ERROR, "a TP plan entry has invalid style arguments"),
        Rule("CP214", Severity.ERROR, "TP options contradict the TP plan"),
        Rule("CP216", Severity.WARNING, "reshard_after_forward=false under HSDP"),
        Rule("CP217", Severity.ERROR, "a compile mode with a backend other than inductor"),
        Rule("CP218", Severity.ERROR, "a comm hook on a mesh dim no data-parallel plugin owns"),
        Rule("CP219", Severity.ERROR, "two comm hooks on one mesh dim"),
        Rule("CP220", Severity.ERROR,
             "a comm hook customizes a collective its mesh dim does not run"),
        Rule("CP221", Severity.ERROR, "compile through AOTAutograd under tensor parallelism"),
        Rule("CP301", Severity.ERROR, "reversed HSDP mesh: the shard dim crosses nodes"),
        Rule("CP302", Severity.ERROR, "the tensor-parallel dim crosses nodes"),
        Rule("CP303", Severity.ERROR, "int reshard_after_forward does not divide the shard size"),
        Rule("CP304", Severity.ERROR, "int reshard_after_forward regroups ranks across nodes"),
        Rule("CP305", Severity.WARNING, "the shard dim spans nodes"),
        Rule("CP401", Severity.ERROR, "no blocks found in the model"),
        Rule("CP402", Severity.ERROR, "parameters are already DTensors"),
        Rule("CP403", Severity.WARNING, "the model is already materialized and large"),
        Rule("CP404", Severity.ERROR, "a module that MetaInit cannot initialize"),
        Rule("CP405", Severity.ERROR, "the model has tensors on meta and no plugin materializes"),
        Rule("CP406", Severity.ERROR, "the TP size does not divide a feature size it splits"),
        Rule("CP407", Severity.ERROR, "the TP size does not divide the attention head count"),
        Rule("CP408", Severity.ERROR, "a TP plan pattern matches no module"),
        Rule("CP409", Severity.ERROR, "a TP plan entry does not fit the module it matches"),
        Rule("CP410", Severity.ERROR, "the compile backend is not registered with torch"),
        Rule("CP411", Severity.ERROR, "a block is already compiled or checkpoint-wrapped"),
        Rule("CP412", Severity.ERROR, "inductor on CPU finds no C++ compiler"),
        Rule("CP413", Severity.WARNING, "selective checkpointing under an unverified backend"),
        Rule("CP414", Severity.ERROR, "the weights lack keys the model needs"),
        Rule("CP415", Severity.ERROR, "the weights hold keys the model does not have"),
        Rule("CP416", Severity.ERROR, "a weight's shape or dtype does not fit the model"),
        Rule("CP417", Severity.ERROR, "the weights or checkpoint cannot be read"),
        Rule("CP418", Severity.ERROR, "a tensor no weights provide and nothing can initialize"),
        Rule("CP419", Severity.WARNING, "loading the weights loses precision"),
        Rule("CP501", Severity.ERROR, "the plan file could not be read"),
        Rule("CP502", Severity.ERROR, "the plan file is not valid TOML"),
        Rule("CP503", Severity.ERROR, "unknown key or table in the plan file"),
        Rule("CP504", Severity.ERROR, "unknown plugin name"),
        Rule("CP505", Severity.ERROR, "unknown plugin option"),
        Rule("CP506", Severity.ERROR, "a value in the plan file has the wrong type or range"),
    ]
}


# The plugin whose hook is running now (set by the plan's hook caller): a finding made
# without naming a plugin names this one.
CURRENT_PLUGIN: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "composer_par_current_plugin", default=None
)


@attrs.frozen
class Finding:
    """One validation result: what is wrong, which plugin it concerns, and the fix.

    Made inside a plugin's hook without ``plugin=``, it names that plugin.
    """

    code: str
    message: str
    fix: str = ""
    plugin: str | None = None
    # None means the rule's own severity from RULES.
    severity: Severity = attrs.field(default=None)  # type: ignore[assignment]

    def __attrs_post_init__(self) -> None:
        if self.plugin is None:
            current = CURRENT_PLUGIN.get()
            if current is not None and getattr(current, "name", None):
                object.__setattr__(self, "plugin", current.name)
        if self.severity is None:
            rule = RULES.get(self.code)
            object.__setattr__(self, "severity", rule.severity if rule else Severity.ERROR)
        elif not isinstance(self.severity, Severity):
            object.__setattr__(self, "severity", Severity(self.severity))

    @property
    def is_input_error(self) -> bool:
        """The plan file itself could not be understood (CLI exit code 2)."""
        return self.code.startswith("CP5")

    def format(self) -> str:
        where = f" [{self.plugin}]" if self.plugin else ""
        text = f"{self.severity.value.upper()} {self.code}{where}: {self.message}"
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "severity": self.severity.value,
            "code": self.code,
            "plugin": self.plugin,
            "message": self.message,
            "fix": self.fix,
        }


def _findings(value: Iterable[Finding]) -> tuple[Finding, ...]:
    # A typed converter: with a bare ``tuple`` mypy cannot see what Report() takes.
    return tuple(value)


@attrs.frozen
class Report:
    """All findings of one validation, errors first."""

    findings: tuple[Finding, ...] = attrs.field(converter=_findings, factory=tuple)

    @classmethod
    def of(cls, findings: Iterable[Finding]) -> Report:
        order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}
        return cls(sorted(findings, key=lambda f: (order[f.severity], f.code)))

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity is Severity.ERROR)

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity is Severity.WARNING)

    @property
    def ok(self) -> bool:
        return not self.errors

    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def exit_code(self) -> int:
        """The CLI's: 2 the input was unreadable, 1 errors, 0 clean or warnings only."""
        if any(f.is_input_error for f in self.findings):
            return 2
        return 1 if self.errors else 0

    def format(self) -> str:
        if not self.findings:
            return "plan is valid: no findings"
        lines = [f.format() for f in self.findings]
        lines.append(
            f"{len(self.errors)} error(s), {len(self.warnings)} warning(s), "
            f"{len(self.findings) - len(self.errors) - len(self.warnings)} info"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "findings": [f.to_dict() for f in self.findings]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __add__(self, other: Report) -> Report:
        return Report.of((*self.findings, *other.findings))


class PlanError(Exception):
    """``apply()`` refused: the plan has errors. ``.report`` carries every finding."""

    def __init__(self, report: Report) -> None:
        self.report = report
        super().__init__("the plan has errors; nothing was applied\n" + report.format())


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'dp_shard'?)`` or an empty string."""
    if not isinstance(word, str):  # e.g. dim = 0 from a plan file: nothing is close
        return ""
    close = difflib.get_close_matches(word, [c for c in choices if isinstance(c, str)], n=1,
                                      cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
