"""``composer-par demo``: validate, explain and apply a plan, then train a small Llama on
local processes started by torch's elastic launcher (CPU/gloo; CUDA/NCCL with GPUs).

The default plan is FSDP2 x TP on 2 x 2 with activation checkpointing and MetaInit.
``--model moe-llama`` trains a mixture-of-experts Llama instead (default plan: FSDP2 x EP
on 2 x 2) and reports each step's routing: tokens per expert and per ep rank
(min/mean/max) and the tokens dropped. Tokens
are the bytes of a small text shipped in the package, so the run needs no download. The
batch of step ``s`` depends only on ``s``, and the checkpoint holds the model, the
optimizer and the step, so ``--resume`` continues with the losses an uninterrupted run
would have had.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_PLAN = """\
[mesh]
dp_shard = 2
tp = 2

[[plugins]]
name = "tp"

[[plugins]]
name = "activation_checkpoint"
mode = "full"

[[plugins]]
name = "fsdp2"
reshard_after_forward = true

[[plugins]]
name = "meta_init"
seed = 0
"""

# --model moe-llama without --plan: its experts over ep, everything else FSDP2 over all four.
DEFAULT_MOE_PLAN = """\
[mesh]
dp_shard = 2
ep = 2

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "ep"

[[plugins]]
name = "meta_init"
seed = 0
"""

MODELS = ("llama", "moe-llama")

# The CPU build of torch warns at import when NumPy is absent; nothing here needs it.
_QUIET_NUMPY = "ignore:Failed to initialize NumPy"
# Set to "RANK:STEP" to make that rank raise at that step (shows the failure path).
FAIL_ENV = "COMPOSER_PAR_DEMO_FAIL"
# A testing aid: "RANK:STEP" makes that rank stop at that step, alive but joining no
# collective, to show that the others give up at --timeout and name it.
FREEZE_ENV = "COMPOSER_PAR_DEMO_FREEZE"


def corpus_bytes() -> bytes:
    return resources.files("composer_par").joinpath("data/corpus.txt").read_bytes()


def corpus_tokens(at_least: int = 0) -> Any:
    """The corpus as byte tokens, repeated end to end until it holds ``at_least`` of them
    (sequences longer than the corpus: context parallelism's long runs)."""
    import torch

    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    return data.repeat(-(-at_least // len(data))) if at_least > len(data) else data


# Bounds of the options: a small model on a small corpus, on one machine's processes.
MAX_NPROC = 256
MAX_SEQ_LEN = 131072  # long sequences are what context parallelism is for
MAX_BATCH = 4096
MAX_TIMEOUT_S = 24 * 3600.0
DEFAULT_NPROC = 4  # DEFAULT_PLAN's world size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Every value is checked here, at parse time, and the options against each other by
    # check_arguments: a bad command line must fail before any process starts.
    from composer_par.cli.common import bounded_float, bounded_int

    parser.add_argument("--plan", type=_plan_file, help="a plan file (default: FSDP2 x TP 2x2 "
                        "+ activation checkpointing + MetaInit; with --model moe-llama "
                        "FSDP2 x EP 2x2 + MetaInit)")
    parser.add_argument("--model", choices=MODELS, default="llama",
                        help="the small Llama, or a mixture-of-experts Llama (8 experts, "
                        "top-2) whose routing each step reports (default llama)")
    parser.add_argument("--nproc", type=bounded_int(1, MAX_NPROC), default=None,
                        help="local processes (default: the plan's world size, else 4)")
    parser.add_argument("--steps", type=bounded_int(1), default=40,
                        help="train until this step (default 40)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest committed checkpoint")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("composer-par-demo"),
                        help="where checkpoints go (default ./composer-par-demo)")
    parser.add_argument("--seq-len", type=bounded_int(2, MAX_SEQ_LEN), default=64,
                        help="tokens per sequence (default 64)")
    parser.add_argument("--batch", type=bounded_int(1, MAX_BATCH), default=8,
                        help="global batch (sequences; default 8)")
    parser.add_argument("--lr", type=bounded_float(0.0), default=3e-3,
                        help="learning rate (default 3e-3)")
    parser.add_argument("--timeout", type=bounded_float(0.0, MAX_TIMEOUT_S), default=30.0,
                        help="process-group timeout in seconds: how soon the other ranks "
                        "stop when one dies (default 30)")
    parser.add_argument("--fail", metavar="RANK:STEP", type=_fail_at,
                        default=os.environ.get(FAIL_ENV),
                        help="make RANK raise at STEP, to see how a failure is reported "
                        f"(default: ${FAIL_ENV})")


def _plan_file(text: str) -> Path:
    """--plan: a file that can be read as a plan file (with its size bound)."""
    from composer_par.planfile import PlanFileError, read_source

    path = Path(text)
    try:
        read_source(path)
    except PlanFileError as exc:
        raise argparse.ArgumentTypeError(exc.report.findings[0].message) from None
    return path


def _fail_at(text: str) -> str:
    """--fail RANK:STEP, with RANK >= 0 and STEP >= 1."""
    rank, colon, step = text.strip().partition(":")
    try:
        numbers = (int(rank), int(step)) if colon else None
    except ValueError:
        numbers = None
    if numbers is None or numbers[0] < 0 or numbers[1] < 1:
        raise argparse.ArgumentTypeError(
            f"expected RANK:STEP with RANK >= 0 and STEP >= 1 (e.g. 1:2); got {text!r}")
    return f"{numbers[0]}:{numbers[1]}"


def check_arguments(args: argparse.Namespace) -> str:
    """What is wrong between the options ('' if nothing), found before any process
    starts: a --fail rank that is not one of the processes or a step never reached, a
    batch smaller than the plan's data-parallel ranks. A plan that cannot be read or
    validated is left to :func:`run`, which reports its findings."""
    from composer_par.plan import ParallelPlan
    from composer_par.planfile import PlanFileError

    try:
        plan = ParallelPlan.from_toml(plan_text(args))
    except (PlanFileError, OSError, UnicodeDecodeError):
        return ""
    nproc = args.nproc or (plan.mesh.world_size if plan.mesh.is_resolved else DEFAULT_NPROC)
    if args.fail:
        rank, step = (int(n) for n in args.fail.split(":"))
        if rank >= nproc:
            return (f"--fail {args.fail}: rank {rank} is not one of the {nproc} processes "
                    f"(0 .. {nproc - 1})")
        if step > args.steps:
            return (f"--fail {args.fail}: step {step} comes after the last step "
                    f"(--steps {args.steps}), so nothing would fail")
    if plan.validate(world_size=nproc).ok:
        _, shards = plan.data_shard(0, nproc)
        if args.batch < shards:
            return (f"--batch {args.batch} is smaller than the plan's {shards} data-parallel "
                    "ranks: each needs at least one sequence")
    return ""


def plan_text(args: argparse.Namespace) -> str:
    """The plan file's text, or the default plan of the model."""
    if args.plan:
        return str(args.plan.read_text())
    return DEFAULT_MOE_PLAN if getattr(args, "model", "llama") == "moe-llama" else DEFAULT_PLAN


def _quiet_numpy_warning() -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    os.environ["PYTHONWARNINGS"] = ",".join(
        w for w in (os.environ.get("PYTHONWARNINGS"), _QUIET_NUMPY) if w
    )


def run(args: argparse.Namespace, out: Any = None) -> int:
    """Validate and explain the plan, then train. ``out`` is the CLI's Output: progress
    goes to stderr, so with --json stdout holds only the result."""
    _quiet_numpy_warning()
    from composer_par.plan import ParallelPlan
    from composer_par.planfile import PlanFileError
    from composer_par.topology import Topology

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    text = plan_text(args)
    model_name = getattr(args, "model", "llama")
    try:
        plan = ParallelPlan.from_toml(text)
    except PlanFileError as exc:
        say(str(exc))
        return 2
    nproc = args.nproc or (plan.mesh.world_size if plan.mesh.is_resolved else 4)
    plan.topology = Topology.single_node(nproc)
    import torch

    with torch.device("meta"):  # the model too: an ep plan for the dense Llama is CP802
        report = plan.validate(build_model(model_name, args.seq_len), world_size=nproc)
    say(report.format())
    if not report.ok:
        return 1
    say(plan.explain(world_size=nproc).format())
    problem = _prepare_checkpoint_dir(args.checkpoint_dir, args.resume)
    if problem:
        say(problem)
        return 2
    freeze = os.environ.get(FREEZE_ENV) or None
    if freeze is not None:
        try:
            freeze = _fail_at(freeze)
        except argparse.ArgumentTypeError as exc:
            say(f"{FREEZE_ENV}: {exc}")
            return 2

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"demo-{os.getpid()}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
    )
    settings = {k: getattr(args, k) for k in
                ("steps", "resume", "seq_len", "batch", "lr", "timeout", "fail")}
    settings["checkpoint_dir"] = str(args.checkpoint_dir)
    settings["freeze"] = freeze
    settings["model"] = model_name
    started = time.perf_counter()
    try:
        results = elastic_launch(config, train_rank)(text, settings)
    except ChildFailedError as exc:
        rank, failure, message = _first_failure(exc)
        stuck = _STUCK.match(message)
        if stuck:
            say(f"demo failed: {message.removeprefix('StuckRankError: ')} (reported by rank "
                f"{rank}, exit code {failure.exitcode})")
        else:
            say(f"demo failed: rank {rank} exited with code {failure.exitcode}: {message}")
        if out is not None and out.json_mode:
            failed: dict[str, Any] = {"ok": False, "failed_rank": rank,
                                      "exit_code": failure.exitcode,
                                      "error": message}
            if stuck:
                # The rank that failed is the stuck one; the rank whose error says so
                # was healthy, and only reported it.
                failed["stuck_ranks"] = [int(r) for r in stuck.group(1).split(",")]
                failed["failed_rank"] = failed["stuck_ranks"][0]
                failed["reported_by"] = rank
            out.result(failed, "")
        return 1
    seconds = time.perf_counter() - started
    for rank, rank_result in sorted(results.items()):
        left = rank_result.pop("threads_left")
        if left:  # would risk an abort at the rank's exit; a bug to report
            say(f"rank {rank}: process group threads still running at exit: "
                f"{', '.join(left)}")
    result = results[0]
    losses = result["losses"]
    summary = [
        f"trained steps {result['first_step'] + 1}-{args.steps} on {nproc} processes in "
        f"{seconds:.1f}s: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        if losses else f"already at step {args.steps}: nothing to train",
        "peak memory per rank: " + ", ".join(
            f"rank {r} {m / 2**20:.0f} MiB" for r, m in enumerate(result["peak_bytes"])),
        f"checkpoint: {result['checkpoint']}",
        *(f"step {r['step']} routing: {r['text']}" for r in result.get("routing", [])),
    ]
    data = {"ok": True, "nproc": nproc, "seconds": round(seconds, 2), **result,
            "plan": plan.to_toml()}
    if out is not None:
        out.result(data, "\n".join(summary))
    else:
        print("\n".join(summary))
    return 0


_STUCK = re.compile(r"StuckRankError: ranks? ([\d, ]+) never joined")


def _first_failure(exc: Any) -> tuple[int, Any, str]:
    """(rank, failure, message) to report. A rank's StuckRankError comes first: it names
    the rank the others waited for, which the launcher only stopped; otherwise the
    launcher's first failure (its timestamps count whole seconds, so ties go to the
    lowest rank)."""

    def text(failure: Any) -> str:
        # With @record the launcher hands back the rank's error file: a dict whose
        # "message" is "Type: text"; without one, a plain string.
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", str(message))
        return str(message).strip()

    for rank, failure in sorted(exc.failures.items()):
        if _STUCK.match(text(failure)):
            return rank, failure, text(failure)
    rank, failure = exc.get_first_failure()
    return rank, failure, text(failure)


def _freeze(rank: int, step: int) -> None:
    print(f"rank {rank}: frozen at step {step} ({FREEZE_ENV}): alive, joining no collective",
          file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


# Written into a checkpoint directory the demo created, so that a fresh run may clear it
# (and never a directory someone else filled).
OWNER_MARK = ".composer-par-demo"


def _prepare_checkpoint_dir(directory: Path, resume: bool) -> str:
    """Check (resume) or clear (fresh run) the demo's checkpoints; a problem, or ''."""
    import shutil

    from composer_par.checkpoint import latest

    if resume:
        if latest(directory) is None:
            return f"--resume: no committed checkpoint under {directory}"
        return ""
    if directory.exists() and any(directory.iterdir()):
        if not (directory / OWNER_MARK).exists():
            return (f"{directory} is not empty and was not made by the demo: choose another "
                    "--checkpoint-dir, or pass --resume to continue from it")
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / OWNER_MARK).touch()
    return ""


def _batch(data: Any, step: int, batch: int, seq_len: int) -> Any:
    """The global batch of ``step``: a function of the step alone, so a resumed run reads
    exactly what an uninterrupted one would."""
    import torch

    gen = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()])


def _peak_bytes(device: Any) -> int:
    import resource

    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class _Progress:
    """One line per step: redrawn in place on a terminal, printed every few steps else."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        done = (step - self.first) / max(1, self.last - self.first)
        bar = "#" * int(24 * done) + "." * (24 - int(24 * done))
        line = f"[{bar}] step {step}/{self.last}  loss {loss:.4f}  {tokens_per_s:7.0f} tokens/s"
        if self.tty:
            end = "\n" if step == self.last else ""
            print(f"\r{line}", end=end, file=sys.stderr, flush=True)
        elif step == self.first + 1 or step % 5 == 0 or step == self.last:
            print(line, file=sys.stderr, flush=True)


def train_rank(plan_text: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One rank: build on meta, apply the plan, train, save; rank 0 returns the results.
    Whether it returns or raises, its process groups are destroyed and their threads
    joined first (:func:`composer_par.teardown.call_rank`)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from composer_par.teardown import call_rank, process_group_threads

    result = call_rank(record(_train_rank), plan_text, settings)
    return {**(result or {}), "threads_left": process_group_threads()}


@contextlib.contextmanager
def local_rank_group(timeout_s: float) -> Iterator[None]:
    """The default process group of a rank torch's launcher started (NCCL on its GPU where
    CUDA is, else gloo), one thread and warning-level logs; destroyed on the way out."""
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from composer_par.logging import configure_logging

    # TP hands the root a view of its logits; FSDP2 warns that an in-place op on such a
    # view would skip its backward hook. The losses here read the logits out of place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    torch.set_num_threads(1)
    configure_logging(level="WARNING")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train_rank(plan_text: str, settings: dict[str, Any]) -> dict[str, Any]:
    with local_rank_group(settings["timeout"]):
        # Its own frame: what it made (the model, the plan's mesh) is gone when it returns.
        return _train(plan_text, settings)


def _train(plan_text: str, settings: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from composer_par import checkpoint
    from composer_par.hangs import name_stuck_ranks
    from composer_par.models.llama import next_token_loss
    from composer_par.plan import ParallelPlan

    with name_stuck_ranks(settings["timeout"]):
        rank = dist.get_rank()
        fail_rank, _, fail_step = (settings["fail"] or "-1:-1").partition(":")
        plan = ParallelPlan.from_toml(plan_text)
        plan.timeout = timedelta(seconds=settings["timeout"])  # --timeout: every group
        freeze_rank, _, freeze_step = (settings.get("freeze") or "-1:-1").partition(":")
        seq_len, batch = settings["seq_len"], settings["batch"]
        with torch.device("meta"):
            built = build_model(settings.get("model", "llama"), seq_len)
        model = plan.apply(built)
        device = next(model.parameters()).device
        index, count = plan.data_shard()
        data = corpus_tokens(2 * seq_len)
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"])
        # The same loop for every plan: with a pipeline the step runs its schedule.
        # Under context parallelism (a cp plugin) each rank takes its part of every
        # sequence through the ContextShard the plan notes (see docs/cp.md).
        context = plan.notes.get("cp")
        # The MoE Llama's router loss: the step adds it (composer_par.aux_loss).
        loss_fn = next_token_loss if context is None else context.cross_entropy
        trainer = plan.training_step(model, loss_fn)
        # EP's routing of each step's forward (a collective over the ep ranks; absent
        # without EP), read through the plan's notes: the demo imports no plugin.
        routing_of = plan.notes.get("ep_routing")
        routing: list[dict[str, Any]] = []
        first = 0
        if settings["resume"]:
            # A pipeline rank's model holds its stages' keys only: the checkpoint's
            # other keys are another rank's (strict would call them unexpected).
            first = checkpoint.load(settings["checkpoint_dir"], model, optimizer,
                                    strict=plan.pipeline is None).step
        progress = _Progress(first, settings["steps"])
        losses: list[float] = []
        for step in range(first + 1, settings["steps"] + 1):
            if rank == int(fail_rank) and step == int(fail_step):
                raise RuntimeError(f"failure injected at step {step} (--fail)")
            if rank == int(freeze_rank) and step == int(freeze_step):
                _freeze(rank, step)
            started = time.perf_counter()
            tokens = _batch(data, step, batch, seq_len).chunk(count)[index].to(device)
            if context is None:
                loss = trainer.step(tokens, tokens)  # the global batch's mean loss
            else:
                labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], 1)
                positions = context.positions(seq_len, device).expand(tokens.shape[0], -1)
                loss = trainer.step(context.shard(tokens), context.shard(labels),
                                    positions=positions)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
            summary = routing_of(model, step) if routing_of is not None else None
            if summary is not None:
                routing.append({**summary.as_dict(), "text": summary.format()})
            if rank == 0:
                tokens_per_s = batch * seq_len / (time.perf_counter() - started)
                progress.update(step, losses[-1], tokens_per_s)
        saved = checkpoint.latest(settings["checkpoint_dir"])
        if losses:
            saved = checkpoint.save(settings["checkpoint_dir"], model, optimizer,
                                    step=settings["steps"], plan=plan, keep_last=2)
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, _peak_bytes(device))
        result = {"first_step": first, "losses": losses, "peak_bytes": peaks,
                  "checkpoint": str(saved)}
        return {**result, "routing": routing} if routing_of is not None else result


def demo_model(max_seq_len: int = 1024) -> Any:
    """The demo's Llama (``--model composer_par.tools.demo:demo_model`` for selfcheck,
    whose ``--seq-len`` stops at the default ``max_seq_len``)."""
    from composer_par.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=256,
                             max_seq_len=max_seq_len))


def demo_moe_model(max_seq_len: int = 1024) -> Any:
    """The demo's mixture-of-experts Llama: the Llama's attention, each block's
    feed-forward top-2 of 8 experts."""
    from composer_par.models.moe_llama import MoELlama, MoELlamaConfig

    return MoELlama(MoELlamaConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4,
                                   ffn_hidden=256, max_seq_len=max_seq_len, num_experts=8,
                                   top_k=2, expert_hidden=128))


def build_model(name: str, max_seq_len: int = 1024) -> Any:
    """The demo model ``name`` (one of :data:`MODELS`)."""
    return demo_moe_model(max_seq_len) if name == "moe-llama" else demo_model(max_seq_len)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="composer-par demo", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    problem = check_arguments(args)
    if problem:
        parser.error(problem)
    return run(args)
