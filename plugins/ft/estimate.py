"""What fault-tolerant replica groups cost per step, for ``composer-par estimate``: the
same logical payload bytes :class:`~composer_par.testing.comm_count.CommCounter` counts.
Pure arithmetic: no torch.

* ``ddp``: the gradient all-reduce across groups is the replicate dim's, which the
  built-in estimate of HSDP's dim already counts (torchft runs the same all-reduce over
  its own process group); the quorum adds no bulk bytes, only latency: before each
  forward, one round trip from each group's manager to the lighthouse (all groups wait
  for each other there), and before the optimizer step one vote among the group's ranks.
* ``local_sgd`` / ``diloco``: no gradient crosses groups; every ``sync_every`` steps each
  rank all-reduces its shard of the parameters (LocalSGD) or of the pseudo-gradients
  (DiLoCo: the weights at the last sync less the current ones), one all-reduce per
  parameter, in the parameters' dtype, after one quorum. Stated here per step (the sync's
  bytes over ``sync_every``); the gradient all-reduce the replicate dim's owner states
  is not run (the plugin's comm hook answers ``composer_par_estimate_comm_hook`` with
  nothing in its place).
"""

from __future__ import annotations

from typing import Any

from composer_par.plugin import Collective, EstimatePart

# The bytes of one parameter element as torchft averages it (the parameters' dtype:
# full-precision master weights under mixed precision).
PARAM_BYTES = 4


def replica_estimate(dim: str, *, groups: int, method: str, sync_every: int,
                     local_params: int, tensors: int, host_memory: bool = True
                     ) -> EstimatePart:
    """The plugin's :class:`EstimatePart` over ``dim`` (``groups`` replica groups): each
    rank holds ``local_params`` elements of ``tensors`` parameter tensors."""
    quorum = ("quorum: before each forward a round trip to the lighthouse, where the "
              "groups wait for each other, and before the optimizer step a vote among the "
              "group's ranks (latency, no bulk bytes)")
    if method == "ddp":
        return EstimatePart(notes=(f"{quorum}; the gradient all-reduce over {dim} is "
                                   "torchft's, counted as the replicate dim's",))
    if groups < 2:
        return EstimatePart(notes=(f"{method}: one replica group, nothing to average",))
    what = "parameters" if method == "local_sgd" else "pseudo-gradients"
    payload = local_params * PARAM_BYTES // sync_every
    calls = max(1, tensors // sync_every)
    collective = Collective(dim, "all_reduce", payload, calls,
                            f"{method}: this rank's shard of the {what}, one all-reduce per "
                            f"parameter every {sync_every} step(s) (per step: 1/{sync_every})")
    memory = {}
    notes = [f"{method}: a quorum every {sync_every} step(s), not every step"]
    if method == "diloco":
        # The outer optimizer's momentum lives beside the parameters; the weights at the
        # last sync are kept in host memory (torchft's backup device, the CPU).
        memory["diloco outer momentum"] = local_params * PARAM_BYTES
        if host_memory:
            notes.append(f"diloco: the weights at the last sync in host memory "
                         f"({local_params * PARAM_BYTES} bytes per rank)")
    return EstimatePart(collectives=(collective,), memory=memory, notes=tuple(notes))


def in_place_of(method: str, collective: Collective) -> tuple[Collective, ...] | None:
    """What runs in place of ``collective``, a gradient all-reduce over the replica dim
    that the plugin's comm hook takes over: torchft's all-reduce of the same bytes under
    ``ddp`` (None: it stays as stated); under ``local_sgd`` / ``diloco`` nothing, the
    periodic sync being the plugin's own term (:func:`replica_estimate`)."""
    if method == "ddp" or collective.kind != "all_reduce":
        return None
    return ()


def plan_estimate(dim: str, method: str, sync_every: int, layout: Any, model: Any
                  ) -> EstimatePart:
    """:func:`replica_estimate` for a plan's ``layout`` and ``model`` shape (what the
    ``composer_par_estimate`` hook is given): the elements and tensors of parameters one
    rank holds."""
    tp, shard = layout.tensor_parallel_size(), layout.shard_size()
    # a group set apart (experts) is sharded over the shard dims without those it spans
    local = (sum(g.local_numel(tp, layout.shard_size(g.apart) if g.apart else shard)
                 * g.count for g in model.groups)
             if model.groups else -(-model.params // (tp * shard)))
    tensors = (sum(len(g.tensors) * g.count for g in model.groups) if model.groups
               else max(1, model.layers * (model.matrices_per_block or 1)))
    groups = layout.mesh.size(dim) if dim in layout.mesh else 1
    return replica_estimate(dim, groups=groups, method=method, sync_every=sync_every,
                            local_params=local, tensors=tensors)


__all__ = ["PARAM_BYTES", "in_place_of", "plan_estimate", "replica_estimate"]
