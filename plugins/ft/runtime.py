"""This launch's replica group at run time: torchft's Manager and the step protocol.

One :class:`ReplicaGroup` per process, made when the data-parallel plugin installs the
plugin's all-reduce hook (``apply``). Each step of ``plan.training_step``:

1. :meth:`ReplicaGroup.begin` (before the first forward): torchft forms the step's
   quorum with the lighthouse (``ddp``), synchronously, so that a group that is behind
   -- restarted after a death, or joining late -- takes a live group's model and
   optimizer state through torchft's checkpoint transport before it computes anything,
   and then trains in this very step like the others;
2. :meth:`ReplicaGroup.reduce` (the comm hook, once per FSDP module in backward):
   torchft's managed all-reduce over the groups in the quorum, averaged over them (their
   number changes as groups die and return);
3. :meth:`ReplicaGroup.commit` (before the optimizer step): torchft's ``should_commit``,
   a vote of the group's ranks: False if a collective failed (a group died mid-step) or
   the quorum is smaller than ``min_replicas``; the step is then discarded on every rank
   of the group, and the next forms a new quorum without the dead group.

With ``local_sgd`` or ``diloco`` the gradients stay inside each group and every step
commits; torchft's ``LocalSGD`` / ``DiLoCo`` (made at the first commit, when the
optimizer is known) form the quorum and average every ``sync_every`` steps, in the
optimizer step's hooks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs

from .lighthouse import lighthouse_address, wait_for_lighthouse
from .state import (
    ReplicaLayoutError,
    check_layout,
    layout,
    load_model_state,
    load_optimizer_state,
    local_state_optimizer,
    model_state,
    optimizer_state,
)

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.plugin import GradBucket

# torchft's examples' variable for a launch's replica group index.
GROUP_ENV = "REPLICA_GROUP_ID"
ATTRIBUTE = "_composer_par_replica_group"


class FaultToleranceError(RuntimeError):
    """The fault-tolerant step protocol was not followed, or torchft could not start."""


@attrs.frozen
class ReplicaSettings:
    """What one launch's :class:`ReplicaGroup` is made from (the plugin's options and
    what the launch says)."""

    dim: str
    index: int
    groups: int
    lighthouse: str
    min_replicas: int
    method: str
    sync_every: int
    outer_lr: float
    outer_momentum: float
    outer_nesterov: bool
    init_sync: bool
    timeout: timedelta
    store: str | None = None
    hostname: str | None = None
    # One launch's mesh, (dim, size) outermost first: part of what a heal compares.
    mesh: tuple[tuple[str, int], ...] = ()


@attrs.define
class StepRecord:
    """What the last step's quorum decided for this group."""

    # ddp: the step (torchft's committed steps when it began, after any heal);
    # local_sgd / diloco: the sync (how many committed before it)
    step: int
    participants: int  # replica groups whose gradients the step averages
    participating: bool  # whether this group's gradients count
    healed: bool  # whether this group took a live group's state before the step
    committed: bool | None = None  # None until the optimizer step


def group_index(option: int | None) -> int:
    """This launch's replica group: the option, else ``$REPLICA_GROUP_ID``."""
    if option is not None:
        return option
    value = os.environ.get(GROUP_ENV)
    if value is None or not value.strip().isdigit():
        got = "unset" if value is None else repr(value)
        raise FaultToleranceError(
            "the ft plugin needs this launch's replica group index: set its group option or "
            f"${GROUP_ENV} (0 to the fault-tolerant dim's size - 1); ${GROUP_ENV} is {got}")
    return int(value)


def _store(option: str | None) -> tuple[str, int]:
    """(host, port) of this launch's TCPStore: the option, else torchrun's MASTER_ADDR and
    MASTER_PORT."""
    text = option or (f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                      if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
                      else None)
    if text is None:
        raise FaultToleranceError(
            "the ft plugin needs this launch's TCPStore, where torchft's manager meets the "
            "group's ranks: run under torchrun (MASTER_ADDR and MASTER_PORT) or set the ft "
            'plugin\'s store option ("host:port")')
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise FaultToleranceError(f"store {text!r} is not host:port")
    return host.strip("[]"), int(port)


class ReplicaGroup:
    """This process's part of its replica group (see the module)."""

    def __init__(self, settings: ReplicaSettings, device: torch.device) -> None:
        import torch.distributed as dist
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        from .transport import weights_only_transport

        self.settings = settings
        # Fail here, naming the address, rather than in torchft's first quorum.
        wait_for_lighthouse(settings.lighthouse, settings.timeout.total_seconds())
        host, port = _store(settings.store)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        pg = (ProcessGroupNCCL(timeout=settings.timeout) if device.type == "cuda"
              else ProcessGroupGloo(timeout=settings.timeout))
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.tracked: dict[str, Any] = {}
        self.last: StepRecord | None = None
        self._open = False  # a step began and has not committed
        self._healed = False
        self._semi_sync: Any = None
        self._local = 0  # local_sgd / diloco: optimizer steps since the last sync
        # Optimizer states a heal brought for optimizers this group has not stepped yet.
        self._pending_optimizers: list[Any] = []
        options: dict[str, Any] = {}
        if settings.hostname is not None:
            options["hostname"] = settings.hostname
        self.manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._state,
            min_replica_size=settings.min_replicas,
            # Synchronous quorum: a healing group takes its peer's state before its forward
            # and counts in that step (torchft's asynchronous quorum would leave it out of
            # the step while, at step 0, still counting it in the average).
            use_async_quorum=False,
            timeout=settings.timeout, quorum_timeout=settings.timeout,
            connect_timeout=settings.timeout, rank=rank, world_size=world,
            store_addr=host, store_port=port, lighthouse_addr=settings.lighthouse,
            replica_id=f"{settings.dim}_{settings.index}",
            checkpoint_transport=weights_only_transport(settings.timeout),
            init_sync=settings.init_sync, **options)

    # -- what the plan attaches -----------------------------------------------------------

    def add_model(self, model: nn.Module) -> None:
        """A model (or pipeline part) whose tensors a healing group takes."""
        if all(m is not model for m in self.models):
            self.models.append(model)
        setattr(model, ATTRIBUTE, self)

    def track(self, name: str, stateful: Any) -> None:
        """Send ``stateful``'s ``state_dict()`` (a learning-rate scheduler, a data
        position) to healing groups and load theirs into it; plain values only. Track the
        same names in every group, before the first step."""
        if not (callable(getattr(stateful, "state_dict", None))
                and callable(getattr(stateful, "load_state_dict", None))):
            raise TypeError(f"{name}: {type(stateful).__name__} has no state_dict and "
                            "load_state_dict")
        self.tracked[name] = stateful

    # -- the step protocol ----------------------------------------------------------------

    def begin(self) -> None:
        """Before a step's first forward: the quorum, and a heal if this group is behind."""
        if self._open:
            raise FaultToleranceError(
                "a training step began before the last one committed: step the optimizer "
                "through step.optimizer_step(optimizer) (plan.training_step), which applies "
                "or discards each step as the replica groups' quorum decides")
        self._open = True
        if self.settings.method != "ddp":
            return
        self._healed = False
        try:
            self.manager.start_quorum()
        except Exception as exc:
            self._open = False
            settings = self.settings
            raise FaultToleranceError(
                f"replica group {settings.index}: no quorum formed within "
                f"{settings.timeout.total_seconds():g} s (the ft plugin's timeout): the "
                f"lighthouse at {settings.lighthouse} did not answer (is it running?), or "
                "the quorum waited for ranks or replica groups that neither joined nor died; "
                "torchft said: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc
        self.last = StepRecord(self.manager.current_step(), self.manager.num_participants(),
                               self.manager.is_participating(), self._healed)

    def reduce(self, bucket: GradBucket) -> None:
        """The comm hook on the fault-tolerant dim: the average over the groups of the
        quorum (``ddp``); nothing with ``local_sgd`` / ``diloco`` (they average every
        ``sync_every`` steps)."""
        if self.settings.method != "ddp":
            return
        if not self._open:
            raise FaultToleranceError(
                "gradients reached the fault-tolerant all-reduce outside a training step: "
                "run each step through plan.training_step(...).step(...), which forms the "
                "replica groups' quorum first")
        # torchft divides the group sum by the groups taking part: the static divisor of
        # the bucket (one replica per launch) does not apply. A failure is recorded by the
        # manager, and the vote in commit() discards the step.
        self.manager.allreduce(bucket.buffer).wait()

    def commit(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` may apply this step (torchft's vote within the group)."""
        if not self._open:
            raise FaultToleranceError(
                "optimizer_step without a training step: call step.step(...) first")
        self._open = False
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
            if self._pending_optimizers:  # healed before this optimizer's first step
                load_optimizer_state(optimizer, self._pending_optimizers.pop(0))
        if self.settings.method != "ddp":
            self._start_semi_sync(optimizer)
            return True
        committed = bool(self.manager.should_commit())
        if self.last is not None:
            self.last.committed = committed
        return committed

    @property
    def step(self) -> int:
        """The index of the next step's batch, the same in every group: the steps
        committed so far (``ddp``; a healed group takes its peers' count), or the syncs
        committed times ``sync_every`` plus the local steps since the last sync
        (``local_sgd`` / ``diloco``). Read it after ``step.begin()``: a heal moves it."""
        synced = int(self.manager.current_step())
        if self.settings.method == "ddp":
            return synced
        return synced * self.settings.sync_every + self._local

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """torchft's step counters, to save beside the model in a checkpoint."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume torchft's step counters from a checkpoint (every group loads the same)."""
        self.manager.load_state_dict(dict(state))

    def shutdown(self) -> None:
        """Stop torchft's manager server and checkpoint transport."""
        self.manager.shutdown(wait=False)

    # -- what a healing group takes -------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        import torch

        with torch.no_grad():
            return {"layout": layout(self.settings.mesh, self.models),
                    "models": model_state(self.models),
                    "optimizers": [optimizer_state(o) for o in self.optimizers],
                    "tracked": {k: v.state_dict() for k, v in self.tracked.items()}}

    def _load(self, sent: Mapping[str, Any]) -> None:
        check_layout(sent.get("layout"), layout(self.settings.mesh, self.models))
        load_model_state(self.models, sent["models"])
        optimizers = list(sent["optimizers"])
        # A live group that has not stepped yet sends no optimizer: nothing to take. A
        # group that heals before its first step knows no optimizer yet: each takes its
        # state when first stepped (commit), before it steps.
        if len(self.optimizers) > len(optimizers) and optimizers:
            raise ReplicaLayoutError(
                f"the live group sent {len(optimizers)} optimizer state(s); this group steps "
                f"{len(self.optimizers)}: every group must step the same optimizers through "
                "step.optimizer_step(...)")
        for optimizer, state in zip(self.optimizers, optimizers, strict=False):
            load_optimizer_state(optimizer, state)
        self._pending_optimizers = optimizers[len(self.optimizers):]
        missing = sorted(set(self.tracked) ^ set(sent["tracked"]))
        if missing:
            raise ReplicaLayoutError(f"tracked state {missing[0]!r} is tracked in one group "
                                     "and not the other: track the same names in every group")
        for name, stateful in self.tracked.items():
            stateful.load_state_dict(sent["tracked"][name])
        self._healed = True

    # -- local SGD and DiLoCo -------------------------------------------------------------

    def _start_semi_sync(self, optimizer: torch.optim.Optimizer) -> None:
        if self._semi_sync is not None:
            if self._semi_sync[1] is not optimizer:
                raise FaultToleranceError(
                    f"{self.settings.method} averages the parameters of one optimizer; "
                    "step the same optimizer every step")
            return
        import torch
        from torchft.local_sgd import DiLoCo, LocalSGD

        model: nn.Module = (self.models[0] if len(self.models) == 1
                            else torch.nn.ModuleList(self.models))
        settings = self.settings
        if settings.method == "local_sgd":
            algorithm: Any = LocalSGD(self.manager, model, optimizer, settings.sync_every)
        else:
            outer_cls = local_state_optimizer(torch.optim.SGD)
            outer = outer_cls(model.parameters(), lr=settings.outer_lr,
                              momentum=settings.outer_momentum,
                              nesterov=settings.outer_nesterov and settings.outer_momentum > 0)
            algorithm = DiLoCo(self.manager, [model], optimizer, outer,
                               sync_every=settings.sync_every, pin_memory=False)
        algorithm.__enter__()  # its hooks on the optimizer's step sync every sync_every
        self._semi_sync = (algorithm, optimizer)
        self._seen_step = self.manager.current_step()
        # After the algorithm's own hook (hooks run in the order they were registered).
        optimizer.register_step_post_hook(self._after_semi_sync_step)

    def _after_semi_sync_step(self, *_: Any) -> None:
        """Count the local steps; after a sync (every ``sync_every``-th, as the algorithm
        counts), record it in :attr:`last`. A sync that did not commit took the weights
        back to the last one: its local steps are trained again."""
        self._local += 1
        if self._local < self.settings.sync_every:
            return
        self._local = 0
        step = self.manager.current_step()
        committed = step != self._seen_step
        # The sync's index: the one that committed, or the one tried (a heal moves it).
        self.last = StepRecord(step - 1 if committed else step,
                               self.manager.num_participants(),
                               self.manager.is_participating(), self._healed,
                               committed=committed)
        self._seen_step, self._healed = step, False


def replica_group_of(model: nn.Module) -> ReplicaGroup | None:
    """The :class:`ReplicaGroup` a fault-tolerant plan attached to ``model`` (or to one of
    its modules: a pipeline part), else None."""
    found = getattr(model, ATTRIBUTE, None)
    if found is not None:
        return found  # type: ignore[no-any-return]
    return next((getattr(m, ATTRIBUTE) for m in model.modules() if hasattr(m, ATTRIBUTE)),
                None)


__all__ = ["ATTRIBUTE", "GROUP_ENV", "FaultToleranceError", "ReplicaGroup",
           "ReplicaSettings", "StepRecord", "group_index", "lighthouse_address",
           "replica_group_of"]
