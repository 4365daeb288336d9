"""One rank of one selfcheck rung: train a few steps and report what the checks need.

Started by torch's elastic launcher (:mod:`composer_par.tools.selfcheck`); every rank
returns its own record, so that the checks look at each rank's view, not rank 0's alone:
the plan it built, its data shard and the samples it read, its full parameters before
and after training, the losses (global means), its step times, its peak memory and,
from ``torch.profiler``, the time its collectives took in the last step.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.plan import ParallelPlan

# What deterministic mode sets (reported with the result, so the log says it).
CUBLAS_WORKSPACE = ":4096:8"
# Lines torch's profiler (kineto) writes to the process's stderr on every start and stop.
PROFILER_NOISE = ("USDT:", "STAGE:")


class ModelCodeError(RuntimeError):
    """The model factory raised on a rank (the input's fault: selfcheck exits 2)."""
# Profiler events of collectives: the backends' own ranges (gloo's and NCCL's, which
# last from issue to completion) and, on CUDA, NCCL's kernels.
COLLECTIVE_PREFIXES = ("gloo:", "nccl:", "ncclKernel", "ncclDevKernel")


def deterministic_settings(seed: int, on: bool) -> dict[str, Any]:
    """Fix the seeds and, with ``on``, switch torch to deterministic algorithms; the
    settings as they were set, for the report."""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    settings: dict[str, Any] = {"torch.manual_seed": seed, "random.seed": seed}
    if on:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        settings.update({"torch.use_deterministic_algorithms": True,
                         "torch.backends.cudnn.deterministic": True,
                         "torch.backends.cudnn.benchmark": False,
                         "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")})
    return settings


def rung_rank(settings: dict[str, Any]) -> dict[str, Any]:
    """The launcher's entry point: a rank's work between init and destroy of its
    process group (:func:`composer_par.teardown.call_rank`)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from composer_par.teardown import call_rank

    result = call_rank(record(_rung_rank), settings)
    assert result is not None  # record() returns what the function returned
    return result


def _rung_rank(settings: dict[str, Any]) -> dict[str, Any]:
    import warnings

    from composer_par.tools.demo import local_rank_group

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    with local_rank_group(settings["timeout"]):
        return _train(settings)


def _train(settings: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from composer_par.hangs import name_stuck_ranks
    from composer_par.testing.parity import full_parameters
    from composer_par.tools.dryrun import DryRunError, build_on_meta, resolve_factory
    from composer_par.tools.selfcheck import rung_plan

    ranks = settings["ranks"]
    with name_stuck_ranks(settings["timeout"]):
        rank = dist.get_rank()
        determinism = deterministic_settings(settings["seed"], settings["deterministic"])
        plan, folds = rung_plan(settings["plan"], ranks, baseline=ranks == 1)
        try:
            built = build_on_meta(resolve_factory(settings["model"]), settings["model"])
        except DryRunError as exc:
            raise ModelCodeError(f"rank {rank}: {exc}") from None
        shards = settings.get("micro_batches", 1) if ranks == 1 else 1
        vocab = vocabulary_size(built)
        estimate = _estimate(plan, built, settings, ranks) if rank == 0 else None
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        before = _memory_before(device)
        model = plan.apply(built)
        index, count = plan.data_shard()
        with _gathers_quiet():
            initial = full_parameters(model)
        if ranks == 1 and settings.get("param_dtype"):
            compute_in(model, getattr(torch, settings["param_dtype"]))
        optimizer = torch.optim.SGD(model.parameters(), lr=settings["lr"])
        # The rungs compare every rank's full parameters with the baseline's, which the
        # replica check's comparison of copies is a part of: it would stop a drifted rank
        # before the check that names it against the baseline.
        trainer = plan.training_step(model, causal_lm_loss, check_replicas_every=None,
                                     accumulate=shards)
        total = settings["warmup"] + settings["steps"]
        if shards > 1:
            # One micro-batch per data shard of the rung compared with, in shard order:
            # what each of its ranks takes a per-micro-batch loss over.
            per_shard = [sample_ids(settings, i, shards, total) for i in range(shards)]
            batch_ids = [[i for shard in per_shard for i in shard[step]]
                         for step in range(total)]
        else:
            batch_ids = sample_ids(settings, index, count, total)
        from composer_par.tools.demo import corpus_tokens

        data = corpus_tokens()
        losses, times = [], []
        comm: dict[str, Any] = {}
        for step in range(total):
            ids = batch_ids[step]
            tokens = torch.stack([sample(data, i, settings["seq_len"], vocab)
                                  for i in ids]).to(device)
            last = step == total - 1
            _sync(device)
            started = time.perf_counter()
            if last:
                loss, comm = _profiled_step(trainer, optimizer, tokens, device)
            else:
                loss = _step(trainer, optimizer, tokens)
            _sync(device)
            times.append(time.perf_counter() - started)
            losses.append(float(loss))
        with _gathers_quiet():
            final = full_parameters(model)
        timed = times[settings["warmup"]:]
        # The profiled last step runs slower; it is left out of the median when others are
        # timed.
        unprofiled = timed[:-1] or timed
        return {
            "rank": rank, "ranks": ranks, "plan": plan.to_toml(), "folds": folds,
            "mesh": plan.mesh.to_dict(), "data_shard": [index, count],
            "samples": batch_ids, "losses": losses,
            "initial": {k: v.cpu() for k, v in initial.items()},
            "final": {k: v.cpu() for k, v in final.items()},
            "step_times": times, "step_time_s": statistics.median(unprofiled),
            "peak_bytes": _peak_bytes(device, before), "estimate_bytes": estimate,
            "comm": comm, "determinism": determinism, "device": str(device),
            "backend": dist.get_backend(), "aux_losses": trainer.aux_losses_seen,
            "micro_batches": shards, "param_dtype": settings.get("param_dtype"),
        }


def _step(trainer: Any, optimizer: Any, tokens: torch.Tensor) -> torch.Tensor:
    loss = trainer.step(tokens, tokens)
    optimizer.step()
    optimizer.zero_grad()
    return loss  # type: ignore[no-any-return]


def _profiled_step(trainer: Any, optimizer: Any, tokens: torch.Tensor, device: torch.device
                   ) -> tuple[torch.Tensor, dict[str, Any]]:
    """One step under ``torch.profiler``: the loss, and the time in collectives (the
    union of their intervals, so overlapping ones count once) against the step's."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    started = time.perf_counter()
    with _stderr_without(PROFILER_NOISE), profile(activities=activities) as prof:
        loss = _step(trainer, optimizer, tokens)
        _sync(device)
    step_us = (time.perf_counter() - started) * 1e6
    intervals: list[tuple[float, float]] = []
    by_name: dict[str, dict[str, Any]] = {}
    for event in prof.events():
        if not event.name.startswith(COLLECTIVE_PREFIXES):
            continue
        start, end = event.time_range.start, event.time_range.end
        intervals.append((start, end))
        entry = by_name.setdefault(event.name, {"name": event.name, "calls": 0, "us": 0.0})
        entry["calls"] += 1
        entry["us"] += end - start
    busy = _union_length(intervals)
    top = sorted(by_name.values(), key=lambda e: -e["us"])
    return loss, {"collective_us": busy, "step_us": step_us,
                  "share": min(1.0, busy / step_us) if step_us else 0.0,
                  "top": [{"name": e["name"], "calls": e["calls"],
                           "seconds": e["us"] / 1e6} for e in top[:5]]}


@contextlib.contextmanager
def _gathers_quiet() -> Iterator[None]:
    """The check's gathers of full parameters without DTensor's warning that gathering a
    strided shard takes two all-gathers (a cost of the check, not of the plan)."""
    import logging

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _stderr_without(prefixes: tuple[str, ...]) -> Iterator[None]:
    """The process's stderr (file descriptor 2: C++ writes there too) held in a file
    while the block runs, then written out without the lines starting with
    ``prefixes``."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(True)
                    if not line.startswith(prefixes)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def compute_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Run ``model``'s forwards on copies of its parameters cast to ``dtype``, as a
    data-parallel plugin's mixed precision does (FSDP2's ``param_dtype``): the
    parameters stay float32 and their gradients come back to them in float32 (the
    reduction dtype of one process). Buffers stay as they are."""
    owners = [(m, name) for m in model.modules() for name, p in m._parameters.items()
              if p is not None and p.is_floating_point()]

    def cast(module: nn.Module, args: Any) -> None:
        copies: dict[int, Any] = {}
        for owner, name in owners:
            param = owner._parameters[name]
            assert param is not None
            if id(param) not in copies:
                copies[id(param)] = param.to(dtype)
            owner.__dict__.setdefault(_HELD, {})[name] = param
            owner._parameters[name] = copies[id(param)]

    def restore(module: nn.Module, args: Any, output: Any) -> None:
        for owner, name in owners:
            held = owner.__dict__.get(_HELD, {})
            if name in held:
                owner._parameters[name] = held.pop(name)

    model.register_forward_pre_hook(cast)
    model.register_forward_hook(restore, always_call=True)


_HELD = "_selfcheck_float32_parameters"


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory_before(device: torch.device) -> int:
    """On CUDA: reset the peak and start from what is allocated. On CPU: the resident
    set now (the interpreter, torch, the process group), so that the peak reported is
    what the model and its training added."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes(device: torch.device, before: int) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)) - before
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return max(0, peak - before)


def _estimate(plan: ParallelPlan, built: nn.Module, settings: dict[str, Any],
              ranks: int) -> int | None:
    """The estimate's per-rank memory for this layout, or None when it cannot say."""
    from composer_par.estimate import EstimateError, ModelShape, Workload, estimate_plan

    try:
        shape = ModelShape.from_module(built, plan.block_spec(), source=settings["model"])
        _, count = plan.data_shard(0, ranks)
        workload = Workload(seq=settings["seq_len"], micro_batch=settings["batch"] // count,
                            optimizer="sgd")
        est = estimate_plan(plan, shape, workload, world_size=ranks)
    except (EstimateError, ValueError, TypeError):
        return None
    fullest = est.fullest
    return int(fullest.memory.total if fullest is not None else est.memory.total)


# -- data: a function of the sample id, so every layout reads the same global batch ------


def sample(data: torch.Tensor, sample_id: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Sample ``sample_id``: a window of the corpus (bytes, folded into the vocabulary)."""
    start = (sample_id * 7919) % (len(data) - seq_len)
    return data[start:start + seq_len] % vocab


def sample_ids(settings: dict[str, Any], index: int, count: int, steps: int
               ) -> list[list[int]]:
    """The sample ids this data shard reads at each step: from ``DistributedSampler``
    (or the ``--sampler`` factory) over ``steps * batch`` samples, shuffled with the seed,
    ``batch / count`` per step."""
    from torch.utils.data import DistributedSampler

    from composer_par.tools.dryrun import resolve_factory

    size = steps * settings["batch"]
    dataset: Any = range(size)  # sample ids: all a sampler needs is the length
    if settings.get("sampler"):
        make: Any = resolve_factory(settings["sampler"])
        sampler = make(dataset, num_replicas=count, rank=index, seed=settings["seed"])
    else:
        sampler = DistributedSampler(dataset, num_replicas=count, rank=index, shuffle=True,
                                     seed=settings["seed"], drop_last=True)
    ids = [int(i) for i in sampler]
    local = settings["batch"] // count
    return [ids[s * local:(s + 1) * local] for s in range(steps)]


def vocabulary_size(model: nn.Module) -> int:
    """The rows of the model's input embedding (its first ``nn.Embedding``)."""
    import torch.nn as nn

    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError("selfcheck trains a causal language model: the model has no "
                         "nn.Embedding to read token ids with")
    return int(embedding.num_embeddings)


def causal_lm_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of logits (a tensor, or an output with ``.logits`` as
    Hugging Face models return)."""
    from composer_par.models.llama import next_token_loss

    logits = getattr(outputs, "logits", outputs)
    return next_token_loss(logits, tokens)


__all__ = ["causal_lm_loss", "deterministic_settings", "rung_rank", "sample", "sample_ids",
           "vocabulary_size"]
