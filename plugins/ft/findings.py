"""The fault-tolerance plugin's rule codes (CP971-CP979) and the static checks behind them.

A fault-tolerant plan is launched once per replica group, each launch holding one
coordinate of the fault-tolerant dim; healing copies a live group's state to a restarted
one rank by rank, shard by shard. So every group must lay out the same ranks the same way,
and nothing but whole groups may come and go. Pure logic: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from composer_par.plugin import Declaration, Finding, MeshSpec, Role, Rule, Severity

NOT_OUTERMOST = Rule(
    "CP971", Severity.ERROR, "the fault-tolerant dim is not the outermost mesh dim",
    "list the fault-tolerant dim first in [mesh] (MeshSpec(dp_replicate=..., ...)): each "
    "replica group is one launch, a contiguous block of the job's ranks",
    '[mesh]\ndp_shard = 2\ndp_replicate = 2\n\n[[plugins]]\nname = "hsdp"\n\n'
    '[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\nname = "ft"\n')
NO_REPLICATOR = Rule(
    "CP972", Severity.ERROR, "no data-parallel plugin replicates over the fault-tolerant dim",
    "add HSDP over the fault-tolerant dim (with FSDP2 for sharding inside each group): its "
    "gradient all-reduce across groups is what the plugin routes through torchft",
    '[mesh]\ndp_replicate = 2\ndp_shard = 2\n\n[[plugins]]\nname = "fsdp2"\n\n'
    '[[plugins]]\nname = "ft"\n')
INFERRED_SIZE = Rule(
    "CP973", Severity.ERROR, "a mesh dim of a fault-tolerant plan has an inferred size (-1)",
    "give every [mesh] size: the fault-tolerant dim's is the number of replica groups, and "
    "the others fix each group's layout, which a relaunch with fewer ranks must not shrink",
    '[mesh]\ndp_replicate = 2\ndp_shard = -1\n\n[[plugins]]\nname = "hsdp"\n\n'
    '[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\nname = "ft"\n')
TOO_FEW_GROUPS = Rule(
    "CP974", Severity.ERROR, "min_replicas is larger than the number of replica groups",
    "lower min_replicas to at most the fault-tolerant dim's size, or add replica groups",
    '[mesh]\ndp_replicate = 2\ndp_shard = 2\n\n[[plugins]]\nname = "hsdp"\n\n'
    '[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\nname = "ft"\nmin_replicas = 3\n')
GROUP_OUTSIDE = Rule(
    "CP975", Severity.ERROR, "the replica group index is outside the fault-tolerant dim",
    "give each launch a group index from 0 to the dim's size - 1 (option group, or the "
    "REPLICA_GROUP_ID environment variable)",
    '[mesh]\ndp_replicate = 2\ndp_shard = 2\n\n[[plugins]]\nname = "hsdp"\n\n'
    '[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\nname = "ft"\ngroup = 2\n')
SYNC_EVERY = Rule(
    "CP976", Severity.ERROR, "sync_every does not fit the method",
    'method = "ddp" all-reduces gradients every step (sync_every = 1); for a sync every N '
    'steps use method = "diloco" or "local_sgd"',
    '[mesh]\ndp_replicate = 2\ndp_shard = 2\n\n[[plugins]]\nname = "hsdp"\n\n'
    '[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\nname = "ft"\nmethod = "ddp"\nsync_every = 8\n')
ONE_GROUP = Rule(
    "CP977", Severity.WARNING, "the fault-tolerant dim has size 1: one replica group",
    "run two or more replica groups (the dim's size), or drop the ft plugin: with one group "
    "nothing survives its death, and each step still waits for a quorum",
    '[mesh]\ndp_replicate = 1\ndp_shard = 2\n\n[[plugins]]\nname = "hsdp"\n\n'
    '[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\nname = "ft"\n')

CATALOG: tuple[Rule, ...] = (NOT_OUTERMOST, NO_REPLICATOR, INFERRED_SIZE, TOO_FEW_GROUPS,
                             GROUP_OUTSIDE, SYNC_EVERY, ONE_GROUP)


def plan_findings(dim: str, mesh: MeshSpec, decls: Sequence[Declaration], *,
                  min_replicas: int, group: int | None, method: str,
                  sync_every: int) -> list[Finding]:
    """Every static finding about a fault-tolerant plan over ``dim``."""
    found: list[Finding] = []
    if dim not in mesh:
        return found  # CP203 (the claim on a dim the mesh lacks) says it
    names = mesh.names
    if names[0] != dim:
        order = [dim, *(n for n in names if n != dim)]
        found.append(Finding(
            NOT_OUTERMOST.code,
            f"fault-tolerant dim {dim!r} is not the outermost mesh dim (the mesh lists "
            f"{', '.join(names)}): a replica group is one launch, which must hold a "
            "contiguous block of the job's ranks",
            fix="list it first: " + ", ".join(f"{n} = {mesh.size(n)}" for n in order)))
    owners = [(d.plugin, c.role) for d in decls for c in d.claims if c.dim == dim]
    if not any(role is Role.REPLICATE for _, role in owners):
        why = (f"{owners[0][0]} claims it for {owners[0][1].value}" if owners
               else "no plugin claims it")
        found.append(Finding(
            NO_REPLICATOR.code,
            f"the fault-tolerant dim {dim!r} has no data-parallel plugin replicating over it "
            f"({why}): there is no gradient all-reduce across replica groups to route "
            "through torchft",
            fix=f"add HSDP with dim = {dim!r} (and FSDP2 to shard inside each group)"))
    inferred = [n for n, size in mesh.dims if size == -1]
    if inferred:
        found.append(Finding(
            INFERRED_SIZE.code,
            f"mesh dim {inferred[0]!r} has an inferred size (-1) in a fault-tolerant plan: "
            + (f"{dim}'s size is the number of replica groups, which no launch can infer"
               if inferred[0] == dim else
               "each replica group would size it from its own launch, so a group relaunched "
               "with fewer ranks would shrink it and no longer match its peers' shards"),
            fix=INFERRED_SIZE.fix))
        return found
    groups = mesh.size(dim)
    if min_replicas > groups:
        found.append(Finding(
            TOO_FEW_GROUPS.code,
            f"min_replicas = {min_replicas}, but {dim}({groups}) makes only {groups} "
            "replica group(s): no step could ever commit",
            fix=f"set min_replicas to at most {groups}, or grow {dim}"))
    if group is not None and not 0 <= group < groups:
        found.append(Finding(
            GROUP_OUTSIDE.code,
            f"replica group {group} is outside {dim}({groups}): groups are 0 to {groups - 1}",
            fix=GROUP_OUTSIDE.fix))
    if groups == 1:
        found.append(Finding(
            ONE_GROUP.code,
            f"{dim}(1): one replica group, so nothing survives its death, while each step "
            "still forms a quorum with the lighthouse",
            fix=ONE_GROUP.fix))
    if method == "ddp" and sync_every != 1:
        found.append(Finding(
            SYNC_EVERY.code,
            f'method = "ddp" all-reduces gradients every step; sync_every = {sync_every} '
            "would be ignored",
            fix=SYNC_EVERY.fix))
    return found


__all__ = ["CATALOG", "plan_findings"]
