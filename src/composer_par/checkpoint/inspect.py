"""What a checkpoint holds, read from headers and metadata only (no tensor data).

``describe(path)`` answers for a safetensors file, directory or index json, a DCP
checkpoint directory, or a root of step directories (its steps with their commit state,
and the latest committed one in detail). Reading a DCP checkpoint unpickles its metadata:
inspect only trusted checkpoints.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from composer_par.checkpoint import steps
from composer_par.checkpoint.errors import CheckpointError
from composer_par.checkpoint.safetensors_io import INDEX_SUFFIX, SUFFIX, dtype_name
from composer_par.checkpoint.sources import WeightsSource

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
             "complex64": 8, "complex128": 16}


def kind_of(path: str | os.PathLike[str]) -> str:
    """``"safetensors"``, ``"dcp"`` (one checkpoint directory) or ``"root"`` (of steps)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_file():
        if p.name.endswith((SUFFIX, INDEX_SUFFIX)) or p.suffix == ".json":
            return "safetensors"
        raise CheckpointError(f"{p}: neither a .safetensors file nor an index json")
    if steps.is_checkpoint_dir(p) or steps.step_of(p) is not None:
        return "dcp"
    if steps.step_dirs(p):
        return "root"
    if any(p.glob(f"*{SUFFIX}")) or any(p.glob(f"*{INDEX_SUFFIX}")):
        return "safetensors"
    raise CheckpointError(f"{p}: no safetensors files, DCP checkpoint or step directories")


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    kind = kind_of(path)
    if kind == "safetensors":
        return _safetensors(path)
    if kind == "dcp":
        return _dcp(Path(path))
    return _root(Path(path))


def _safetensors(path: str | os.PathLike[str]) -> dict[str, Any]:
    source = WeightsSource.open(path)
    keys = [{"name": e.name, "shape": list(e.shape), "dtype": dtype_name(e.dtype),
             "bytes": e.nbytes, "file": os.path.basename(e.path)}
            for e in sorted(source.entries.values(), key=lambda e: e.name)]
    return {"path": str(path), "kind": "safetensors", "files": list(source.files),
            "index": source.index, "tensors": len(keys),
            "bytes": sum(k["bytes"] for k in keys), "keys": keys,
            "commit": "n/a (safetensors has no commit marker; every header checked)"}


def _dcp(directory: Path) -> dict[str, Any]:
    from composer_par.checkpoint.dcp import read_metadata

    info = steps.read_info(directory)
    committed = steps.is_committed(directory)
    out: dict[str, Any] = {
        "path": str(directory), "kind": "dcp",
        "commit": "committed" if committed else "uncommitted (the save never finished)",
        "committed": committed, "step": info.get("step", steps.step_of(directory)),
        "world_size": info.get("world_size"), "plan": info.get("plan"),
        "extra": info.get("extra"), "torch": info.get("torch"),
    }
    if "optimizer" in info:
        out["optimizer"] = {"class": info["optimizer"].get("class"),
                            "param_groups": len(info["optimizer"].get("param_groups", []))}
    if not (directory / steps.DCP_METADATA).is_file():
        out.update(tensors=0, bytes=0, keys=[], note="no DCP .metadata: nothing readable")
        return out
    metadata = read_metadata(directory)
    keys = []
    for name, md in sorted(metadata.state_dict_metadata.items()):
        if hasattr(md, "size"):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            keys.append({"name": name, "shape": list(md.size), "dtype": dtype,
                         "bytes": math.prod(md.size) * _ITEMSIZE.get(dtype, 0),
                         "chunks": len(md.chunks)})
        else:
            keys.append({"name": name, "shape": None, "dtype": "object", "bytes": None,
                         "chunks": 1})
    out.update(tensors=sum(1 for k in keys if k["shape"] is not None),
               bytes=sum(k["bytes"] or 0 for k in keys), keys=keys)
    return out


def _root(root: Path) -> dict[str, Any]:
    entries = steps.step_dirs(root)
    latest = steps.latest(root)
    out: dict[str, Any] = {
        "path": str(root), "kind": "root",
        "steps": [{"step": s, "path": str(d), "committed": ok} for s, d, ok in entries],
        "latest": str(latest) if latest else None,
    }
    if latest is not None:
        out["checkpoint"] = _dcp(latest)
    return out


def format_text(data: dict[str, Any], *, limit: int | None = None) -> str:
    """The human-readable form of :func:`describe`'s answer."""
    lines: list[str] = []
    if data["kind"] == "root":
        lines.append(f"{data['path']}: checkpoint root, {len(data['steps'])} step dir(s)")
        for s in data["steps"]:
            mark = "committed" if s["committed"] else "UNCOMMITTED (ignored)"
            lines.append(f"  step {s['step']:>9}  {mark:<22} {s['path']}")
        if data.get("checkpoint"):
            lines.append(f"latest committed: {data['latest']}")
            lines.append(format_text(data["checkpoint"], limit=limit))
        else:
            lines.append("no committed checkpoint")
        return "\n".join(lines)
    head = f"{data['path']}: {data['kind']}, {data['tensors']} tensor(s), " \
           f"{_human(data['bytes'])}"
    lines.append(head)
    lines.append(f"commit: {data['commit']}")
    if data["kind"] == "safetensors":
        lines.append("files: " + ", ".join(os.path.basename(f) for f in data["files"])
                     + (f" (index {os.path.basename(data['index'])})" if data["index"] else ""))
    else:
        lines.append(f"step: {data.get('step')}   saved on {data.get('world_size')} rank(s)"
                     + (f"   torch {data['torch']}" if data.get("torch") else ""))
        if data.get("optimizer"):
            lines.append(f"optimizer: {data['optimizer']['class']} "
                         f"({data['optimizer']['param_groups']} param group(s))")
        if data.get("extra") is not None:
            lines.append(f"extra: {data['extra']}")
    keys = data.get("keys", [])
    shown = keys if limit is None else keys[:limit]
    if shown:
        width = max(len(k["name"]) for k in shown)
        lines.append(f"{'KEY'.ljust(width)}  {'SHAPE':<20} {'DTYPE':<10} BYTES")
        for k in shown:
            shape = "-" if k["shape"] is None else "x".join(map(str, k["shape"])) or "scalar"
            size = "-" if k["bytes"] is None else _human(k["bytes"])
            lines.append(f"{k['name'].ljust(width)}  {shape:<20} {k['dtype']:<10} {size}")
        if len(keys) > len(shown):
            lines.append(f"... {len(keys) - len(shown)} more (--all shows every key)")
    if data.get("plan"):
        lines.append("saved plan:")
        lines.extend("  " + line for line in data["plan"].rstrip().splitlines())
    return "\n".join(lines)


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
