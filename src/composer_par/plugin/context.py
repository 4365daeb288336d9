"""What stage hooks receive: the model, the mesh, the shared blocks, and helpers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.blocks import Block
from composer_par.mesh import MeshError, MeshSpec

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from composer_par.plugin.base import FoldedDim, ShardApart
    from composer_par.plugin.caller import HookCaller
    from composer_par.plugin.comm import CommHook, InstalledCommHook
    from composer_par.plugin.pipeline import Pipeline
    from composer_par.plugin.view import PlanView


@attrs.define(eq=False)
class AppliedStep:
    stage: str
    plugin: str
    detail: str


@attrs.define(eq=False)
class ApplyContext:
    """The state one ``ParallelPlan.apply`` call threads through the stages."""

    plan: PlanView  # what hooks may read of the plan
    mesh: MeshSpec  # resolved against the world size
    device_mesh: DeviceMesh | None  # None on a single process without a process group
    device: torch.device
    model: nn.Module
    blocks: list[Block]
    hooks: HookCaller  # the plan's one hook caller
    applied: list[AppliedStep] = attrs.Factory(list)
    # Where parameters are materialized when a data-parallel plugin keeps them off
    # ``device`` (FSDP2's CPU offload: torch's fully_shard wants them on the host); None:
    # on ``device``. Set before the materialize stage, read by whoever materializes.
    parameter_device: torch.device | None = None
    # Every module a data-parallel plugin made an FSDP module (``fully_shard`` or torch's
    # ``replicate``), each block before the root. Whoever shards or replicates appends
    # here (built-in or not); finalize-stage plugins read it to call FSDPModule setters
    # (divide factors, prefetch, comm hooks) on every FSDP module, whoever made it.
    data_parallel_modules: list[nn.Module] = attrs.Factory(list)
    # Each comm hook a data-parallel plugin installed (the plan checks none was ignored).
    installed_comm_hooks: list[InstalledCommHook] = attrs.Factory(list)
    # A plugin's own results for the user, by the plugin's choice of key (e.g. TP's
    # resolved plan): ``plan.notes`` after apply. Not a channel between plugins.
    notes: dict[str, Any] = attrs.Factory(dict)
    # The pipeline stages this rank holds, set in the pipeline_split stage. The stages
    # after it run once per local part, each with its own context whose ``model`` and
    # ``blocks`` are that part's (the other fields are shared); None without a pipeline.
    pipeline: Pipeline | None = None

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def submesh(self, *names: str) -> DeviceMesh:
        """The DeviceMesh over ``names`` (outermost first), with a clear error if absent."""
        if self.device_mesh is None:
            raise MeshError(
                f"mesh dims {list(names)} need a DeviceMesh, and none was built: run under "
                "torchrun or initialize a process group before apply()"
            )
        missing = [n for n in names if n not in self.mesh]
        if missing:
            raise MeshError(f"no mesh dim {missing[0]!r}; the mesh has {list(self.mesh.names)}")
        if names == self.mesh.names:  # the whole mesh: no slicing, no new mesh object
            return self.device_mesh
        return self.device_mesh[names if len(names) > 1 else names[0]]

    def data_parallel_mesh(self, replicate: Sequence[str], shard: Sequence[str]) -> DeviceMesh:
        """The DeviceMesh a data-parallel plugin works over: the ``replicate`` dims outer,
        then the ``shard`` dims flattened into one mesh dim (torchtitan's ``dp_shard_cp``),
        so that FSDP2 sees at most (replicate, shard). With one shard dim it is
        :meth:`submesh`."""
        if len(shard) <= 1:
            return self.submesh(*replicate, *shard)
        from composer_par.plugin import torch_private

        flat = torch_private.flatten_mesh(self.submesh(*shard), "_".join(shard))
        if not replicate:
            return flat
        # Slicing a flattened dim out of the root mesh is deprecated (torch warns): the
        # flattened mesh is joined to the replicate dims' instead.
        return torch_private.concatenate_meshes([self.submesh(*replicate), flat])

    def replicate_dims(self) -> list[str]:
        """The mesh dims data-parallel plugins should replicate over (composition hook)."""
        return self.hooks.replicate_dims()

    def folded_dims(self) -> list[FoldedDim]:
        """The model-parallel dims data parallelism folds in (composition hook), in mesh
        order."""
        folded = {f.dim: f for f in self.hooks.folded_dims()}
        return [folded[n] for n in self.mesh.names if n in folded]

    def shard_apart(self) -> list[ShardApart]:
        """The modules plugins ask data parallelism to shard apart (composition hook)."""
        return self.hooks.shard_apart(self.model)

    def comm_hooks(self) -> dict[str, CommHook]:
        """The comm hooks plugins give, by mesh dim (validation allows one per dim)."""
        return {hook.dim: hook for hook in self.hooks.comm_hooks()}

    def replace_block(self, index: int, new: nn.Module) -> None:
        """Swap block ``index`` for ``new`` (e.g. a checkpoint wrapper) in the model too."""
        path, old = self.blocks[index]
        parent_path, _, attr = path.rpartition(".")
        parent = self.model.get_submodule(parent_path) if parent_path else self.model
        if parent.get_submodule(attr) is not old:
            raise RuntimeError(f"block {path!r} is no longer where the block finder found it")
        parent.register_module(attr, new)
        self.blocks[index] = (path, new)
