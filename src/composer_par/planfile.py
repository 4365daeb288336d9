"""Plan files: TOML that says exactly what the Python API says, round-tripping.

```toml
[mesh]                 # mesh dims, outermost first: the order is the rank layout
dp_replicate = 4
dp_shard = 8

[topology]             # optional; CLI flags override it, torchrun's environment fills it
nodes = 4
devices_per_node = 8

[[plugins]]            # each names a registered plugin and gives its options
name = "fsdp2"
reshard_after_forward = true
```

Reading collects every problem before reporting (codes CP5xx) and never raises
anything but :class:`PlanFileError`.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_par.mesh import MeshError, MeshSpec
from composer_par.topology import Topology, TopologyError
from composer_par.validate import Finding, Report, did_you_mean

if TYPE_CHECKING:
    from composer_par.plan import ParallelPlan
    from composer_par.plugin import Plugin
    from composer_par.registry import Registry

TOP_LEVEL = ("mesh", "topology", "plugins")
TOPOLOGY_KEYS = ("nodes", "devices_per_node", "intra_node_gbps", "inter_node_gbps")


class PlanFileError(ValueError):
    """The plan file could not be turned into a plan; ``.report`` has every problem."""

    def __init__(self, report: Report, source: str = "") -> None:
        self.report = report
        where = f"{source}: " if source else ""
        super().__init__(f"{where}cannot read the plan\n{report.format()}")


def read_source(source: str | Path) -> tuple[str, str]:
    """(text, name): ``source`` is TOML text, or a path to a file holding it."""
    if isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and source.endswith(".toml")
    ):
        path = Path(source)
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            report = Report.of([Finding("CP501", f"cannot read {path}: {reason}",
                                        fix="check the path")])
            raise PlanFileError(report, str(path)) from exc
    return str(source), "<plan>"


def load_plan(source: str | Path, *, registry: Registry | None = None) -> ParallelPlan:
    from composer_par.plan import ParallelPlan
    from composer_par.registry import Registry

    text, name = read_source(source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        report = Report.of([Finding("CP502", f"not valid TOML: {exc}",
                                    fix="fix the TOML syntax at the line shown")])
        raise PlanFileError(report, name) from exc
    problems: list[Finding] = []
    for key in data:
        if key not in TOP_LEVEL:
            problems.append(_unknown(key, TOP_LEVEL, "top-level table"))
    mesh = _mesh(data.get("mesh"), problems)
    topology = _topology(data.get("topology"), problems)
    registry = registry or Registry()
    plugins = _plugins(data.get("plugins", []), registry, problems)
    if problems:
        raise PlanFileError(Report.of(problems), name)
    assert mesh is not None
    plan = ParallelPlan(mesh, topology=topology)
    for plugin in plugins:
        plan.use(plugin)
    return plan


def _unknown(key: str, known: tuple[str, ...] | list[str], what: str) -> Finding:
    return Finding(
        "CP503",
        f"unknown {what} {key!r}{did_you_mean(key, known)}",
        fix=f"use one of {list(known)}",
    )


def _wrong(message: str, fix: str = "") -> Finding:
    return Finding("CP506", message, fix=fix)


def _mesh(table: Any, problems: list[Finding]) -> MeshSpec | None:
    if table is None:
        problems.append(_wrong("the plan file has no [mesh] table",
                               fix="add [mesh] with the mesh dims, e.g. dp_shard = 8"))
        return None
    if not isinstance(table, dict):
        problems.append(_wrong("[mesh] must be a table of mesh dim sizes"))
        return None
    try:
        return MeshSpec.from_pairs(table)
    except MeshError as exc:
        problems.append(_wrong(f"[mesh]: {exc}", fix="sizes are ints >= 1, or -1 once"))
        return None


def _topology(table: Any, problems: list[Finding]) -> Topology | None:
    if table is None:
        return None
    if not isinstance(table, dict):
        problems.append(_wrong("[topology] must be a table"))
        return None
    unknown = [k for k in table if k not in TOPOLOGY_KEYS]
    for key in unknown:
        problems.append(_unknown(key, TOPOLOGY_KEYS, "[topology] key"))
    missing = [k for k in ("nodes", "devices_per_node") if k not in table]
    if missing:
        problems.append(_wrong(f"[topology] needs {' and '.join(missing)}"))
    if unknown or missing:
        return None
    try:
        return Topology(**table)
    except TopologyError as exc:
        problems.append(_wrong(f"[topology]: {exc}"))
        return None


def _plugins(entries: Any, registry: Registry, problems: list[Finding]) -> list[Plugin]:
    from composer_par.registry import RegistryError

    if not isinstance(entries, list):
        problems.append(_wrong("plugins must be an array of tables: write [[plugins]]"))
        return []
    plugins = []
    for index, entry in enumerate(entries, 1):
        where = f"[[plugins]] #{index}"
        if not isinstance(entry, dict):
            problems.append(_wrong(f"{where} must be a table"))
            continue
        name = entry.get("name")
        if not isinstance(name, str):
            problems.append(_wrong(f"{where} needs name = \"<plugin>\"",
                                   fix=f"installed plugins: {', '.join(registry.names())}"))
            continue
        try:
            cls = registry.get(name)
        except RegistryError as exc:
            problems.append(Finding("CP504", f"{where}: {exc}",
                                    fix="install the plugin or fix the name"))
            continue
        options = {k: v for k, v in entry.items() if k != "name"}
        known = cls.option_names()
        bad = [k for k in options if k not in known]
        for key in bad:
            problems.append(Finding(
                "CP505",
                f"{where} ({name}): unknown option {key!r}{did_you_mean(key, known)}",
                fix=f"{name} takes {list(known)}",
                plugin=name,
            ))
        if bad:
            continue
        try:
            plugins.append(cls(**options))
        except Exception as exc:  # attrs validators raise TypeError/ValueError with the field
            problems.append(_wrong(f"{where} ({name}): {exc}", fix="see the plugin's options"))
    return plugins


# -- writing -------------------------------------------------------------------------------


def dump_plan(plan: ParallelPlan) -> str:
    lines = ["[mesh]"]
    lines += [f"{name} = {size}" for name, size in plan.mesh.dims]
    if plan.topology is not None:
        lines += ["", "[topology]"]
        lines += [f"{k} = {_value(v)}" for k, v in plan.topology.to_dict().items()]
    for plugin in plan.plugins:
        lines += ["", "[[plugins]]", f"name = {_value(plugin.name)}"]
        lines += [f"{_key(k)} = {_value(v)}" for k, v in plugin.options().items()]
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        raise ValueError("TOML has no null: options set to None are left out")
    raise TypeError(f"cannot write {type(value).__name__} to a plan file: {value!r}")
