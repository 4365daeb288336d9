"""Reading a source file: which tool wrote it, and its contents as a dict (CP901 when it
cannot be read).

A config is opened as the checkpoint readers open their files
(:func:`~composer_par.checkpoint.paths.read_bounded`): a regular file of at most
:data:`MAX_BYTES`, so a named pipe, a device or a huge file is refused at once, never
waited on or read whole. Its document is bounded before anything walks it: at most
:data:`~composer_par.checkpoint.jsonfile.MAX_DEPTH` levels of nesting, and for YAML at
most :data:`MAX_NODES` values once every alias is expanded (YAML's anchors and aliases
let ten lines stand for billions of values; the events are counted before the document is
built). Each is CP901, naming the file.

accelerate's configs are YAML, read with PyYAML (what accelerate itself uses), imported
only when a YAML file is read: composer_par does not depend on it; it comes with
accelerate, or ``pip install pyyaml``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from composer_par.checkpoint.errors import CheckpointError
from composer_par.checkpoint.jsonfile import MAX_DEPTH, depth_exceeds
from composer_par.checkpoint.paths import read_bounded
from composer_par.findings import Finding, Report
from composer_par.migrate.distributed_config import is_distributed_config
from composer_par.migrate.draft import ImportFailed

ACCELERATE, DEEPSPEED, TRAINER = "accelerate", "deepspeed", "Trainer"
TRANSFORMERS = "transformers"
KINDS = (ACCELERATE, DEEPSPEED, TRANSFORMERS)
# A config is a few KiB; a larger file is not one.
MAX_BYTES = 2**20
#: The most values (scalars, lists, mappings) a YAML config may hold with its aliases
#: expanded; a real config holds a few hundred.
MAX_NODES = 100_000
_DEEPSPEED_KEYS = frozenset({"zero_optimization", "train_batch_size", "fp16", "bf16",
                             "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                             "optimizer", "scheduler", "gradient_clipping"})


def cannot(source: str, message: str, fix: str) -> ImportFailed:
    return ImportFailed(Report.of([Finding("CP901", message, fix=fix)]), source)


def read_text(path: Path, *, what: str = "config") -> str:
    """The text of the config file ``path`` (CP901 when it is not a readable regular file
    of at most :data:`MAX_BYTES` of UTF-8)."""
    try:
        data = read_bounded(path, MAX_BYTES, what=what)
    except CheckpointError as exc:
        raise cannot(str(path), f"cannot read {_without_path(str(exc), path)}",
                     "check the path, and that it names a UTF-8 YAML or JSON file (not a "
                     "pipe or a device)") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise cannot(str(path), f"cannot read {path}: not UTF-8 ({exc.reason} at byte "
                     f"{exc.start})", "save the config as UTF-8 YAML or JSON") from None


def _without_path(message: str, path: Path) -> str:
    """``read_bounded``'s message, ``"{path}: cannot read: why"`` -> ``"{path}: why"``."""
    return message.replace(f"{path}: cannot read: ", f"{path}: ", 1)


def load_yaml(text: str, source: str) -> Any:
    """The YAML document ``text`` (of ``source``), bounded in depth and expanded size."""
    try:
        import yaml
    except ImportError as exc:
        raise cannot(source, "reading an accelerate config (YAML) needs PyYAML, which is not "
                     "installed", "pip install pyyaml (or pip install "
                     "'composer-par[accelerate]')") from exc
    try:
        _check_yaml_size(yaml, text, source)
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise cannot(source, f"not valid YAML: {exc}", "fix the YAML at the line shown") from exc


def _check_yaml_size(yaml: Any, text: str, source: str) -> None:
    """Refuse (CP901) a YAML document nested deeper than MAX_DEPTH or holding more than
    MAX_NODES values with its aliases expanded, from its parse events alone (the parser
    is a loop, not a recursion, and builds nothing)."""
    # One frame per open collection: [values inside it, its height, its anchor].
    frames: list[list[Any]] = [[0, 0, None]]
    anchors: dict[str, tuple[int, int]] = {}
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            frames.append([1, 1, event.anchor])
            if len(frames) - 1 > MAX_DEPTH:
                raise _too_big(source, f"nested deeper than {MAX_DEPTH} levels")
            continue
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            count, height, anchor = frames.pop()
        elif isinstance(event, yaml.ScalarEvent):
            count, height, anchor = 1, 0, event.anchor
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in anchors:
                raise _too_big(source, f"the alias *{event.anchor} refers to a value that "
                               "contains it, or to no anchor")
            count, height = anchors[event.anchor]
            anchor = None
        else:
            continue
        if anchor is not None:
            anchors[anchor] = (count, height)
        parent = frames[-1]
        parent[0] += count
        parent[1] = max(parent[1], height + 1)
        if len(frames) - 1 + height > MAX_DEPTH:
            raise _too_big(source, f"nested deeper than {MAX_DEPTH} levels once its aliases "
                           "are expanded")
        if parent[0] > MAX_NODES:
            raise _too_big(source, f"more than {MAX_NODES} values once its aliases are "
                           "expanded")


def _too_big(source: str, why: str) -> ImportFailed:
    return cannot(source, f"{source}: not a config: {why}", "give the config itself: a "
                  "config is a flat mapping of settings, a few levels deep, without "
                  "aliases that multiply it")


def load_json(text: str, source: str) -> Any:
    """The JSON document ``text`` (of ``source``), bounded in depth."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise _too_big(source, f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise cannot(source, f"not valid JSON: {exc}", "fix the JSON at the line shown") from exc
    if depth_exceeds(data, MAX_DEPTH):
        raise _too_big(source, f"nested deeper than {MAX_DEPTH} levels")
    return data


def read_config(path: Path, kind: str | None = None) -> tuple[str, Mapping[str, Any]]:
    """``(kind, contents)`` of an accelerate YAML or a DeepSpeed JSON; the kind from
    ``kind``, else the file's suffix, else its keys."""
    source = str(path)
    text = read_text(path)
    suffix = path.suffix.lower()
    if kind == DEEPSPEED or (kind is None and suffix == ".json"):
        data = load_json(text, source)
    elif kind == ACCELERATE or suffix in (".yaml", ".yml"):
        data = load_yaml(text, source)
    else:
        try:
            data = load_json(text, source)
        except ImportFailed:
            data = load_yaml(text, source)
    if not isinstance(data, Mapping):
        raise cannot(source, f"{path} holds a {type(data).__name__}, not a config (a mapping "
                     "of settings)", "give an accelerate config YAML or a DeepSpeed JSON")
    if kind == TRANSFORMERS or (kind is None and (is_distributed_config(data)
                                                  or "distributed_config" in data)):
        return TRANSFORMERS, _distributed_config(path, data)
    if kind is None:
        kind = DEEPSPEED if _DEEPSPEED_KEYS & set(data) else ACCELERATE
        if kind == ACCELERATE and not ({"distributed_type", "fsdp_config",
                                        "compute_environment"} & set(data)):
            raise cannot(source, f"{path} is neither an accelerate config (no "
                         "distributed_type), a DeepSpeed config (no zero_optimization) nor "
                         "a transformers DistributedConfig (no tp_size, fsdp_size, ...)",
                         "give the kind: composer-par import --from "
                         "accelerate|deepspeed|transformers")
    return kind, data


def _distributed_config(path: Path, data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The DistributedConfig in ``data``: its own JSON, or a model's config.json holding
    one under ``distributed_config``."""
    inner = data.get("distributed_config", data)
    if inner is None or (inner is data and not is_distributed_config(data)):
        model = "model_type" in data or "architectures" in data
        raise cannot(str(path), f"{path} holds no DistributedConfig" + (
            ": a model's config.json carries none (transformers' save_pretrained leaves "
            "distributed_config out)" if model else ""),
            "give the DistributedConfig's own JSON (DistributedConfig(...).to_json_file), "
            "or build the plan in Python: import_distributed_config(config)")
    if not isinstance(inner, Mapping):
        raise cannot(str(path), f"{path}: distributed_config is a {type(inner).__name__}, "
                     "not a JSON object", "give the DistributedConfig's own JSON")
    return inner
