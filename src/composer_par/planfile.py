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

[plan]                 # optional
timeout = 300          # seconds a rank waits in a collective of the plan's groups
```

Reading collects every problem before reporting (codes CP5xx) and never raises
anything but :class:`PlanFileError`. Writing gives text that reads back to an equal
plan: the same mesh, topology, plugin classes and options.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs

from composer_par.findings import Finding, Report, did_you_mean
from composer_par.mesh import DEFAULT_TIMEOUT_S, INFER, MeshError, MeshSpec, as_timeout
from composer_par.topology import Topology, TopologyError

if TYPE_CHECKING:
    from composer_par.plan import ParallelPlan
    from composer_par.plugin import Plugin
    from composer_par.plugin.registry import Registry


TOP_LEVEL = ("mesh", "topology", "plugins", "plan")
PLAN_KEYS = ("timeout",)
TOPOLOGY_KEYS = tuple(f.name for f in attrs.fields(Topology))
# Static validation and explain do rank arithmetic in Python, linear in the number of
# ranks, so a bound keeps them quick. A file asking for more is a typo, not a cluster.
MAX_RANKS = 2**17
# A plan file is a few KiB. Reading stops past this many bytes, so a wrong file, a huge
# one or an endless device (/dev/zero) is refused at once instead of filling memory.
MAX_PLAN_BYTES = 2**20


class PlanFileError(ValueError):
    """The plan file could not be turned into a plan; ``.report`` has every problem."""

    def __init__(self, report: Report, source: str = "") -> None:
        self.report = report
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}cannot read the plan\n{report.format()}")


def read_source(source: str | Path | IO[str] | IO[bytes]) -> tuple[str, str]:
    """(text, name): ``source`` is TOML text, a path to a file holding it, or an open
    stream (stdin). A file or stream is read up to :data:`MAX_PLAN_BYTES`; anything
    longer is refused (CP501) without reading the rest.

    A one-line ``str`` is a path when it ends in ``.toml``, names a file, or could not
    be a plan anyway (no ``=`` and no ``[``): "no such file" beats a TOML syntax error.
    """
    if isinstance(source, str) and not _looks_like_path(source):
        return source, "<plan>"
    path = Path(source) if isinstance(source, str | os.PathLike) else None
    name = str(path) if path is not None else str(getattr(source, "name", "<stream>"))
    limit = f"{MAX_PLAN_BYTES // 2**20} MiB ({MAX_PLAN_BYTES} bytes)"
    try:
        if path is not None:
            with path.open("rb") as stream:
                data: str | bytes = stream.read(MAX_PLAN_BYTES + 1)
        else:
            data = source.read(MAX_PLAN_BYTES + 1)  # type: ignore[union-attr]
        too_large = len(data) > MAX_PLAN_BYTES
        text = "" if too_large else data.decode("utf-8") if isinstance(data, bytes) else data
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        report = Report.of([Finding("CP501", f"cannot read {name}: {reason}",
                                    fix="check the path, and that the file is UTF-8 TOML")])
        raise PlanFileError(report, name) from exc
    if too_large:
        report = Report.of([Finding(
            "CP501", f"cannot read {name}: it is larger than {limit}, the limit for a plan "
            "file (composer_par.planfile.MAX_PLAN_BYTES)",
            fix="a plan file is a few KiB of TOML: check that this is the plan file")])
        raise PlanFileError(report, name)
    # The newlines text mode reads: \r\n and \r become \n, as Path.read_text gives.
    return text.replace("\r\n", "\n").replace("\r", "\n"), name


def _looks_like_path(text: str) -> bool:
    if not text.strip() or "\n" in text or "\0" in text or text.lstrip().startswith("#"):
        return False
    return (text.lower().endswith(".toml") or os.path.isfile(text)
            or ("=" not in text and "[" not in text))


def parse(text: str, name: str = "<plan>") -> dict[str, Any]:
    """The TOML document as a dict; CP502 on anything tomllib cannot read."""
    try:
        return tomllib.loads(text)
    # TOMLDecodeError is a ValueError; tomllib also raises a plain ValueError for ints
    # past Python's digit limit and RecursionError for deeply nested arrays.
    except (ValueError, RecursionError) as exc:
        reason = "nesting is too deep" if isinstance(exc, RecursionError) else str(exc)
        report = Report.of([Finding("CP502", f"not valid TOML: {reason}",
                                    fix="fix the TOML syntax at the line shown")])
        raise PlanFileError(report, name) from exc


@attrs.frozen
class PlanParts:
    """What a plan file says: the parts ``ParallelPlan.from_parts`` builds a plan of."""

    mesh: MeshSpec
    topology: Topology | None
    plugins: tuple[Plugin, ...]
    timeout: float | None = None  # [plan] timeout, seconds; None: the default


def read_plan(source: str | Path, *, registry: Registry | None = None) -> PlanParts:
    """The parts of a plan from TOML text or a path; raises PlanFileError with every
    problem."""
    text, name = read_source(source)
    return parts_from_data(parse(text, name), registry=registry, name=name)


def parts_from_data(
    data: Mapping[str, Any], *, registry: Registry | None = None, name: str = "<plan>"
) -> PlanParts:
    """The parts of a plan from a parsed plan file (the dict ``tomllib`` gives)."""
    from composer_par.plugin.registry import Registry

    problems: list[Finding] = []
    for key in data:
        if key not in TOP_LEVEL:
            problems.append(_unknown(str(key), TOP_LEVEL, "top-level key"))
    mesh = _mesh(data.get("mesh"), problems)
    topology = _topology(data.get("topology"), problems)
    plugins = _plugins(data.get("plugins", []), registry or Registry(), problems)
    timeout = _plan_table(data.get("plan"), problems)
    if problems or mesh is None:
        raise PlanFileError(Report.of(problems), name)
    return PlanParts(mesh, topology, tuple(plugins), timeout)


def _unknown(key: str, known: tuple[str, ...] | list[str], what: str) -> Finding:
    return Finding(
        "CP503",
        f"unknown {what} {key!r}{did_you_mean(key, known)}",
        fix=f"use one of {list(known)}",
    )


def _wrong(message: str, fix: str = "", plugin: str | None = None) -> Finding:
    return Finding("CP506", message, fix=fix, plugin=plugin)


def _mesh(table: Any, problems: list[Finding]) -> MeshSpec | None:
    if table is None:
        problems.append(_wrong("the plan file has no [mesh] table",
                               fix="add [mesh] with the mesh dims, e.g. dp_shard = 8"))
        return None
    if not isinstance(table, Mapping):
        problems.append(_wrong("[mesh] must be a table of mesh dim sizes",
                               fix="write [mesh] and one `name = size` line per mesh dim"))
        return None
    # Each dim on its own first, so every bad one is reported, not just the first.
    good = []
    for name, size in table.items():
        try:
            MeshSpec.from_pairs([(name, size)])
            good.append((name, size))
        except MeshError as exc:
            problems.append(_wrong(f"[mesh]: {exc}", fix="sizes are ints >= 1, or -1 once"))
    try:
        mesh = MeshSpec.from_pairs(good)
    except MeshError as exc:  # what only the whole mesh shows: two dims of size -1
        problems.append(_wrong(f"[mesh]: {exc}", fix="give every size but one"))
        return None
    known = math.prod(s for s in mesh.sizes if s != INFER)
    if known > MAX_RANKS:
        problems.append(_wrong(
            f"[mesh]: {mesh.equation()} ranks is more than the {MAX_RANKS} a plan may lay out",
            fix="check the [mesh] sizes for a typo",
        ))
        return None
    return mesh if len(good) == len(table) else None


def _topology(table: Any, problems: list[Finding]) -> Topology | None:
    if table is None:
        return None
    if not isinstance(table, Mapping):
        problems.append(_wrong("[topology] must be a table",
                               fix="write [topology] with nodes and devices_per_node"))
        return None
    before = len(problems)
    for key in table:
        if key not in TOPOLOGY_KEYS:
            problems.append(_unknown(str(key), TOPOLOGY_KEYS, "[topology] key"))
    missing = [k for k in ("nodes", "devices_per_node") if k not in table]
    if missing:
        problems.append(_wrong(f"[topology] needs {' and '.join(missing)}",
                               fix="give nodes and devices_per_node, or leave out [topology]"))
    # Each value against valid others, so every bad value is reported.
    valid = {"nodes": 1, "devices_per_node": 1}
    for key, value in table.items():
        if key in TOPOLOGY_KEYS:
            try:
                Topology(**{**valid, key: value})
            except TopologyError as exc:
                problems.append(_wrong(f"[topology]: {exc}", fix="nodes and devices_per_node "
                                       "are ints >= 1; the *_gbps bandwidths numbers > 0"))
    if len(problems) > before:
        return None
    topology = Topology(**table)
    if topology.world_size > MAX_RANKS:
        problems.append(_wrong(
            f"[topology]: {topology.describe()} is more than the {MAX_RANKS} ranks a plan may "
            "lay out", fix="check nodes and devices_per_node for a typo"))
        return None
    return topology


def _plan_table(table: Any, problems: list[Finding]) -> float | None:
    """[plan]: settings of the whole plan; its timeout in seconds, or None."""
    if table is None:
        return None
    if not isinstance(table, Mapping):
        problems.append(_wrong("[plan] must be a table", fix="write [plan] and timeout = SECONDS"))
        return None
    for key in table:
        if key not in PLAN_KEYS:
            problems.append(_unknown(str(key), PLAN_KEYS, "[plan] key"))
    value = table.get("timeout")
    if value is None:
        return None
    try:
        as_timeout(value)
    except (TypeError, ValueError) as exc:
        problems.append(_wrong(f"[plan]: {exc}", fix="timeout = seconds, a number > 0, "
                               "e.g. 300"))
        return None
    return float(value)


def _plugins(entries: Any, registry: Registry, problems: list[Finding]) -> list[Plugin]:
    if not isinstance(entries, list):
        problems.append(_wrong("plugins must be an array of tables: write [[plugins]]",
                               fix="start each plugin with a [[plugins]] line"))
        return []
    plugins = []
    for index, entry in enumerate(entries, 1):
        plugin = _plugin(f"[[plugins]] #{index}", entry, registry, problems)
        if plugin is not None:
            plugins.append(plugin)
    return plugins


def _plugin(where: str, entry: Any, registry: Registry, problems: list[Finding]) -> Plugin | None:
    from composer_par.plugin.registry import RegistryError

    if not isinstance(entry, Mapping):
        problems.append(_wrong(f"{where} must be a table", fix="write [[plugins]] then name = ..."))
        return None
    name = entry.get("name")
    if not isinstance(name, str):
        got = "no name" if name is None else f"name = {name!r}"
        misspelled = [k for k in entry if k != "name" and did_you_mean(str(k), ["name"])]
        hint = f" ({', '.join(map(repr, misspelled))} looks like name)" if misspelled else ""
        problems.append(_wrong(
            f"{where} needs name = \"<plugin>\"; got {got}{hint}",
            fix=f"installed plugins: {', '.join(registry.names()) or 'none'}",
        ))
        return None
    try:
        cls = registry.get(name)
    except RegistryError as exc:
        problems.append(Finding("CP504", f"{where}: {exc}",
                                fix="install the plugin or fix the name"))
        return None
    options = {k: v for k, v in entry.items() if k != "name"}
    known = cls.option_names()
    unknown = [k for k in options if k not in known]
    for key in unknown:
        problems.append(Finding(
            "CP505",
            f"{where} ({name}): unknown option {key!r}{did_you_mean(str(key), known)}",
            fix=f"{name} takes {list(known)}",
            plugin=name,
        ))
    options = {k: v for k, v in options.items() if k in known}
    # Values are checked even next to unknown options: every problem at once.
    errors = _option_errors(cls, options)
    for error in errors:
        problems.append(_wrong(f"{where} ({name}): {error}",
                               fix=f"see the options of {cls.__name__}", plugin=name))
    if unknown or errors:
        return None
    return cls(**options)


def _option_errors(cls: type[Plugin], options: dict[str, Any]) -> list[str]:
    """Why ``cls(**options)`` fails: one message per bad option where they can be told
    apart, else the single error. Validators raise TypeError/ValueError naming the field;
    a third-party plugin may raise anything."""
    try:
        cls(**options)
        return []
    except Exception as exc:
        whole = _describe(exc)
    try:
        cls()
    except Exception:  # required options: a lone option cannot be tried on its own
        return [whole]
    alone = []
    for key, value in options.items():
        try:
            cls(**{key: value})
        except Exception as exc:
            alone.append(f"{key} = {_short(value)}: {_describe(exc)}")
    return alone or [whole]


def _describe(exc: BaseException) -> str:
    # attrs' own validators raise ValueError(message, attribute, ...): keep the message.
    if len(exc.args) > 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc) or type(exc).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- writing -------------------------------------------------------------------------------


def dump_plan(plan: ParallelPlan) -> str:
    """The plan as plan-file text that :func:`read_plan` reads back to an equal plan.

    Raises ValueError naming the option for what TOML cannot hold (a callable, None
    where the default is not None). ``plan.device`` is a runtime choice: not written.
    """
    lines = ["[mesh]"]
    lines += [f"{toml_key(name)} = {size}" for name, size in plan.mesh.dims]
    seconds = as_timeout(plan.timeout).total_seconds()
    if seconds != DEFAULT_TIMEOUT_S:
        whole = seconds.is_integer()
        lines += ["", "[plan]", f"timeout = {toml_value(int(seconds) if whole else seconds)}"]
    if plan.topology is not None:
        lines += ["", "[topology]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in plan.topology.to_dict().items()]
    for plugin in plan.plugins:
        lines += ["", "[[plugins]]", f"name = {toml_value(plugin.name)}"]
        for key, value in plugin.options().items():
            try:
                lines.append(f"{toml_key(key)} = {toml_value(value)}")
            except ValueError as exc:
                raise ValueError(f"plugin {plugin.name!r} option {key!r}: {exc}") from exc
    return "\n".join(lines) + "\n"


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}
_INT64 = range(-(2**63), 2**63)


def toml_key(key: Any) -> str:
    if not isinstance(key, str):
        raise ValueError(f"TOML keys are strings; got {key!r}")
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_string(text: str) -> str:
    """A TOML basic string. Not json.dumps: JSON writes astral characters as surrogate
    pairs and leaves DEL raw, both invalid in TOML."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        elif 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"a lone surrogate cannot be written to TOML: {text!r}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (tables inline); ValueError for what TOML cannot hold."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if value not in _INT64:
            raise ValueError(f"TOML integers are 64-bit; {value} is out of range")
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        raise ValueError("TOML has no null (an option left at its default None is not written)")
    raise ValueError(f"cannot write {type(value).__name__} to a plan file: {value!r}")
