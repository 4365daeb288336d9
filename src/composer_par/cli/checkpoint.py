"""``composer-par inspect CKPT``, ``composer-par clean ROOT`` and ``composer-par convert
SRC DST``.

``inspect`` reads headers and metadata only: keys, shapes, dtypes, bytes, the commit
state (committed, verified with ``--verify``, corrupt naming the file, or uncommitted
with the job that claimed it), and for DCP checkpoints the step and the plan they were
saved with; it exits 1 when what it shows is corrupt. ``convert`` turns a DCP checkpoint
into consolidated safetensors or back, or a DeepSpeed ZeRO checkpoint into either (its fp32
weights, ``--to``), one tensor at a time, with a progress bar on
stderr, checking what it reads against the commit's digests; it writes into a temporary
directory renamed into place at the end, so a failure leaves nothing at DST. Both exit 2
on input they cannot use (a missing, truncated or corrupt file; an uncommitted
checkpoint), naming the file and the key. ``clean`` removes, explicitly, what retention
leaves: unfinished steps nothing can still be writing and, with ``--keep-last``, the
older committed steps of each run, all older than an age, with a dry run.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import TextIO

from composer_par.cli.common import EXIT_ERRORS, EXIT_OK, InputError, Output

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912, ``"1000"`` -> 1000."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 5GB or 512MiB; got {text!r}")
    unit = (m.group(2) or "").lower().removesuffix("b")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"the size must be positive; got {text!r}")
    return value


_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)


def parse_age(text: str) -> float:
    """``"90"`` or ``"90s"`` -> 90.0, ``"30m"`` -> 1800.0, ``"2h"``, ``"1d"``."""
    m = _AGE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected an age like 3600, 30m, 2h or 1d; got "
                                         f"{text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[
        m.group(2).lower()]


class ProgressBar:
    """A progress bar on a text stream: redrawn in place on a terminal, one line per
    tenth otherwise (so logs stay readable)."""

    def __init__(self, stream: TextIO, label: str, *, width: int = 30) -> None:
        self.stream = stream
        self.label = label
        self.width = width
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.last_draw = 0.0
        self.last_tenth = -1
        self.started = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        if self.tty:
            now = time.perf_counter()
            if now - self.last_draw < 0.1 and done < total:
                return
            self.last_draw = now
            filled = int(fraction * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {fraction:4.0%} "
                              f"{_gib(done)}/{_gib(total)} GiB")
        else:
            tenth = int(fraction * 10)
            if tenth == self.last_tenth:
                return
            self.last_tenth = tenth
            self.stream.write(f"{self.label}: {fraction:.0%} ({_gib(done)}/{_gib(total)} GiB)\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.last_draw:
            self.stream.write("\n")
        seconds = time.perf_counter() - self.started
        self.stream.write(f"{self.label}: done in {seconds:.1f} s\n")
        self.stream.flush()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


# -- inspect ----------------------------------------------------------------------------------


def configure_inspect(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="CKPT",
                        help="a .safetensors file, a directory of them, an index json, a DCP "
                        "checkpoint directory, a root of step directories, a DeepSpeed ZeRO "
                        "checkpoint, or an FSDP1 state dict")
    parser.add_argument("--all", action="store_true",
                        help="list every key (default: the first 50)")
    parser.add_argument("--verify", action="store_true",
                        help="read every byte of every file of each committed step against "
                        "the digests its commit recorded (default: sizes, and the digests of "
                        "the small files); exit 1 if anything is corrupt")
    parser.add_argument("--clean-stale", type=parse_age, metavar="AGE",
                        help="first remove the unfinished steps of a root that nothing can "
                        "still be writing: unchanged for AGE (e.g. 30m, 2h, 3600) and without "
                        "a live claim; committed steps are never touched")


def run_inspect(args: argparse.Namespace, out: Output) -> int:
    from composer_par.checkpoint.claims import clean_stale
    from composer_par.checkpoint.errors import CheckpointError
    from composer_par.checkpoint.inspect import corrupt, describe, format_text

    cleaned = None
    try:
        if args.clean_stale is not None:
            cleaned = clean_stale(args.path, older_than=args.clean_stale)
        data = describe(args.path, verify=args.verify)
    except (CheckpointError, ValueError) as exc:
        raise InputError(str(exc)) from exc
    bad = corrupt(data)
    text = format_text(data, limit=None if args.all else 50)
    if cleaned is not None:
        data["cleaned"] = {"removed": [str(p) for p in cleaned.removed],
                           "kept": [{"path": str(p), "why": why} for p, why in cleaned.kept]}
        text = "\n".join([f"removed stale: {p}" for p in cleaned.removed]
                         + [f"kept: {p}: {why}" for p, why in cleaned.kept] + [text])
    out.result({"ok": not bad, **data}, text)
    if data.get("kind") == "dcp" and not data.get("committed") and not out.json_mode:
        out.note("note: this checkpoint is uncommitted (its save never finished): "
                 "load and latest() ignore it")
    return EXIT_ERRORS if bad else EXIT_OK


# -- clean ------------------------------------------------------------------------------------


def configure_clean(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", metavar="ROOT", help="a root of step directories")
    parser.add_argument("--older-than", type=parse_age, metavar="AGE", required=True,
                        help="touch only what is at least AGE old (e.g. 30m, 2h, 1d, 3600): "
                        "unfinished steps unchanged that long, committed steps committed "
                        "that long ago")
    parser.add_argument("--keep-last", type=_at_least_one, metavar="N",
                        help="also delete committed steps: of each run, those beyond its N "
                        "newest (the newest step of a run is never deleted); without it "
                        "committed steps are left alone")
    # dest: ``run`` is the command's own entry point (Command.run)
    parser.add_argument("--run", dest="run_id", metavar="ID",
                        help="with --keep-last: only the committed steps of this run")
    parser.add_argument("--dry-run", action="store_true",
                        help="say what would be removed, remove nothing")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1; got {text!r}")
    return value


def run_clean(args: argparse.Namespace, out: Output) -> int:
    from composer_par.checkpoint.claims import clean_stale
    from composer_par.checkpoint.errors import CheckpointError
    from composer_par.checkpoint.steps import prune

    if args.run_id is not None and args.keep_last is None:
        raise InputError("--run chooses the committed steps to clean: give --keep-last too")
    try:
        cleaned = clean_stale(args.root, older_than=args.older_than, dry_run=args.dry_run)
        committed = [] if args.keep_last is None else prune(
            args.root, keep_last=args.keep_last, older_than=args.older_than, run=args.run_id,
            dry_run=args.dry_run)
    except CheckpointError as exc:
        raise InputError(str(exc)) from exc
    verb = "would remove" if args.dry_run else "removed"
    lines = ([f"{verb} unfinished: {p}" for p in cleaned.removed]
             + [f"{verb} committed: {p}" for p in committed]
             + [f"kept: {p}: {why}" for p, why in cleaned.kept])
    data = {"ok": True, "dry_run": args.dry_run,
            "removed_unfinished": [str(p) for p in cleaned.removed],
            "removed_committed": [str(p) for p in committed],
            "kept": [{"path": str(p), "why": why} for p, why in cleaned.kept]}
    out.result(data, "\n".join(lines) or f"nothing to {verb.split()[-1]} under {args.root}")
    return EXIT_OK


# -- convert ----------------------------------------------------------------------------------


def configure_convert(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SRC",
                        help="a DCP checkpoint (step directory, or a root: its latest committed "
                        "step), safetensors (file, directory or index json), a DeepSpeed "
                        "ZeRO checkpoint (the directory save_checkpoint wrote, or a tag in it), "
                        "or an FSDP1 model checkpoint (a torch.save file of the full state "
                        "dict, or a DCP directory of the sharded one)")
    parser.add_argument("destination", metavar="DST",
                        help="the directory to create (must not exist): safetensors when SRC "
                        "is DCP, a committed DCP checkpoint when SRC is safetensors; from "
                        "DeepSpeed or FSDP1, what --to says")
    parser.add_argument("--to", choices=("safetensors", "dcp"),
                        help="from a DeepSpeed or FSDP1 checkpoint: write its model weights "
                        "as safetensors (the default) or as a committed DCP checkpoint")
    parser.add_argument("--tag", metavar="TAG",
                        help="from a DeepSpeed checkpoint: the tag to read (default: the one "
                        "its 'latest' file names)")
    parser.add_argument("--dtype", metavar="DTYPE",
                        help="convert floating-point tensors to DTYPE: one of float16, "
                        "bfloat16, float32, float64 (integer and bool tensors keep theirs)")
    parser.add_argument("--max-file-size", type=parse_size, metavar="SIZE",
                        help="to safetensors: split into files of at most SIZE (e.g. 5GB) "
                        "with an index json; default: one file")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr")


def run_convert(args: argparse.Namespace, out: Output) -> int:
    from pathlib import Path

    from composer_par.checkpoint.convert import FLOAT_DTYPES, refusal
    from composer_par.checkpoint.errors import CheckpointError
    from composer_par.checkpoint.formats import check_target, detect

    stream = out.stderr if out.stderr is not None else sys.stderr
    if args.dtype is not None and args.dtype.removeprefix("torch.") not in FLOAT_DTYPES:
        raise InputError(f"--dtype {args.dtype}: {refusal(args.dtype.removeprefix('torch.'))}")
    bar = None
    try:
        fmt = detect(args.source)
        target = check_target(fmt, Path(args.source), args.to)
        if args.max_file_size is not None and target != "safetensors":
            raise InputError("--max-file-size applies only when converting to safetensors")
        bar = None if args.no_progress else ProgressBar(stream, f"converting to {target}")
        result = fmt.convert(Path(args.source), Path(args.destination), to=target,
                             tag=args.tag, dtype=args.dtype,
                             max_file_bytes=args.max_file_size, progress=bar)
    except CheckpointError as exc:
        raise InputError(str(exc)) from exc
    except (ValueError, FileExistsError) as exc:
        raise InputError(f"{args.source}: {exc}") from exc
    if bar is not None:
        bar.close()
    data = {"ok": True, "to": target, "from": fmt.name, **result.to_dict()}
    text = (f"converted {result.tensors} tensor(s), {result.bytes / 2**30:.2f} GiB, "
            f"{result.source} ({fmt.name}) -> {result.destination} ({target}) in "
            f"{result.seconds:.1f} s")
    out.result(data, text)
    return EXIT_OK
