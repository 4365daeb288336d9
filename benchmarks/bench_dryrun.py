"""Dry-run time of a 1B-parameter model at 8, 64 and 512 ranks (target: < 10 s for 64).

``composer-par validate PLAN.toml --model bench_dryrun:llama_1b`` is timed as a user runs
it: a fresh process each time (interpreter, torch import, building the model on meta,
validating, and applying the plan as rank 0 and the last rank over the fake backend).
The same dry run inside one warm process (torch imported, model class compiled) is
timed side by side, to show what the dry run itself costs.

The model has TinyLlama-1.1B's shape (22 blocks, hidden 2048, 32 heads, 4 KV heads,
1.10 B parameters). The plan is HSDP (replicate across nodes) x FSDP2 (8 devices per
node) + MetaInit, or FSDP2 alone where the hsdp plugin is not installed.

    .venv/bin/python benchmarks/bench_dryrun.py [--runs 3]

Prints, for each size, the median wall times and their ratio to the 10 s target
(<= 1 meets it).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_S = 10.0
HERE = Path(__file__).resolve().parent


def llama_1b() -> Any:
    """The factory the CLI builds (on meta): TinyLlama-1.1B's shape."""
    from composer_par.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                             ffn_hidden=5632, max_seq_len=2048))


def plan_text(world: int) -> tuple[str, str]:
    from composer_par.plugin.registry import Registry

    nodes = max(1, world // 8)
    hsdp = "hsdp" in Registry().names() and nodes > 1
    mesh = f"dp_replicate = {nodes}\ndp_shard = 8\n" if hsdp else f"dp_shard = {world}\n"
    plugins = ["hsdp", "fsdp2", "meta_init"] if hsdp else ["fsdp2", "meta_init"]
    text = f"[mesh]\n{mesh}\n[topology]\nnodes = {nodes}\ndevices_per_node = {min(world, 8)}\n"
    text += "".join(f'\n[[plugins]]\nname = "{n}"\n' for n in plugins)
    return text, " x ".join(plugins)


def cli() -> list[str]:
    script = Path(sys.executable).parent / "composer-par"
    return [str(script)] if script.exists() else [sys.executable, "-m", "composer_par.cli"]


def cold(path: Path, runs: int) -> tuple[list[float], int]:
    command = [*cli(), "validate", str(path), "--model", "bench_dryrun:llama_1b"]
    times, code = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, check=False, cwd=HERE)
        times.append(time.perf_counter() - started)
        code = done.returncode
        if code:
            sys.stderr.write(done.stdout.decode()[-2000:] + done.stderr.decode()[-2000:])
    return times, code


def warm(path: Path, runs: int) -> list[float]:
    from composer_par import ParallelPlan
    from composer_par.tools.dryrun import dry_run

    plan = ParallelPlan.from_toml(path)
    dry_run(plan, llama_1b)  # imports (torch, the fake backend, dynamo for meta init) once
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        result = dry_run(plan, llama_1b)
        times.append(time.perf_counter() - started)
        assert result.ok, result.report.format()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each measurement")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
    args = parser.parse_args()
    print("dry run of a 1.10 B-parameter Llama (TinyLlama shape), ranks 0 and last, "
          f"median of {args.runs}; target {TARGET_S:.0f} s")
    print(f"{'ranks':>6}  {'plan':<28}  {'CLI (fresh process)':>20}  {'ratio':>6}  "
          f"{'in process (warm)':>18}  {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.sizes:
            text, plugins = plan_text(world)
            path = Path(tmp, f"plan{world}.toml")
            path.write_text(text, encoding="utf-8")
            fresh, code = cold(path, args.runs)
            inside = warm(path, args.runs)
            a, b = statistics.median(fresh), statistics.median(inside)
            status = "" if code == 0 else f"  (exit code {code})"
            print(f"{world:>6}  {plugins:<28}  {a:>18.2f} s  {a / TARGET_S:>6.2f}  "
                  f"{b:>16.2f} s  {b / TARGET_S:>6.2f}{status}")
    print("ratio = median / target: <= 1.00 meets the target")


if __name__ == "__main__":
    main()
