"""The core validation rules: static ones (no torch) and model-aware ones.

Each function takes what it needs and returns findings; :mod:`composer_par.plan`
collects them all. The core's codes are :data:`composer_par.findings.CORE_RULES`; each
plugin lists its own in its class attribute ``rules``. :func:`catalogs` gathers them all
(``composer-par rules``, docs/rules.md) and :func:`rule_conflicts` finds a code two
catalogs give different meanings, which validation reports as CP222. :func:`code_ranges`
gathers the ranges of codes the core and each plugin keep (:class:`CodeRange`), and
:func:`range_problems` says where ranges overlap or a code lies outside its catalog's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from composer_par.findings import (
    CORE_CODE_RANGES,
    CORE_RULES,
    CodeRange,
    Finding,
    Rule,
    did_you_mean,
)
from composer_par.mesh import INFER, MeshSpec
from composer_par.plugin.base import Declaration, Role
from composer_par.plugin.comm import RUNS, CommHook
from composer_par.topology import Topology

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.blocks import Block, BlockSpec
    from composer_par.plugin.base import Plugin
    from composer_par.plugin.registry import Registry

CORE = "core"


# -- the catalogs ----------------------------------------------------------------------------


def _installed(registry: Registry | None) -> list[tuple[str, type[Plugin]]]:
    """``(source, class)`` of every installed plugin that loads, source named
    ``"<plugin> (<distribution>)"``."""
    from composer_par.plugin.registry import Registry, RegistryError

    registry = registry if registry is not None else Registry()
    out = []
    for name in registry.names():
        try:
            cls = registry.get(name)
        except RegistryError:
            continue
        out.append((f"{name} ({registry.info(name).distribution})", cls))
    return out


def catalogs(registry: Registry | None = None) -> list[tuple[str, Rule]]:
    """``(source, rule)`` for every rule code of the core and of every installed plugin:
    source is ``"core"`` or ``"<plugin> (<distribution>)"``. A plugin that fails to load
    is left out (``composer-par plugins`` reports it). Loads no torch."""
    out: list[tuple[str, Rule]] = [(CORE, rule) for rule in CORE_RULES.values()]
    for source, cls in _installed(registry):
        out.extend((source, rule) for rule in cls.rules)
    return out


def code_ranges(registry: Registry | None = None) -> list[tuple[str, CodeRange]]:
    """``(source, range)`` for every range of rule codes the core and each installed
    plugin declare (:data:`~composer_par.findings.CORE_CODE_RANGES`, a plugin's
    ``code_ranges``), sources named as :func:`catalogs` names them. Loads no torch."""
    out: list[tuple[str, CodeRange]] = [(CORE, r) for r in CORE_CODE_RANGES]
    for source, cls in _installed(registry):
        out.extend((source, r) for r in cls.code_ranges)
    return out


def range_problems(entries: Sequence[tuple[str, Rule]],
                   ranges: Sequence[tuple[str, CodeRange]]) -> list[str]:
    """What breaks the ranges, one line each: two ranges that overlap, and a code
    (``entries``: :func:`catalogs`) outside every range its source may use, its own
    and the shared ones (``ranges``: :func:`code_ranges`)."""
    problems = [f"{a} ({source_a}) overlaps {b} ({source_b})"
                for i, (source_a, a) in enumerate(ranges)
                for source_b, b in ranges[i + 1:] if a.overlaps(b)]
    shared = [r for _, r in ranges if r.shared]
    own: dict[str, list[CodeRange]] = defaultdict(list)
    for source, r in ranges:
        own[source].append(r)
    for source, rule in entries:
        allowed = [*own.get(source, ()), *shared]
        if not any(rule.code in r for r in allowed):
            mine = ", ".join(str(r) for r in own.get(source, ())) or "none"
            problems.append(f"{rule.code} ({source}) lies outside its own ranges ({mine}) "
                            "and the shared ones")
    return problems


def rule_conflicts(entries: Sequence[tuple[str, Rule]]) -> dict[str, list[tuple[str, Rule]]]:
    """The codes two sources give different meanings (severity or title), each with every
    ``(source, rule)`` that defines it, in the order given."""
    by_code: dict[str, list[tuple[str, Rule]]] = defaultdict(list)
    for source, rule in entries:
        by_code[rule.code].append((source, rule))
    return {code: defined for code, defined in sorted(by_code.items())
            if any(not rule.means_the_same_as(defined[0][1]) for _, rule in defined[1:])}


def listing(entries: Sequence[tuple[str, Rule]]) -> list[tuple[Rule, list[str]]]:
    """One row per code and meaning, sorted by code, with every source that defines it
    that way (a shared rule, e.g. CP411 of ActivationCheckpoint and Compile, is one row)."""
    rows: dict[tuple[str, str, str], tuple[Rule, list[str]]] = {}
    for source, rule in entries:
        key = (rule.code, rule.severity.value, rule.title)
        if key not in rows:
            rows[key] = (rule, [])
        if source not in rows[key][1]:
            rows[key][1].append(source)
    return [rows[key] for key in sorted(rows)]


def sources_text(sources: Sequence[str]) -> str:
    """Sources as one column: ``"load_checkpoint, load_safetensors (composer-par)"``."""
    by_dist: dict[str, list[str]] = {}
    for source in sources:
        name, _, dist = source.partition(" (")
        by_dist.setdefault(f" ({dist}" if dist else "", []).append(name)
    return "; ".join(", ".join(names) + dist for dist, names in by_dist.items())


def _conflict_findings(decls: Sequence[Declaration]) -> list[Finding]:
    """CP222: the plan's plugins (or a plugin and the core) give one code two meanings."""
    entries: list[tuple[str, Rule]] = []
    for decl in decls:
        entries.extend((decl.plugin, rule) for rule in decl.rules)
    codes = {rule.code for _, rule in entries}
    entries = [(CORE, CORE_RULES[c]) for c in sorted(codes) if c in CORE_RULES] + entries
    found = []
    for code, defined in rule_conflicts(entries).items():
        meanings = "; ".join(f"{source}: {rule.severity.value} {rule.title!r}"
                             for source, rule in defined)
        redefines_core = defined[0][0] == CORE
        found.append(Finding(
            "CP222",
            f"rule code {code} means different things ({meanings}): its findings cannot be "
            "told apart by code" + (", and the core's meaning wins" if redefines_core else ""),
            fix=("a plugin must not redefine a core code: its authors should give it a code "
                 "of their own prefix" if redefines_core else
                 "read each such finding with the plugin it names; the plugins' authors "
                 "should give their codes distinct prefixes"),
            plugin=next(source for source, _ in defined[1:] if source != CORE),
        ))
    return found


def mesh_rules(mesh: MeshSpec, world_size: int | None, topology: Topology | None,
               spanning: Sequence[str] = ()) -> list[Finding]:
    """CP101 and CP102 for one launch's ``mesh`` (``spanning``: the dims whose coordinates
    are separate launches, at size 1 in it)."""
    found: list[Finding] = []
    if world_size is not None:
        problem = mesh.check_world_size(world_size)
        if problem and spanning:
            problem += (f" ({', '.join(spanning)} {'spans' if len(spanning) == 1 else 'span'} "
                        "separate launches: one launch holds the ranks of one coordinate)")
        if problem:
            found.append(
                Finding(
                    "CP101",
                    problem,
                    fix="change the [mesh] sizes so their product equals the world size, "
                    "or set one size to -1 to infer it",
                )
            )
    if topology is not None and world_size is not None and topology.world_size != world_size:
        found.append(
            Finding(
                "CP102",
                f"topology {topology.describe()} but the world size is {world_size}",
                fix="make nodes * devices_per_node equal the number of ranks",
            )
        )
    return found


def claim_rules(mesh: MeshSpec, decls: Sequence[Declaration]) -> list[Finding]:
    found: list[Finding] = []
    owners: dict[str, list[str]] = defaultdict(list)
    for decl in decls:
        for claim in decl.claims:
            if claim.dim not in mesh:
                found.append(
                    Finding(
                        "CP203",
                        f"claims mesh dim {claim.dim!r}, which the mesh does not have"
                        f"{did_you_mean(claim.dim, mesh.names)}; the mesh has {list(mesh.names)}",
                        fix=f"set the plugin's dim to one of {list(mesh.names)}, "
                        f"or add {claim.dim!r} to [mesh]",
                        plugin=decl.plugin,
                    )
                )
            else:
                owners[claim.dim].append(decl.plugin)
    for name, size in mesh.dims:
        who = owners.get(name, [])
        if len(set(who)) > 1:  # one plugin used twice is CP204's to report
            found.append(
                Finding(
                    "CP202",
                    f"mesh dim {name!r} is claimed by {' and '.join(who)}",
                    fix="give each plugin its own mesh dim (option `dim`), or drop one plugin",
                    plugin=who[1],
                )
            )
        if not who and (size > 1 or size == INFER):
            shown = "inferred size" if size == INFER else f"size {size}"
            found.append(
                Finding(
                    "CP201",
                    f"mesh dim {name!r} ({shown}) is owned by no plugin: its ranks would "
                    "duplicate work silently",
                    fix=f"use a plugin that claims {name!r} (e.g. FSDP2 for dp_shard, HSDP for "
                    f"dp_replicate, TP for tp), or set {name} = 1",
                )
            )
    return found


# Built-in providers of the core capabilities, named in CP206's fix.
PROVIDERS = {"data_parallel": "FSDP2 or HSDP", "materialize": "MetaInit or a loader"}


def plugin_rules(
    materializers: Sequence[str],
    decls: Sequence[Declaration],
    block_specs: Sequence[tuple[str, BlockSpec]],
) -> list[Finding]:
    found: list[Finding] = []
    names = [d.plugin for d in decls]
    for name in sorted({n for n in names if names.count(n) > 1}):
        found.append(
            Finding(
                "CP204",
                f"plugin {name!r} is used {names.count(name)} times",
                fix="use each plugin once; put all its options on one instance",
                plugin=name,
            )
        )
    provided = {cap for d in decls for cap in d.provides}
    for decl in decls:
        for need in sorted(decl.requires - provided):
            found.append(
                Finding(
                    "CP206",
                    f"requires a {need!r} plugin, and none in the plan provides it",
                    fix=f"add a plugin that provides {need!r}"
                    + (f" (e.g. {PROVIDERS[need]})" if need in PROVIDERS else ""),
                    plugin=decl.plugin,
                )
            )
        for other in (*decl.after, *decl.before):
            if other not in names:
                found.append(
                    Finding(
                        "CP209",
                        f"orders itself against {other!r}, which is not in the plan"
                        f"{did_you_mean(other, names)}",
                        fix="remove the name from after/before, or add that plugin",
                        plugin=decl.plugin,
                    )
                )
    if len(materializers) > 1:
        found.append(
            Finding(
                "CP207",
                f"{' and '.join(materializers)} both materialize the model; exactly one may "
                "(init or load, not both)",
                fix="keep one of them: MetaInit to initialize, or a loader to load weights",
                plugin=materializers[1],
            )
        )
    if len({spec for _, spec in block_specs}) > 1:
        shown = "; ".join(f"{who}: {spec.describe()}" for who, spec in block_specs)
        found.append(
            Finding(
                "CP208",
                f"plugins disagree on the blocks ({shown})",
                fix="give `blocks` on one plugin only, or the same value on each; a module "
                "to shard as a unit of its own but not to treat as a block (an embedding) "
                "goes in FSDP2's `units` instead",
                plugin=block_specs[1][0],
            )
        )
    cycle = find_cycle(decls)
    if cycle:
        found.append(
            Finding(
                "CP205",
                "after/before declarations form a cycle: " + " -> ".join(cycle),
                fix="remove one of the after/before constraints in the cycle",
                plugin=cycle[0],
            )
        )
    found += _conflict_findings(decls)
    return found


def ordering_edges(decls: Sequence[Declaration]) -> set[tuple[str, str]]:
    """(first, second) pairs: ``first`` must run before ``second`` within a stage."""
    names = {d.plugin for d in decls}
    edges: set[tuple[str, str]] = set()
    for d in decls:
        edges.update((a, d.plugin) for a in d.after if a in names)
        edges.update((d.plugin, b) for b in d.before if b in names)
    return edges


def find_cycle(decls: Sequence[Declaration]) -> list[str] | None:
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(ordering_edges(decls)):
        graph[a].append(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for d in decls:
        if d.plugin not in state:
            cycle = visit(d.plugin)
            if cycle:
                return cycle
    return None


def topology_rules(
    mesh: MeshSpec, topology: Topology | None, decls: Sequence[Declaration],
    folded: Collection[str] = (),
) -> list[Finding]:
    """Which mesh dims cross nodes; needs a resolved mesh that fits the topology.

    ``folded`` are the model-parallel dims data parallelism folds in (context and expert
    parallelism's): their collectives run per layer, not per matmul as tensor
    parallelism's, and jobs do lay them across nodes, so their own plugins weigh the
    bytes that cross (a warning) in place of CP302."""
    if topology is None or not mesh.is_resolved or mesh.world_size != topology.world_size:
        return []
    found: list[Finding] = []
    roles = {c.dim: (c.role, d.plugin) for d in decls for c in d.claims if c.dim in mesh}
    by_role: dict[Role, list[str]] = defaultdict(list)
    for dim, (role, _) in roles.items():
        if mesh.size(dim) > 1:
            by_role[role].append(dim)
    crossing = {name for name in mesh.names if topology.crosses_nodes(mesh, name)}
    for shard in by_role[Role.SHARD]:
        if shard not in crossing:
            continue
        inside = [r for r in by_role[Role.REPLICATE] if r not in crossing]
        if inside:
            found.append(_reversed_hsdp(mesh, topology, shard, inside[0], roles[shard][1]))
        else:
            found.append(
                _suggest_hsdp(mesh, topology, shard, roles[shard][1], by_role[Role.REPLICATE])
            )
    for tp in by_role[Role.MODEL_PARALLEL]:
        if tp in crossing and tp not in folded:
            found.append(
                Finding(
                    "CP302",
                    f"model-parallel mesh dim {tp}({mesh.size(tp)}) crosses nodes on "
                    f"{topology.describe()}: its per-block activation collectives would run "
                    "over the inter-node links",
                    fix=f"make {tp} the innermost mesh dim (list it last) with size <= "
                    f"devices_per_node ({topology.devices_per_node})",
                    plugin=roles[tp][1],
                )
            )
    return found


def _reversed_hsdp(
    mesh: MeshSpec, topology: Topology, shard: str, replicate: str, plugin: str
) -> Finding:
    order = list(mesh.names)
    i, j = order.index(shard), order.index(replicate)
    order[i], order[j] = order[j], order[i]
    fixed = MeshSpec.from_pairs((n, mesh.size(n)) for n in order)
    still = topology.crosses_nodes(fixed, shard) or not topology.crosses_nodes(fixed, replicate)
    spelled = ", ".join(f"{n}={fixed.size(n)}" for n in fixed.names)
    fix = f"swap the order: MeshSpec({spelled}); in a plan file list " + " then ".join(
        f"{n} = {fixed.size(n)}" for n in fixed.names
    )
    if still:
        fix += f" (then check that {shard}'s size fits in a node)"
    return Finding(
        "CP301",
        f"reversed HSDP mesh: shard dim {shard}({mesh.size(shard)}) crosses nodes while "
        f"replicate dim {replicate}({mesh.size(replicate)}) stays inside a node on "
        f"{topology.describe()}; every all-gather and reduce-scatter would cross the slow link",
        fix=fix,
        plugin=plugin,
    )


def _suggest_hsdp(
    mesh: MeshSpec, topology: Topology, shard: str, plugin: str, replicate: list[str]
) -> Finding:
    inner = 1
    for name in reversed(mesh.names):
        if name == shard:
            break
        inner *= mesh.size(name)
    per_node = max(1, topology.devices_per_node // inner)
    size = mesh.size(shard)
    spans = topology.nodes_spanned(mesh, shard)
    if replicate:
        # A replicate dim exists but crosses nodes too: the shard dim is simply too big.
        rep = replicate[0]
        return Finding(
            "CP305",
            f"shard dim {shard}({size}) spans {spans} nodes (replicate dim {rep} crosses nodes "
            "as well): every all-gather and reduce-scatter crosses nodes",
            fix=f"shrink {shard} to {per_node} (the devices of one node it can use) and grow "
            f"{rep} by {max(1, size // per_node)}x",
            plugin=plugin,
        )
    if size % per_node == 0 and size > per_node:
        split = f"dp_replicate={size // per_node}, {shard}={per_node}"
    else:
        split = f"a replicate dim across the {topology.nodes} nodes"
    return Finding(
        "CP305",
        f"shard dim {shard}({size}) spans {spans} nodes with no replicate dim: every "
        "all-gather and reduce-scatter crosses nodes",
        fix=f"consider HSDP: shard inside a node and replicate across nodes ({split}; "
        "add the HSDP plugin)",
        plugin=plugin,
    )


# -- model-aware ---------------------------------------------------------------------------

LARGE_MATERIALIZED_BYTES = 1 << 30


def model_rules(
    model: nn.Module,
    blocks: list[Block],
    decls: Sequence[Declaration],
    materializers: Sequence[str],
    spec: BlockSpec | None,
) -> list[Finding]:
    from torch.distributed.tensor import DTensor

    found: list[Finding] = []
    needing = [d.plugin for d in decls if d.needs_blocks]
    if needing and not blocks:
        how = f"no module matches {spec.describe()}" if spec else "none could be detected"
        found.append(
            Finding(
                "CP401",
                f"no blocks found in {type(model).__name__} ({how}); {needing[0]} groups "
                "parameters per block, so without blocks the whole model is one group",
                fix="pass blocks= to the plugin: a module path like 'layers' or block class "
                "names like ['DecoderLayer']",
                plugin=needing[0],
            )
        )
    # A tensor registered twice is counted once; only the materialized ones count (a
    # model built on meta has none).
    named = [*model.named_parameters(), *model.named_buffers()]
    on_meta = any(t.is_meta for _, t in named)
    materialized = sum(t.numel() * t.element_size() for _, t in named if not t.is_meta)
    dtensors = [n for n, t in named if isinstance(t, DTensor)]
    if dtensors:
        found.append(
            Finding(
                "CP402",
                f"{len(dtensors)} parameter(s) are already DTensors (first: {dtensors[0]}): "
                "the model was parallelized before this plan",
                fix="apply the plan to a freshly built model (ideally under "
                "torch.device('meta'))",
            )
        )
    materializes = bool(materializers)
    shards = any(c.role in (Role.SHARD, Role.MODEL_PARALLEL) for d in decls for c in d.claims)
    if materialized >= LARGE_MATERIALIZED_BYTES and shards:
        found.append(
            Finding(
                "CP403",
                f"the model already holds {materialized / 2**30:.1f} GiB of materialized "
                "tensors: every rank built a full copy before sharding",
                fix="build the model under torch.device('meta') and use MetaInit or a loader",
            )
        )
    if on_meta and not materializes:
        found.append(
            Finding(
                "CP405",
                "the model has tensors on the meta device and no plugin materializes it",
                fix="add MetaInit(seed=...) to initialize, or a loader to load weights",
            )
        )
    return found


# -- comm hooks ----------------------------------------------------------------------------


def comm_hook_rules(
    mesh: MeshSpec, decls: Sequence[Declaration], hooks: Sequence[CommHook]
) -> list[Finding]:
    """CP218 (no data-parallel owner), CP219 (two hooks, one dim), CP220 (wrong collective)."""
    found: list[Finding] = []
    owners: dict[str, list[tuple[str, Role]]] = {}
    for decl in decls:
        for claim in decl.claims:
            owners.setdefault(claim.dim, []).append((decl.plugin, claim.role))
    by_dim: dict[str, list[CommHook]] = {}
    for hook in hooks:
        by_dim.setdefault(hook.dim, []).append(hook)
        asked = hook.collectives()
        if hook.dim not in mesh:
            found.append(Finding(
                "CP218",
                f"comm hook on mesh dim {hook.dim!r}, which the mesh does not have"
                f"{did_you_mean(hook.dim, mesh.names)}; the mesh has {list(mesh.names)}",
                fix="point the hook at a data-parallel mesh dim (the plugin's `dim` option), "
                "e.g. the replicate dim HSDP owns",
                plugin=hook.plugin,
            ))
            continue
        data_parallel = [(p, r) for p, r in owners.get(hook.dim, []) if r in RUNS]
        if not data_parallel:
            who = owners.get(hook.dim)
            why = (f"{who[0][0]} claims it for {who[0][1].value}" if who
                   else "no plugin claims it")
            found.append(Finding(
                "CP218",
                f"comm hook on mesh dim {hook.dim!r}, which no data-parallel plugin owns "
                f"({why}): no gradient reduction runs over it for the hook to customize",
                fix=f"add the data-parallel plugin that owns {hook.dim!r} (HSDP for a replicate "
                "dim, FSDP2 for a shard dim), or point the hook at a dim one owns",
                plugin=hook.plugin,
            ))
            continue
        owner, role = data_parallel[0]
        runs = RUNS[role]
        wrong = [c for c in asked if c not in runs]
        if wrong or not asked:
            what = ", ".join(wrong) if wrong else "no collective"
            found.append(Finding(
                "CP220",
                f"comm hook customizes {what} on mesh dim {hook.dim!r}, which {owner} "
                f"{'replicates' if role is Role.REPLICATE else 'shards'} over: that dim runs "
                f"only {' and '.join(sorted(runs))}",
                fix="hook all_reduce on a replicate dim, all_gather / reduce_scatter on a "
                "shard dim",
                plugin=hook.plugin,
            ))
    for dim, hooked in by_dim.items():
        plugins = [h.plugin or "?" for h in hooked]
        if len(hooked) > 1:
            found.append(Finding(
                "CP219",
                f"mesh dim {dim!r} has comm hooks from {' and '.join(plugins)}: its "
                "collectives can run only one plugin's code",
                fix="keep one comm-hook plugin per mesh dim",
                plugin=plugins[1],
            ))
    return found
