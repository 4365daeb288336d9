"""Reading a source file: which tool wrote it, and its contents as a dict (CP901 when it
cannot be read).

accelerate's configs are YAML, read with PyYAML (what accelerate itself uses), imported
only when a YAML file is read: composer_par does not depend on it; it comes with
accelerate, or ``pip install pyyaml``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from composer_par.findings import Finding, Report
from composer_par.migrate.draft import ImportFailed

ACCELERATE, DEEPSPEED, TRAINER = "accelerate", "deepspeed", "Trainer"
KINDS = (ACCELERATE, DEEPSPEED)
# A config is a few KiB; a larger file is not one.
MAX_BYTES = 2**20
_DEEPSPEED_KEYS = frozenset({"zero_optimization", "train_batch_size", "fp16", "bf16",
                             "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                             "optimizer", "scheduler", "gradient_clipping"})


def cannot(source: str, message: str, fix: str) -> ImportFailed:
    return ImportFailed(Report.of([Finding("CP901", message, fix=fix)]), source)


def read_text(path: Path) -> str:
    try:
        with path.open("rb") as stream:
            data = stream.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise cannot(str(path), f"cannot read {path}: larger than {MAX_BYTES} bytes, too "
                         "large for a config", "check that this is the config file")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise cannot(str(path), f"cannot read {path}: {reason}",
                     "check the path, and that the file is UTF-8 YAML or JSON") from exc


def load_yaml(text: str, source: str) -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise cannot(source, "reading an accelerate config (YAML) needs PyYAML, which is not "
                     "installed", "pip install pyyaml (or pip install "
                     "'composer-par[accelerate]')") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise cannot(source, f"not valid YAML: {exc}", "fix the YAML at the line shown") from exc


def load_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise cannot(source, f"not valid JSON: {exc}", "fix the JSON at the line shown") from exc


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
            data = json.loads(text)
        except ValueError:
            data = load_yaml(text, source)
    if not isinstance(data, Mapping):
        raise cannot(source, f"{path} holds a {type(data).__name__}, not a config (a mapping "
                     "of settings)", "give an accelerate config YAML or a DeepSpeed JSON")
    if kind is None:
        kind = DEEPSPEED if _DEEPSPEED_KEYS & set(data) else ACCELERATE
        if kind == ACCELERATE and not ({"distributed_type", "fsdp_config",
                                        "compute_environment"} & set(data)):
            raise cannot(source, f"{path} is neither an accelerate config (no "
                         "distributed_type) nor a DeepSpeed config (no zero_optimization)",
                         "give the kind: composer-par import --from accelerate|deepspeed")
    return kind, data
