"""What a checkpoint holds, read from headers and metadata only (no tensor data).

``describe(path)`` answers for a safetensors file, directory or index json, a DCP
checkpoint directory, or a root of step directories (its steps with their commit state,
and the latest committed one in detail), and through
:mod:`~composer_par.checkpoint.formats` for another tool's checkpoint. The commit state
checks the recorded sizes and the digests of the small files; ``verify=True`` reads
every byte of every file against its digest. A DCP checkpoint's metadata is unpickled
(after its digest is checked) by an unpickler that finds only the classes DCP metadata
holds; a ``.metadata`` that is not DCP metadata (or not a regular file), and a JSON file
of it that is not a readable JSON object, are errors naming the file (the command line's
exit 2), not a checkpoint described as empty or corrupt.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from composer_par.checkpoint import claims, steps
from composer_par.checkpoint.dcp_metadata import UnreadableMetadataError
from composer_par.checkpoint.errors import CheckpointError
from composer_par.checkpoint.integrity import DIGEST, stored_chunks
from composer_par.checkpoint.jsonfile import MalformedJsonError
from composer_par.checkpoint.paths import relative_name
from composer_par.checkpoint.safetensors_io import INDEX_SUFFIX, SUFFIX, dtype_name
from composer_par.checkpoint.sources import WeightsSource

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
             "complex64": 8, "complex128": 16}


def item_size(dtype: str) -> int | None:
    """Bytes per element of the dtype named ``dtype`` (None: not one inspect knows)."""
    return _ITEMSIZE.get(dtype)


def kind_of(path: str | os.PathLike[str]) -> str:
    """``"safetensors"``, ``"dcp"`` (one checkpoint directory) or ``"root"`` (of steps)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if not p.is_dir():  # a file, or a pipe or device where one belongs: read and refused
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


def describe(path: str | os.PathLike[str], *, verify: bool = False) -> dict[str, Any]:
    """What the checkpoint at ``path`` holds, whatever its format (see
    :mod:`composer_par.checkpoint.formats`): for composer_par's own, as
    :func:`describe_native` says; for another tool's (DeepSpeed, FSDP1), its keys,
    shapes, dtypes and bytes."""
    from composer_par.checkpoint.formats import detect

    return detect(path).describe(Path(path), verify=verify)


def describe_native(path: str | os.PathLike[str], *, verify: bool = False
                    ) -> dict[str, Any]:
    """What ``path`` holds (safetensors, a DCP checkpoint or a root). For DCP
    checkpoints, the commit state: ``committed`` (every
    recorded file has its recorded size, and ``.metadata`` and ``composer_par.json``
    match their digests), ``verified`` (with ``verify``: every byte of every file matches
    its digest), ``corrupt`` (with the problems, each naming the file) or
    ``uncommitted`` (with the claim of the job that writes or wrote it)."""
    kind = kind_of(path)
    if kind == "safetensors":
        return _safetensors(path)
    if kind == "dcp":
        return _dcp(Path(path), verify=verify)
    return _root(Path(path), verify=verify)


def _base_of(path: str | os.PathLike[str], source: WeightsSource) -> Path:
    p = Path(path)
    if source.index is not None:
        return Path(source.index).parent
    return p if p.is_dir() else p.parent


def _safetensors(path: str | os.PathLike[str]) -> dict[str, Any]:
    source = WeightsSource.open(path)
    base = _base_of(path, source)
    keys = [{"name": e.name, "shape": list(e.shape), "dtype": dtype_name(e.dtype),
             "bytes": e.nbytes, "file": relative_name(base, e.path)}
            for e in sorted(source.entries.values(), key=lambda e: e.name)]
    return {"path": str(path), "kind": "safetensors", "files": list(source.files),
            "relative_files": [relative_name(base, f) for f in source.files],
            "index": source.index, "tensors": len(keys),
            "bytes": sum(k["bytes"] for k in keys), "keys": keys,
            "commit": "n/a (safetensors has no commit marker; every header checked)"}


def _claim(directory: Path) -> dict[str, Any] | None:
    claim = claims.read_claim(directory)
    if claim is None:
        return None
    state, why = claims.liveness(claim)
    return {"job": claim.id, "description": claim.describe(), "state": state, "why": why}


def _commit_state(directory: Path, *, verify: bool) -> dict[str, Any]:
    """``state``, ``commit`` (the sentence), ``problems``, ``digests``, ``files``."""
    if not steps.is_committed(directory):
        claim = _claim(directory)
        text = "uncommitted (the save never finished)"
        if claim is not None:
            text = (f"uncommitted (the save never finished): claimed by {claim['description']}"
                    f"; {claim['state']}: {claim['why']}")
        return {"state": "uncommitted", "commit": text, "problems": [], "digests": False,
                "claim": claim}
    try:
        manifest = steps.read_manifest(directory)
    except MalformedJsonError:
        raise  # not a commit record at all: named, exit 2
    except CheckpointError as exc:
        return {"state": "corrupt", "commit": f"CORRUPT: {exc}", "problems": [str(exc)],
                "digests": False}
    if manifest is None:
        return {"state": "committed", "digests": False, "problems": [],
                "commit": "committed (no digests recorded: saved by an older version, so it "
                          "cannot be verified)"}
    problems = manifest.verify_all(_chunks(directory, manifest)) if verify \
        else manifest.quick_check()
    files = [{"name": name, "bytes": record.size}
             for name, record in sorted(manifest.files.items())]
    out: dict[str, Any] = {"digests": True, "problems": problems, "files": files}
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        out.update(state="corrupt", commit=f"CORRUPT: {problems[0]}{more}")
    elif verify:
        out.update(state="verified", commit=(
            f"committed and verified: every byte of its {len(files)} file(s) "
            f"({_human(manifest.total_bytes)}) matches its {DIGEST} digest"))
    else:
        out.update(state="committed", commit=(
            f"committed ({len(files)} file(s), sizes checked; --verify checks every byte "
            f"against its {DIGEST} digest)"))
    return out


def _chunks(directory: Path, manifest: Any) -> dict[str, list[tuple[int, int, str]]]:
    """The stored chunks of a step by file, to name a damaged chunk's key (none when its
    metadata is unreadable: that is reported by itself)."""
    from composer_par.checkpoint.dcp import read_metadata

    try:
        return stored_chunks(read_metadata(directory, manifest))
    except UnreadableMetadataError:
        raise
    except CheckpointError:
        return {}


def _dcp(directory: Path, *, verify: bool = False) -> dict[str, Any]:
    from composer_par.checkpoint.dcp import read_metadata

    state = _commit_state(directory, verify=verify)
    problems: list[str] = state["problems"]
    manifest = None
    info: dict[str, Any] = {}
    try:
        manifest = steps.read_manifest(directory)
        info = steps.read_info(directory, manifest)
    except MalformedJsonError:
        raise
    except CheckpointError as exc:
        if str(exc) not in problems:
            problems.append(str(exc))
    out: dict[str, Any] = {
        "path": str(directory), "kind": "dcp", **state,
        "committed": steps.is_committed(directory),
        "step": info.get("step", steps.step_of(directory)),
        "world_size": info.get("world_size"), "plan": info.get("plan"),
        "extra": info.get("extra"), "torch": info.get("torch"),
    }
    if isinstance(info.get("optimizer"), dict):
        out["optimizer"] = {"class": info["optimizer"].get("class"),
                            "param_groups": len(info["optimizer"].get("param_groups", []))}
    metadata_path = directory / steps.DCP_METADATA
    if not os.path.lexists(metadata_path):
        out.update(tensors=0, bytes=0, keys=[], note="no DCP .metadata: nothing readable")
        return _mark_corrupt(out)
    if not metadata_path.is_file():
        raise CheckpointError(f"{metadata_path}: not a regular file; DCP metadata must be one")
    try:
        metadata = read_metadata(directory, manifest)
    except UnreadableMetadataError:
        raise  # whatever its digest says, nothing of this checkpoint can be described
    except CheckpointError as exc:
        if str(exc) not in problems:
            problems.append(str(exc))
        out.update(tensors=0, bytes=0, keys=[])
        return _mark_corrupt(out)
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
    return _mark_corrupt(out)


def _mark_corrupt(out: dict[str, Any]) -> dict[str, Any]:
    problems = out["problems"]
    if problems and out["state"] != "corrupt" and out["committed"]:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        out.update(state="corrupt", commit=f"CORRUPT: {problems[0]}{more}")
    return out


def _root(root: Path, *, verify: bool = False) -> dict[str, Any]:
    entries = steps.step_dirs(root)
    latest = steps.latest(root)
    listed = []
    for s, d, ok in entries:
        state = _commit_state(d, verify=verify) if d != latest else {}
        row = {"step": s, "path": str(d), "committed": ok,
               "state": state.get("state", "committed" if ok else "uncommitted"),
               "problems": state.get("problems", [])}
        if state.get("claim"):
            row["claim"] = state["claim"]
        listed.append(row)
    out: dict[str, Any] = {
        "path": str(root), "kind": "root", "steps": listed,
        "latest": str(latest) if latest else None,
    }
    if latest is not None:
        out["checkpoint"] = _dcp(latest, verify=verify)
        for row in listed:
            if row["path"] == str(latest):
                row["state"] = out["checkpoint"]["state"]
                row["problems"] = out["checkpoint"]["problems"]
    return out


def corrupt(data: dict[str, Any]) -> bool:
    """Whether anything :func:`describe` answered is corrupt."""
    if data.get("state") == "corrupt":
        return True
    if any(s.get("state") == "corrupt" for s in data.get("steps", [])):
        return True
    return bool(data.get("checkpoint") and corrupt(data["checkpoint"]))


def format_text(data: dict[str, Any], *, limit: int | None = None) -> str:
    """The human-readable form of :func:`describe`'s answer."""
    lines: list[str] = []
    if data["kind"] == "root":
        lines.append(f"{data['path']}: checkpoint root, {len(data['steps'])} step dir(s)")
        marks = {"committed": "committed", "verified": "committed, verified",
                 "corrupt": "CORRUPT", "uncommitted": "UNCOMMITTED (ignored)"}
        for s in data["steps"]:
            mark = marks.get(s.get("state", ""), "committed" if s["committed"]
                             else "UNCOMMITTED (ignored)")
            lines.append(f"  step {s['step']:>9}  {mark:<22} {s['path']}")
            lines.extend(f"      {problem}" for problem in s.get("problems", [])[:3])
            if s.get("claim"):
                lines.append(f"      claimed by {s['claim']['description']} "
                             f"({s['claim']['state']}: {s['claim']['why']})")
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
    lines.extend(f"  {problem}" for problem in data.get("problems", [])[1:6])
    if data["kind"] == "safetensors":
        lines.append("files: " + ", ".join(data.get("relative_files", data["files"]))
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
