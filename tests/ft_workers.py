"""Rank-side training of the ft plugin's tests (tests/test_ft_groups.py), and the
single-process reference they compare with.

Every rank trains the small Llama of :mod:`composer_par.testing.tasks` with a plan file
over a fault-tolerant dim, one JSON line per step in ``rundir`` (what the quorum said,
whether the step applied, the loss). Files in ``rundir`` coordinate with the test:

* ``<group>-ready``: the group applied its plan (its manager heartbeats) and waits to
  begin; every group waits until all initial groups are ready, so the first quorum holds
  them all;
* ``<group>-rank<r>-paused``: the group stopped inside step ``pause_at``'s forward, after
  its quorum formed, and waits to be killed there;
* a group with ``hold_at`` touches ``<group>-holding`` before that step and waits there
  until ``hold_for`` exists: the test releases it once the restarted group asks the
  lighthouse for a quorum, so that the restarted group joins at that step.

At the end each rank saves its local shards and the group's full parameters.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import attrs

from composer_par.testing.tasks import LlamaTask

TASK = LlamaTask(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=64,
                 global_batch=8, seq_len=8, data_seed=4321)
LR = 0.01


def lr_decay(step: int) -> float:
    """The learning rate's factor at ``step`` (a scheduler healing groups must take too)."""
    return 1.0 / (1.0 + 0.2 * step)


def plan_text(kind: str, lighthouse: str, *, timeout: float = 60.0) -> str:
    """The plan file of a test: ``fsdp2`` (HSDP over the groups, FSDP2 inside), ``hsdp_tp``
    (HSDP alone over the groups, TP inside) or ``diloco`` (as fsdp2, DiLoCo every 2)."""
    inner = {"fsdp2": 'dp_shard = 2', "diloco": 'dp_shard = 2', "hsdp_tp": 'tp = 2'}[kind]
    inside = {"fsdp2": '[[plugins]]\nname = "fsdp2"\n',
              "diloco": '[[plugins]]\nname = "fsdp2"\n',
              "hsdp_tp": '[[plugins]]\nname = "tp"\n'}[kind]
    # DiLoCo from the same seeded weights in every group (init_sync = false): with torchft's
    # init_sync each rank of a group would take its shard from a group of torchft's
    # choice at the first sync, mixing the first round's pseudo-gradients shard by shard.
    method = ('method = "diloco"\nsync_every = 2\ninit_sync = false\n' if kind == "diloco"
              else "")
    return (f"[plan]\ntimeout = {timeout}\n\n[mesh]\ndp_replicate = 2\n{inner}\n\n"
            f'[[plugins]]\nname = "hsdp"\n\n{inside}\n'
            f'[[plugins]]\nname = "ft"\nlighthouse = "{lighthouse}"\nmin_replicas = 1\n'
            f"{method}\n"
            '[[plugins]]\nname = "meta_init"\nseed = 7\n')


def train(plan_toml: str, rundir: str, group: str, steps: int, *,
          wait_for: tuple[str, ...] = (), pause_at: int | None = None,
          hold_at: int | None = None, hold_for: str | None = None,
          save_to: str | None = None, resume_from: str | None = None,
          die_at: int | None = None, schedule_lr: bool = True) -> None:
    """Train to ``steps`` (see the module); ``resume_from``: a checkpoint to start from
    (model, optimizer and torchft's step count, as a whole-job restart does);
    ``save_to``: where to save one at the end; ``die_at``: rank 0 SIGKILLs itself inside
    that step's forward, the first time the group gets there; ``schedule_lr``: a
    learning-rate scheduler, tracked so that a healing group takes it too."""
    import torch
    import torch.distributed as dist
    from composer_par.plugins.ft import replica_group_of

    from composer_par import ParallelPlan, checkpoint

    run = Path(rundir)
    rank = dist.get_rank()
    plan = ParallelPlan.from_toml(plan_toml)
    with torch.device("meta"):
        model = TASK.build()
    model = plan.apply(model)
    index, count = plan.data_shard()
    step = plan.training_step(model, lambda out, batch: _loss(out, batch))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    replicas = replica_group_of(model)
    assert replicas is not None and plan.notes["ft"] is replicas
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_decay) if schedule_lr else None
    if scheduler is not None:
        replicas.track("lr", scheduler)
    if resume_from is not None:
        info = checkpoint.load(resume_from, model, optimizer)
        replicas.load_state_dict(info.extra["ft"])
        if scheduler is not None:
            scheduler.load_state_dict(info.extra["lr"])
        assert replicas.step == info.step
    log = (run / f"{group}-rank{rank}.jsonl").open("a")
    _touch(run / f"{group}-ready") if rank == 0 else None
    for other in wait_for:
        _wait_file(run / f"{other}-ready")
    while True:
        if hold_at is not None and hold_for is not None and replicas.step >= hold_at:
            _touch(run / f"{group}-holding") if rank == 0 else None
            _wait_file(run / hold_for)
            hold_at = None
        step.begin()  # the quorum; a heal moves replicas.step
        at = replicas.step
        if at >= steps:
            break
        batch = TASK.batch(at).chunk(count)[index]
        if pause_at is not None and at == pause_at:
            _pause(run / f"{group}-rank{rank}-paused")
        if die_at is not None and at == die_at and rank == 0 \
                and not (run / f"{group}-died").exists():
            _touch(run / f"{group}-died")  # once: the relaunched group trains on
            os.kill(os.getpid(), signal.SIGKILL)
        loss = step.step(batch, batch)
        applied = step.optimizer_step(optimizer)
        if applied and scheduler is not None:
            scheduler.step()
        record = replicas.last
        log.write(json.dumps({"step": at, "applied": applied, "loss": float(loss),
                              "quorum": attrs.asdict(record) if record else None}) + "\n")
        log.flush()
    _save_state(model, run / f"{group}-rank{rank}.pt")
    if save_to is not None:
        checkpoint.save(save_to, model, optimizer, step=replicas.step, plan=plan,
                        extra={"ft": replicas.state_dict(),
                               "lr": scheduler.state_dict() if scheduler else None})
    replicas.shutdown()


def _loss(outputs: Any, batch: Any) -> Any:
    from composer_par.models.llama import next_token_loss

    return next_token_loss(outputs, batch)


def _pause(marker: Path) -> None:
    """Stop here, inside the step (the quorum formed, the all-reduce not yet run), until
    the test kills this process."""
    _touch(marker)
    while True:
        time.sleep(1)


def _touch(path: Path) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(str(os.getpid()))
    partial.rename(path)


def _wait_file(path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def _save_state(model: Any, path: Path) -> None:
    """This rank's local shards (bitwise comparison across groups) and the group's full
    parameters (comparison with the reference)."""
    import torch
    from torch.distributed.tensor import DTensor

    from composer_par.blocks import clean_name

    local, full = {}, {}
    for name, param in model.named_parameters():
        key = clean_name(name)
        if isinstance(param, DTensor):
            local[key] = param.to_local().detach().clone()
            full[key] = param.full_tensor().detach().clone()
        else:
            local[key] = full[key] = param.detach().clone()
    torch.save({"local": local, "full": full}, path)


# -- the reference ----------------------------------------------------------------------


def reference(schedule: list[tuple[int, ...]], groups: int, shards_per_group: int
              ) -> tuple[list[float], dict[str, Any]]:
    """One process training the same model from the same init on the same data, where
    step ``s`` averages the gradients of the groups ``schedule[s]`` (each the mean over its
    data shards): the run that had the same participants at each step. Returns each
    step's loss of group 0's shards and the parameters."""
    import torch
    from composer_par.plugins.meta_init import MetaInit

    from composer_par import MeshSpec, ParallelPlan

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = TASK.build()
    model = ParallelPlan(MeshSpec()).use(MetaInit(seed=7)).apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_decay)
    losses = []
    count = groups * shards_per_group
    for at, participants in enumerate(schedule):
        chunks = TASK.batch(at).chunk(count)
        with torch.no_grad():
            own = torch.cat(chunks[:shards_per_group])
            losses.append(float(_loss(model(own), own)))
        picked = torch.cat([chunks[g * shards_per_group + r] for g in participants
                            for r in range(shards_per_group)])
        _loss(model(picked), picked).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    from composer_par.blocks import clean_name

    return losses, {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}


def diloco_reference(rounds: list[dict[int, bool]], groups: int, shards_per_group: int,
                     sync_every: int, outer: tuple[float, float, bool]
                     ) -> tuple[list[float], dict[str, Any]]:
    """One process running DiLoCo as torchft does, with the groups that took part in each
    sync: ``rounds[r]`` maps each group of round ``r``'s sync to whether it healed there
    (it then took a live group's weights and inner optimizer before the sync, so its
    pseudo-gradient is that group's). Every group runs ``sync_every`` inner AdamW steps
    on its shards from the weights of the last sync it took part in; the outer SGD
    (lr, momentum, nesterov) steps on their mean pseudo-gradient. Returns group 0's
    inner-step losses and the weights after the last sync."""
    import copy

    import torch
    from composer_par.plugins.meta_init import MetaInit

    from composer_par import MeshSpec, ParallelPlan
    from composer_par.blocks import clean_name

    torch.set_num_threads(1)
    with torch.device("meta"):
        base = TASK.build()
    base = ParallelPlan(MeshSpec()).use(MetaInit(seed=7)).apply(base)
    lr, momentum, nesterov = outer
    outer_opt = torch.optim.SGD(base.parameters(), lr=lr, momentum=momentum,
                                nesterov=nesterov)
    local = [copy.deepcopy(base) for _ in range(groups)]
    inner = [torch.optim.AdamW(m.parameters(), lr=LR) for m in local]
    count = groups * shards_per_group
    losses: list[float] = []
    for r, members in enumerate(rounds):
        live = [g for g, healed in members.items() if not healed]
        for g in live:
            for at in range(r * sync_every, (r + 1) * sync_every):
                chunks = TASK.batch(at).chunk(count)
                picked = torch.cat([chunks[g * shards_per_group + i]
                                    for i in range(shards_per_group)])
                loss = _loss(local[g](picked), picked)
                loss.backward()
                inner[g].step()
                inner[g].zero_grad()
                if g == 0:
                    losses.append(float(loss.detach()))
        for g, healed in members.items():
            if healed:  # takes the first live group's weights and inner optimizer
                local[g].load_state_dict(local[live[0]].state_dict())
                inner[g].load_state_dict(copy.deepcopy(inner[live[0]].state_dict()))
        with torch.no_grad():
            for name, param in base.named_parameters():
                pseudo = [param - dict(local[g].named_parameters())[name]
                          for g in members]
                param.grad = torch.stack(pseudo).mean(0)
        outer_opt.step()
        outer_opt.zero_grad()
        for g in members:
            with torch.no_grad():
                for mine, new in zip(local[g].parameters(), base.parameters(), strict=True):
                    mine.copy_(new)
    return losses, {clean_name(n): p.detach().clone() for n, p in base.named_parameters()}


def apply_without_lighthouse(address: str, timeout: float) -> tuple[float, str]:
    """Apply a fault-tolerant plan whose lighthouse does not answer: (seconds until apply
    failed, what it raised)."""
    import torch
    from composer_par.plugins.ft import LighthouseUnreachable

    from composer_par import ParallelPlan

    plan = ParallelPlan.from_toml(plan_text("fsdp2", address, timeout=timeout))
    with torch.device("meta"):
        model = TASK.build()
    started = time.monotonic()
    try:
        plan.apply(model)
    except LighthouseUnreachable as exc:
        return time.monotonic() - started, f"{type(exc).__name__}: {exc}"
    raise AssertionError("apply did not fail without a lighthouse")


def train_until_it_fails(plan_toml: str, rundir: str, group: str) -> None:
    """Train until a step raises; write what it raised, and how long after the last
    step that applied, to ``<group>-rank<r>-error.json``."""
    import torch
    import torch.distributed as dist
    from composer_par.plugins.ft import replica_group_of

    from composer_par import ParallelPlan

    run, rank = Path(rundir), dist.get_rank()
    plan = ParallelPlan.from_toml(plan_toml)
    with torch.device("meta"):
        model = TASK.build()
    model = plan.apply(model)
    index, count = plan.data_shard()
    step = plan.training_step(model, lambda out, batch: _loss(out, batch))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    replicas = replica_group_of(model)
    assert replicas is not None
    # The ranks start together: the short timeout is for the lighthouse, not for a rank
    # that is slower to apply on a loaded machine.
    dist.barrier()
    last = time.monotonic()
    try:
        while True:
            step.begin()
            batch = TASK.batch(replicas.step).chunk(count)[index]
            step.step(batch, batch)
            if step.optimizer_step(optimizer):
                last = time.monotonic()
                _touch(run / f"{group}-rank{rank}-at{replicas.step}")
    except Exception as exc:
        (run / f"{group}-rank{rank}-error.json").write_text(json.dumps({
            "error": f"{type(exc).__name__}: {exc}", "after": time.monotonic() - last,
            "steps": replicas.step}))
