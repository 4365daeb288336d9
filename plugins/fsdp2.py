"""FSDP2: ``fully_shard`` each block, then the root, over the shard dim.

Replicate dims contributed by other plugins (HSDP) through the composition hook
``composer_par_replicate_dims`` make the mesh 2-D: (replicate, shard), replicate outer.

A Hugging Face model's own FSDP plan (transformers' ``_fsdp_plan``: ``model.layers.*``,
``model.embed_tokens``, ``model.norm``, ``lm_head``, each ``free_full_weight`` or
``keep_full_weight``) is followed where blocks are detected: its units beside the blocks
are sharded as units of their own, those it keeps whole kept unsharded from forward to
backward (CP425); a unit holding a tied weight, or overlapping a block, stays in its
parent's unit; a unit of small parameters (the final norm) joins a neighbour
(composer_par.plugin.fsdp_units: the head, as transformers' own FSDP2 does). Explicit
blocks or units replace the model's plan (CP426); units leaving the root's unit small
parameters only are reported with the unit to list them with (CP441). Its expert-parallel
plan (``_ep_plan``) is applied by a plugin providing ``expert_parallel`` (EP), and
without one reported as not applied (CP427).

Dims that model-parallel plugins fold into data parallelism (``composer_par_folded_dims``:
ep) are flattened with FSDP2's own dim into one shard dim; modules other plugins ask to
shard apart (``composer_par_shard_apart``: EP's experts) are sharded first, over the
mesh without the dims they name, their gradients divided by all data shards.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs

from composer_par.plugin import (
    FSDP_STYLES,
    Claim,
    EstimateSettings,
    Finding,
    JoinedUnit,
    OptionError,
    OwnUnit,
    Plugin,
    Role,
    Rule,
    Severity,
    blocks_option,
    bool_option,
    did_you_mean,
    dim_option,
    dtype_option,
    expert_parallel_plan,
    hookimpl,
    join_small_units,
    modules_by_clean_name,
    ordering_option,
    own_units,
    positive_number_option,
    provided,
    small_remainder,
    tied_outside,
)
from composer_par.plugin.fsdp_state import (
    UNCHECKED_TORCH_RULE,
    apart_divide_factor,
    install_all_reduce,
    install_shard_comms,
    internals_read,
    premul_sum_supported,
    set_gradient_divide_factor,
    unchecked_torch_findings,
)

if TYPE_CHECKING:
    from composer_par.plugin import ApplyContext, MeshSpec, PlanView, Topology

RULES = (
    Rule("CP216", Severity.WARNING, "reshard_after_forward=false under HSDP",
         "keep it if the model fits (it saves each block's all-gather in backward); else set "
         "reshard_after_forward = true, or an int divisor of the shard size",
         "[mesh]\ndp_replicate = 2\ndp_shard = 4\n\n[[plugins]]\nname = \"hsdp\"\n\n"
         "[[plugins]]\nname = \"fsdp2\"\nreshard_after_forward = false\n"),
    Rule("CP303", Severity.ERROR, "int reshard_after_forward does not divide the shard size",
         "use a divisor of the shard size (e.g. the devices per node), or true/false",
         "[mesh]\ndp_shard = 8\n\n[[plugins]]\nname = \"fsdp2\"\n"
         "reshard_after_forward = 3\n"),
    Rule("CP304", Severity.ERROR, "int reshard_after_forward regroups ranks across nodes",
         "use a divisor of the shard size whose runs of ranks fit in a node, or true/false",
         "[mesh]\ndp_replicate = 2\ndp_shard = 8\n\n[topology]\nnodes = 4\n"
         "devices_per_node = 4\n\n[[plugins]]\nname = \"hsdp\"\n\n[[plugins]]\n"
         "name = \"fsdp2\"\nreshard_after_forward = 8\n"),
    Rule("CP424", Severity.ERROR, "a block shares a parameter with a module outside it",
         "name blocks that hold both twins, or none (detected blocks leave such a module to "
         "its parent's group)",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(blocks=[\"BertEmbeddings\", "
         "\"BertLayer\"])).use(MetaInit()).validate(bert_for_masked_lm)"),
    Rule("CP425", Severity.INFO, "FSDP2 follows the model's own FSDP plan",
         "nothing to do; pass blocks= to choose the units yourself",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit())"
         ".validate(llama_for_causal_lm)"),
    Rule("CP426", Severity.INFO, "explicit blocks replace the model's own FSDP plan",
         "leave blocks out to follow the model's plan, or keep them to choose the units",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(blocks=\"model.layers\"))"
         ".use(MetaInit()).validate(llama_for_causal_lm)"),
    Rule("CP427", Severity.INFO, "the model's expert-parallel plan is not applied",
         "add EP() and an ep mesh dim to hold whole experts per rank; or nothing: the experts "
         "train as the plan's other weights do (sharded by FSDP2, split per expert by TP's "
         "auto plan)",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit())"
         ".validate(mixtral_for_causal_lm)"),
    Rule("CP428", Severity.ERROR, "reshard_units names no FSDP2 unit of the model",
         "name a unit the plan makes (a block's path, a module of units=, or root), or a "
         "pattern matching some (\"layers.*\")",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(reshard_units={\"layers.9\": False}))"
         ".use(MetaInit()).validate(llama)"),
    Rule("CP429", Severity.ERROR, "a module of units= cannot be an FSDP2 unit of its own",
         "name modules that exist, hold parameters, and are neither blocks, inside or around "
         "a block, inside or around another unit, nor tied to a weight outside them",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(units=[\"layers.1\"]))"
         ".use(MetaInit()).validate(llama)"),
    Rule("CP430", Severity.ERROR, "reshard_units gives one unit two values",
         "give the unit its own entry (an exact path wins over patterns), or make the "
         "patterns agree",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(reshard_units={\"layers.*\": False, "
         "\"*.1\": True})).use(MetaInit()).validate(llama)"),
    Rule("CP441", Severity.INFO, "units= leaves the root's unit small parameters only",
         "list those modules with the unit next to them (units=[\"tok_embeddings\", "
         "[\"norm\", \"output\"]], torchtitan's layout), or leave it: one all-gather and one "
         "reduce-scatter more per step, for a few bytes",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(units=[\"tok_embeddings\", \"output\"]))"
         ".use(MetaInit()).validate(llama)"),
    UNCHECKED_TORCH_RULE,
)

@attrs.frozen
class MixedPrecision:
    """FSDP2's MixedPrecisionPolicy by dtype names (so plan files can state it).

    ``output_dtype`` is applied on the root module only: set on every module, each
    block's outputs would be cast back and forth.
    """

    param_dtype: str | None = dtype_option()
    reduce_dtype: str | None = dtype_option()
    output_dtype: str | None = dtype_option()
    cast_forward_inputs: bool = bool_option(True)

    def policy(self, *, root: bool) -> Any:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        def dt(name: str | None) -> Any:
            return getattr(torch, name) if name else None

        return MixedPrecisionPolicy(
            param_dtype=dt(self.param_dtype),
            reduce_dtype=dt(self.reduce_dtype),
            output_dtype=dt(self.output_dtype) if root else None,
            cast_forward_inputs=self.cast_forward_inputs,
        )


def _mixed_precision(value: Any) -> MixedPrecision | None:
    if value is None or isinstance(value, MixedPrecision):
        return value
    if isinstance(value, dict):
        return MixedPrecision(**value)
    if isinstance(value, str):  # "bf16": bf16 parameters, fp32 gradient reduction
        return MixedPrecision(param_dtype=value, reduce_dtype="float32")
    raise TypeError(f"mixed_precision must be a table of dtypes or a dtype name; got {value!r}")


def _reshard(instance: Any, attribute: Any, value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"reshard_after_forward must be true, false, or a positive int; got {value!r}"
        )


#: The key of ``reshard_units`` that names the root's unit (the model's own parameters).
ROOT = "root"
_GLOB = frozenset("*?[")


def _reshard_units(value: Any) -> dict[str, bool | int]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise OptionError(
            "reshard_units must be a table of unit -> true, false or a positive int (e.g. "
            f"{{ root = false, \"layers.47\" = false }}); got {value!r}")
    out: dict[str, bool | int] = {}
    for key, flag in value.items():
        if not isinstance(key, str) or not key:
            raise OptionError(f"reshard_units: a key must be a unit path or pattern; got {key!r}")
        if not isinstance(flag, int) or (not isinstance(flag, bool) and flag < 1):
            raise OptionError(f"reshard_units[{key!r}] must be true, false, or a positive int; "
                              f"got {flag!r}")
        out[key] = flag
    return out


#: An entry of ``units``: one module's path, or the paths of modules sharded together.
UnitEntry = str | tuple[str, ...]


def _entry_paths(entry: UnitEntry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else entry


def _unit_paths(value: Any) -> tuple[UnitEntry, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    wrong = OptionError(
        "units must be a list of module paths, or of lists of them for modules sharded "
        f"together (e.g. [\"tok_embeddings\", [\"norm\", \"output\"]]); got {value!r}")
    if not isinstance(value, (list, tuple)):
        raise wrong
    entries: list[UnitEntry] = []
    for entry in value:
        if isinstance(entry, (list, tuple)) and len(entry) == 1:
            entry = entry[0]
        if isinstance(entry, str) and entry:
            entries.append(entry)
        elif (isinstance(entry, (list, tuple)) and entry
              and all(isinstance(p, str) and p for p in entry)):
            entries.append(tuple(entry))
        else:
            raise wrong
    paths = [p for e in entries for p in _entry_paths(e)]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise OptionError(f"units names {twice[0]!r} twice; each module is in one unit")
    if ROOT in paths:
        raise OptionError(f"units: {ROOT!r} is the root's unit, which FSDP2 always makes; "
                          "list the modules to shard as units of their own")
    return tuple(entries)


def _units_shown(entries: tuple[UnitEntry, ...]) -> str:
    return repr([e if isinstance(e, str) else list(e) for e in entries])


@attrs.frozen
class Unit:
    """One ``fully_shard`` call: the unit's name (a block's or module's path, the model
    plan's entry, or ``root``), the clean paths of the modules it groups (none for the
    root), what made it one (``block``, ``unit``, ``model plan``, ``root``), the model
    plan's reshard style for its units, and the modules themselves."""

    name: str
    paths: tuple[str, ...]
    kind: str
    style: bool | None = None
    modules: tuple[Any, ...] = attrs.field(default=(), eq=False, repr=False)

    def matches(self, key: str) -> bool:
        names = (self.name, *self.paths)
        if _GLOB & set(key):
            return any(fnmatch.fnmatchcase(n, key) for n in names)
        return key in names


def _units_summary(units: list[Unit]) -> str:
    """The units by name, runs of blocks shortened (``layers.0 ... layers.47 (48 blocks)``)."""
    blocks = [u.name for u in units if u.kind == "block"]
    shown = ([] if not blocks else [blocks[0]] if len(blocks) == 1 else
             [f"{blocks[0]} ... {blocks[-1]} ({len(blocks)} blocks)"])
    return ", ".join([*shown, *(u.name for u in units if u.kind != "block")])


@attrs.frozen
class FSDP2(Plugin):
    """Fully sharded data parallel (``torch.distributed.fsdp.fully_shard``).

    Options: ``dim`` (default ``dp_shard``); ``reshard_after_forward`` (bool, an int
    world size to reshard to, or None for torch's default, except that the last block
    stays gathered for its backward: :meth:`kept_block`); ``reshard_units`` (the same
    per unit: ``{"root": False, "layers.47": False}``, keys unit paths or fnmatch patterns
    of them, ``root`` the root's unit; each over ``reshard_after_forward``);
    ``mixed_precision`` (:class:`MixedPrecision`, a table, or ``"bf16"``); ``offload``
    (``"none"`` or ``"cpu"``); ``blocks`` (a module path or block class names; else
    detected); ``units`` (module paths each sharded as a unit of its own beside the blocks,
    before the root, e.g. ``["tok_embeddings", "output"]``: the blocks, which activation
    checkpointing and compile share, stay as they are); ``gradient_divide_factor`` (divide
    the summed gradients by this instead of the data-parallel size, on every unit).
    """

    name: ClassVar[str] = "fsdp2"
    provides: ClassVar[frozenset[str]] = frozenset({"data_parallel"})
    needs_blocks: ClassVar[bool] = True
    rules: ClassVar[tuple[Rule, ...]] = RULES

    dim: str = dim_option("dp_shard")
    reshard_after_forward: bool | int | None = attrs.field(default=None, validator=_reshard)
    # A dict, so a plan file's inline table round-trips; left out of the hash (a dict has
    # none) and compared by value.
    reshard_units: dict[str, bool | int] = attrs.field(
        factory=dict, converter=_reshard_units, hash=False)
    mixed_precision: MixedPrecision | None = attrs.field(default=None, converter=_mixed_precision)
    offload: Literal["none", "cpu"] = attrs.field(
        default="none", validator=attrs.validators.in_(("none", "cpu"))
    )
    blocks: str | tuple[str, ...] | None = blocks_option()
    units: tuple[UnitEntry, ...] = attrs.field(default=(), converter=_unit_paths)
    gradient_divide_factor: float | None = positive_number_option()
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    def claims(self) -> tuple[Claim, ...]:
        return (Claim(self.dim, Role.SHARD),)

    @hookimpl
    def composer_par_validate_plan(
        self, plan: PlanView, mesh: MeshSpec, topology: Topology | None
    ) -> list[Finding]:
        found = []
        replicated = [d for d in plan.replicate_dims() if d in mesh and d != self.dim]
        if self.reshard_after_forward is False and replicated and self.dim in mesh:
            found.append(Finding(
                "CP216",
                f"{self.name} keeps parameters unsharded from forward to backward "
                f"(reshard_after_forward=false) under HSDP (replicating over {replicated[0]}): "
                "at peak every rank holds every block's full parameters, as without sharding "
                f"over {self.dim}",
                fix="keep it if the model fits (it saves each block's all-gather in "
                "backward); else set reshard_after_forward = true, or an int divisor of "
                "the shard size",
            ))
        if self.dim not in mesh:
            return found
        ints = [("reshard_after_forward", self.reshard_after_forward),
                *((f"reshard_units[{k!r}]", v) for k, v in self.reshard_units.items())]
        for label, value in ints:
            if value is not None and not isinstance(value, bool):
                found += self._int_reshard_findings(label, value, mesh, topology)
        return found

    def _int_reshard_findings(self, label: str, value: int, mesh: MeshSpec,
                              topology: Topology | None) -> list[Finding]:
        found = []
        size = mesh.size(self.dim)
        if size > 0 and (size % value or value > size):
            found.append(Finding(
                "CP303",
                f"{label}={value} does not divide the shard size {self.dim}({size})",
                fix=f"use a divisor of {size} (e.g. the devices per node), or true/false",
            ))
        if topology is not None and mesh.is_resolved and mesh.world_size == topology.world_size:
            # After forward, each shard group keeps parameters gathered over runs of
            # `value` consecutive members; those runs must stay on one node.
            crossing = next(
                (run for group in mesh.rank_groups(self.dim)
                 for run in (group[i : i + value] for i in range(0, len(group), value))
                 if len({topology.node_of(r) for r in run}) > 1),
                None,
            )
            if crossing is not None:
                found.append(Finding(
                    "CP304",
                    f"{label}={value} regroups {self.dim} into runs of {value} "
                    f"ranks, and run {list(crossing)} spans nodes on {topology.describe()}: "
                    "the backward all-gather would cross nodes",
                    fix=f"use a divisor of {size} whose runs fit in a node (at most "
                    f"{topology.devices_per_node} devices per node, counting inner mesh dims)",
                ))
        return found

    @hookimpl
    def composer_par_validate_model(self, plan: PlanView, model: Any,
                                    blocks: list[Any]) -> list[Finding]:
        # A plugin providing expert parallelism applies the model's _ep_plan (CP427).
        experts_parallel = provided(plan, "expert_parallel")
        found = self._own_plan_findings(model, blocks, experts_parallel)
        found += unchecked_torch_findings(internals_read(
            plan, [*plan.replicate_dims(), self.dim], self.gradient_divide_factor))
        units, unit_found = self.unit_list(model, blocks)
        found += unit_found
        if self.units and not unit_found:
            found += self._small_root_findings(model, blocks, units)
        found += self.reshard_values(units)[1]
        for path, name, twin in tied_outside(model, blocks):
            found.append(Finding(
                "CP424",
                f"block {path} holds {name}, which is tied to {twin} outside it (one "
                "parameter in two modules): fully_shard would make it part of two FSDP "
                "groups and fail, or shard the two names apart",
                fix=f"give blocks that leave {path} out (its parent's group then holds both "
                "twins), or a block holding both; detected blocks do this themselves"))
        return found

    def unit_list(self, model: Any, blocks: list[Any], *, part: bool = False
                  ) -> tuple[list[Unit], list[Finding]]:
        """Every unit FSDP2 makes of ``model``, in the order it shards them (the blocks,
        the model plan's or ``units``' modules, the root), and the findings on ``units``.
        ``part``: ``model`` is one pipeline stage's part, which holds some units only."""
        from composer_par.plugin import clean_name

        units = [Unit(clean_name(path), (clean_name(path),), "block", modules=(block,))
                 for path, block in blocks]
        if self.blocks is None and not self.units:
            units += [Unit(u.key, u.paths, "model plan", FSDP_STYLES[u.style],
                           modules=tuple(model.get_submodule(r) for r in u.raw))
                      for u in model_plan_units(model, blocks)[0]]
        # the outer of a wrapper pair; the root is no unit of its own
        named = ({n: m for n, m in modules_by_clean_name(model).items() if n}
                 if self.units else {})
        block_paths = [u.name for u in units if u.kind == "block"]
        found: list[Finding] = []
        taken: list[str] = []
        for entry in self.units:
            paths = _entry_paths(entry)
            if part:  # a pipeline stage's part shards the modules it holds
                paths = tuple(p for p in paths if p in named)
                if not paths:
                    continue
            problem = None
            for path in paths:
                problem = self._unit_problem(model, path, named.get(path), block_paths,
                                             taken, paths)
                if problem is not None:
                    break
                taken.append(path)
            if problem is not None:
                found.append(Finding(
                    "CP429", f"units={_units_shown(self.units)}: {problem}",
                    fix="name modules beside the blocks, each holding parameters of its own "
                    "(e.g. the token embedding, the output head); the blocks are units "
                    "already"))
                continue
            units.append(Unit(" + ".join(paths), paths, "unit",
                              modules=tuple(named[p] for p in paths)))
        units.append(Unit(ROOT, (), "root", modules=(model,)))
        return units, found

    @staticmethod
    def _unit_problem(model: Any, path: str, module: Any, block_paths: list[str],
                      taken: list[str], together: tuple[str, ...]) -> str | None:
        """Why the module at ``path`` cannot be (part of) a unit of its own, or None;
        ``together``: the paths of its unit (a tie among them stays inside it)."""
        from composer_par.plugin import names_near

        if module is None:
            near = names_near(model, path, 3)
            return (f"{type(model).__name__} has no module {path!r}"
                    + (f" (near: {', '.join(near)})" if near else ""))
        if path in block_paths:
            return f"{path} is a block, a unit of its own already"
        outer = next((b for b in block_paths if path.startswith(b + ".")), None)
        if outer is not None:
            return f"{path} is inside block {outer}, whose unit holds it"
        inner = [b for b in block_paths if b.startswith(path + ".")]
        if inner:
            return (f"{path} holds {len(inner)} block(s) ({inner[0]}, ...), units of their "
                    "own already")
        around = next((t for t in taken
                       if path.startswith(t + ".") or t.startswith(path + ".")), None)
        if around is not None:
            return f"{path} and {around}, both in units, overlap"
        if next(iter(module.parameters()), None) is None:
            return f"{path} holds no parameters: its unit would shard nothing"
        ties = [(a, b) for _, a, b in tied_outside(model, [(path, module)])
                if not any(b == q or b.startswith(q + ".") for q in together)]
        if ties:
            return (f"{path} holds {ties[0][0]}, which is tied to {ties[0][1]} outside its "
                    "unit: one parameter cannot be in two units")
        return None

    def _small_root_findings(self, model: Any, blocks: list[Any], units: list[Unit]
                             ) -> list[Finding]:
        """CP441: the explicit units leave the root's unit small parameters only (the
        final norm beside a head given a unit of its own); the fix names the unit next to
        them, in module order with no block between, to list them with."""
        lone = small_remainder(model, [m for u in units if u.kind != "root"
                                       for m in u.modules])
        if not lone:
            return []
        order = {name: i for i, name in enumerate(modules_by_clean_name(model))}
        at_blocks = [order[u.name] for u in units if u.kind == "block" and u.name in order]
        here = order.get(lone[0][0], -1)
        best: tuple[int, int] | None = None
        for index, entry in enumerate(self.units):
            there = min(order.get(p, -1) for p in _entry_paths(entry))
            low, high = sorted((here, there))
            if there < 0 or here < 0 or any(low < b < high for b in at_blocks):
                continue
            if best is None or abs(there - here) < best[1]:
                best = (index, abs(there - here))
        paths = [path for path, _ in lone]
        if best is None:
            advice = f"list {', '.join(paths)} in a unit with the module next to it"
        else:
            joined = sorted([*paths, *_entry_paths(self.units[best[0]])],
                            key=lambda p: order.get(p, -1))
            suggested = [*self.units[:best[0]], tuple(joined), *self.units[best[0] + 1:]]
            advice = f"units={_units_shown(tuple(suggested))}"
        numel = sum(n for _, n in lone)
        return [Finding(
            "CP441", f"units={_units_shown(self.units)} leaves the root's unit "
            f"{', '.join(paths)} alone ({numel} parameter(s) of one tensor dim): its "
            "all-gather and reduce-scatter each step carry them only",
            fix=f"{advice}; or leave it: one all-gather and one reduce-scatter more per "
            "step, for a few bytes")]

    def kept_block(self, units: list[Unit], *, part: bool = False) -> str | None:
        """The block left unsharded from forward to backward by default: the last one.
        Its backward follows its forward at once (only the head and the loss lie between),
        so resharding it would only all-gather it again (torchtitan's Llama code long kept
        it so; its current code and transformers' reshard it). None
        when a value is given for it (``reshard_after_forward``, a ``reshard_units``
        entry), inside a pipeline stage (whose schedule runs other microbatches' forwards
        in between), or with ``offload = "cpu"`` (chosen to save device memory)."""
        blocks = [u for u in units if u.kind == "block"]
        if (not blocks or part or not self.keeps_last_block
                or any(blocks[-1].matches(k) for k in self.reshard_units)):
            return None
        return blocks[-1].name

    @property
    def keeps_last_block(self) -> bool:
        """Whether the options leave the last block gathered for its backward (outside a
        pipeline stage, unless ``reshard_units`` names it): :meth:`kept_block`."""
        return self.reshard_after_forward is None and self.offload != "cpu"

    def reshard_values(self, units: list[Unit], *, part: bool = False
                       ) -> tuple[dict[str, bool | int | None], list[Finding]]:
        """Each unit's ``reshard_after_forward`` (None: torch's default), and the findings
        on ``reshard_units``: an entry naming no unit (CP428), two values for one (CP430).

        An exact path beats patterns; otherwise the table's entries, then the model plan's
        style for its units (unless ``reshard_after_forward`` is given), then
        ``reshard_after_forward``; the last block, given none of them, stays gathered
        (:meth:`kept_block`; ``part``: a pipeline stage's part)."""
        values: dict[str, bool | int | None] = {}
        found: list[Finding] = []
        used: set[str] = set()
        kept = self.kept_block(units, part=part)
        for unit in units:
            exact = [k for k in self.reshard_units if not _GLOB & set(k) and unit.matches(k)]
            patterns = [k for k in self.reshard_units if _GLOB & set(k) and unit.matches(k)]
            used.update(exact, patterns)
            chosen = exact or patterns
            value: bool | int | None = self.reshard_after_forward
            if chosen:
                # True and 1 are different settings (1 keeps a one-rank copy)
                given = {(type(self.reshard_units[k]), self.reshard_units[k]) for k in chosen}
                if len(given) > 1:
                    shown = ", ".join(f"{k!r}: {self.reshard_units[k]}" for k in chosen)
                    found.append(Finding(
                        "CP430", f"reshard_units gives unit {unit.name} {len(given)} values "
                        f"({shown})",
                        fix=f"give {unit.name!r} an entry of its own (an exact path wins over "
                        "patterns), or make the patterns agree"))
                value = self.reshard_units[chosen[0]]
            elif unit.style is not None and self.reshard_after_forward is None:
                value = unit.style
            elif unit.name == kept:
                value = False
            values[unit.name] = value
        for key in self.reshard_units:
            if key not in used:
                found.append(Finding(
                    "CP428", f"reshard_units names {key!r}, which is no FSDP2 unit; the units "
                    f"are {_units_summary(units)}"
                    + did_you_mean(key, [u.name for u in units]),
                    fix="name a unit the plan makes (a block's path, a module of units=, or "
                    f"{ROOT}), or a pattern matching some (\"layers.*\"); to make a module a "
                    "unit, list it in units="))
        return values, found

    def _own_plan_findings(self, model: Any, blocks: list[Any],
                           experts_parallel: bool = False) -> list[Finding]:
        name = type(model).__name__
        units, left = own_units(model, blocks)
        found = []
        joined: list[JoinedUnit] = []
        if units and self.blocks is None and not self.units:
            units, joined = model_plan_units(model, blocks)
        if units and (self.blocks is not None or self.units):
            given = (f"blocks={self.blocks!r}" if self.units == () else
                     f"units={_units_shown(self.units)}" if self.blocks is None else
                     f"blocks={self.blocks!r} with units={_units_shown(self.units)}")
            found.append(Finding(
                "CP426", f"{given} gives the FSDP units; {name}'s own FSDP "
                f"plan (_fsdp_plan) would also shard {_units_text(units)} as units of their "
                "own: they stay in the root's unit",
                fix="leave blocks out to follow the model's plan, or keep them to choose the "
                "units"))
        elif units or left or joined:
            kept = ("" if self.reshard_after_forward is None or not any(
                u.style == "keep_full_weight" for u in units) else
                f"; reshard_after_forward={self.reshard_after_forward} applies to them all")
            message = (f"{name}'s own FSDP plan (_fsdp_plan): "
                       + (f"{_units_text(units)} sharded as units of their own beside "
                          f"{len(blocks)} block(s){kept}" if units else "no unit beside the "
                          "blocks"))
            if joined:
                message += ("; joined with a neighbour (each saves its own all-gather and "
                            "reduce-scatter per step): "
                            + "; ".join(j.describe() for j in joined))
            if left:
                message += "; left in their parent's unit: " + "; ".join(
                    f"{key} ({why})" for key, why in left)
            found.append(Finding("CP425", message,
                                 fix="nothing to do; pass blocks= to choose the units yourself"))
        experts = expert_parallel_plan(model)
        if experts and not experts_parallel:
            shown = ", ".join(f"{k}: {v}" for k, v in list(experts.items())[:3])
            found.append(Finding(
                "CP427", f"{name} has an expert-parallel plan (_ep_plan: {shown}"
                f"{', ...' if len(experts) > 3 else ''}), which no plugin of this plan "
                "applies: tokens are not dispatched to experts on other ranks; each rank "
                "computes every expert, whose weights FSDP2 shards with their block",
                fix="add EP() and an ep mesh dim (e.g. MeshSpec(dp_shard=2, ep=2)) to hold "
                "whole experts per rank and dispatch tokens by all-to-all; or nothing: the "
                "experts train as the plan's other weights do"))
        return found

    @hookimpl
    def composer_par_estimate_settings(self) -> EstimateSettings:
        mp = self.mixed_precision or MixedPrecision()
        return EstimateSettings(reshard_after_forward=self.reshard_after_forward,
                                param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)

    @hookimpl
    def composer_par_estimate(self, layout: Any, model: Any, workload: Any,
                              stage: Any) -> Any:
        from .fsdp2_estimate import estimate_part

        return estimate_part(self, layout, model, workload, stage)

    @hookimpl
    def composer_par_suggest(self, topology: Any, workload: Any) -> Any:
        from .fsdp2_suggest import suggest_axes

        return suggest_axes(self, topology, workload)

    @hookimpl
    def composer_par_describe(self, plan: PlanView) -> list[tuple[str, str]]:
        hooked = {h.dim for h in plan.comm_hooks() if h.all_reduce}
        folded = {f.dim for f in plan.folded_dims()}
        dims = [*(d for d in plan.replicate_dims() if d in plan.mesh and d not in hooked),
                " x ".join(d for d in plan.mesh.names if d == self.dim or d in folded)
                or self.dim]
        opts = ", ".join(f"{k}={v}" for k, v in self.options().items()
                         if k not in ("dim", "units", "gradient_divide_factor"))
        middle = (", then " + ", ".join(" + ".join(_entry_paths(e)) for e in self.units)
                  if self.units else
                  ", then the units of the model's own FSDP plan if it has one (a unit of "
                  "small parameters with its neighbour)" if self.blocks is None else "")
        steps = [(
            "data_parallel",
            f"fully_shard each block{middle}, then the root, over mesh ({', '.join(dims)})"
            + (f" with {opts}" if opts else "")
            + ("" if not self.keeps_last_block else
               "; the last block kept gathered from forward to backward unless "
               "reshard_units names it or a pipeline stage holds it"),
        )]
        if self.gradient_divide_factor is not None:
            steps.append(("finalize", f"divide gradients by {self.gradient_divide_factor:g} "
                          "on every FSDP module"))
        return steps

    @hookimpl
    def composer_par_data_parallel(self, ctx: ApplyContext) -> str:
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        replicate = [d for d in ctx.replicate_dims() if d in ctx.mesh and d != self.dim]
        if len(replicate) > 1:
            raise NotImplementedError(
                f"FSDP2 replicates over one mesh dim; plugins contributed {replicate}"
            )
        # A replicate dim whose all-reduce a comm hook claims stays out of the mesh: FSDP2
        # then shards over its own dim only and the hook reduces over the replicate dim.
        comm_hooks = ctx.comm_hooks()
        hooked = [d for d in replicate if d in comm_hooks and comm_hooks[d].all_reduce]
        replicate = [d for d in replicate if d not in hooked]
        # Dims the model-parallel plugins fold in (cp, ep) hold equal parameters: they
        # shard with this dim as one flattened shard dim.
        folded = {f.dim for f in ctx.folded_dims()}
        shard = [d for d in ctx.mesh.names if d == self.dim or d in folded]
        mesh = ctx.data_parallel_mesh(replicate, shard)
        if self.offload == "cpu":
            # Pinned host memory needs an accelerator; without one, pinning fails.
            offload: Any = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            # fully_shard with CPU offload wants its parameters materialized on the host.
            ctx.parameter_device = torch.device("cpu")
        else:
            offload = OffloadPolicy()
        mp = self.mixed_precision or MixedPrecision()
        common = {"mesh": mesh, "offload_policy": offload}
        units, problems = self.unit_list(ctx.model, ctx.blocks, part=ctx.pipeline is not None)
        if problems:  # validation refuses these first; a model changed since then
            raise ValueError(problems[0].message)
        part = ctx.pipeline is not None
        reshard = self.reshard_values(units, part=part)[0]
        kept = self.kept_block(units, part=part)
        joined = (model_plan_units(ctx.model, ctx.blocks)[1]
                  if self.blocks is None and not self.units else [])
        place = functools.partial(_shard_placement, mesh.size(mesh.ndim - 1))
        sharded = []
        block_policy, root_policy = mp.policy(root=False), mp.policy(root=True)
        # Modules sharded apart (expert parallelism's experts), inside the blocks: first.
        apart_options = dict(common, mp_policy=block_policy)
        if self.reshard_after_forward is not None:
            apart_options["reshard_after_forward"] = self.reshard_after_forward
        kept_apart = part and bool(ctx.plan.selective_checkpointing())
        if kept_apart:
            # Selective checkpointing needs a block's recompute to run no op more often
            # than its forward did. Under a pipeline a microbatch's forward can find a
            # unit inside the block still gathered (torch's stage leaves units gathered
            # after a backward that does not reduce), and a resharded one would be
            # gathered again inside the recompute (its copy-out ops): the first backward
            # fails. Kept gathered from forward to backward, it never is.
            apart_options["reshard_after_forward"] = False
        apart = _shard_apart(ctx, replicate, shard, apart_options, self.gradient_divide_factor)
        # Bottom-up: each block, then the other units, then the root (whose unit holds
        # whatever no other unit took).
        for unit in units:
            options = dict(common)
            if reshard[unit.name] is not None:  # else torch's default (the root: kept)
                options["reshard_after_forward"] = reshard[unit.name]
            modules = list(unit.modules)
            fully_shard(modules if len(modules) > 1 else modules[0],
                        mp_policy=root_policy if unit.kind == "root" else block_policy,
                        shard_placement_fn=place, **options)
            sharded.extend(modules)
        ctx.data_parallel_modules.extend([*apart, *sharded])
        dims = ", ".join([*(f"{d}({ctx.mesh.size(d)})" for d in replicate),
                          " x ".join(f"{d}({ctx.mesh.size(d)})" for d in shard)])
        extra = [u for u in units if u.kind == "unit"]
        detail = (f"fully_shard on {len(ctx.blocks)} block(s) + "
                  + (f"{len(extra)} unit(s) ({', '.join(u.name for u in extra)}) + "
                     if extra else "") + f"root over ({dims})")
        if apart:
            detail += f"; {len(apart)} module(s) sharded apart (expert parallelism's experts)"
            if kept_apart:
                detail += (", kept gathered from forward to backward (selective "
                           "checkpointing recomputes the blocks holding them)")
        own = [u for u in units if u.kind == "model plan"]
        if own:
            detail += ("; the model's own FSDP units: "
                       + ", ".join(f"{u.name} ({'free' if u.style else 'keep'}_full_weight)"
                                   for u in own))
        if joined:
            detail += "; joined: " + ", ".join(j.describe() for j in joined)
        if kept is not None:
            detail += (f"; the last block {kept} kept gathered from forward to backward "
                       "(its backward follows at once: one all-gather less per step)")
        if self.reshard_units:
            # The units reshard_units changed, against what they would have had without it.
            before = attrs.evolve(self, reshard_units={}).reshard_values(units, part=part)[0]
            detail += "; reshard_after_forward per unit: " + ", ".join(
                f"{u.name}={reshard[u.name]}" for u in units
                if (type(reshard[u.name]), reshard[u.name])
                != (type(before[u.name]), before[u.name]))
        for dim in hooked:
            install_all_reduce(ctx, sharded, comm_hooks[dim], owner=self.name,
                               replace_native=False)
            detail += f"; {dim} all-reduce by {comm_hooks[dim].plugin}'s comm hook"
        if self.dim in comm_hooks:
            install_shard_comms(ctx, sharded, comm_hooks[self.dim], owner=self.name)
            detail += f"; {self.dim} comms by {comm_hooks[self.dim].plugin}'s comm hook"
        return detail

    @hookimpl
    def composer_par_finalize(self, ctx: ApplyContext) -> str | None:
        factor = self.gradient_divide_factor
        if factor is None:
            return None
        modules = ctx.data_parallel_modules
        forced = set_gradient_divide_factor(modules, factor, owner=self.name,
                                            sum_only=not premul_sum_supported(ctx))
        note = f"; SUM reductions on {forced} (no PREMUL_SUM on this backend)" if forced else ""
        return (f"gradient divide factor {factor:g} on {len(modules)} FSDP module(s)"
                f"{note}")


def _shard_apart(ctx: ApplyContext, replicate: list[str], shard: list[str],
                 options: dict[str, Any], factor: float | None = None) -> list[Any]:
    """``fully_shard`` the modules plugins ask to be sharded apart, each over the
    data-parallel dims less its ``without``, dividing gradients by all data shards (cp
    ranks included: :func:`apart_divide_factor`), or by
    ``factor`` (the plan's gradient_divide_factor, which every FSDP module takes)."""
    from torch.distributed.fsdp import fully_shard

    answers = ctx.shard_apart()
    if not answers:
        return []
    done = []
    for answer in answers:
        mesh = ctx.data_parallel_mesh([d for d in replicate if d not in answer.without],
                                      [d for d in shard if d not in answer.without])
        place = functools.partial(_shard_placement, mesh.size(mesh.ndim - 1))
        for module in answer.modules:
            fully_shard(module, **dict(options, mesh=mesh, shard_placement_fn=place))
            done.append(module)
    set_gradient_divide_factor(done, factor or apart_divide_factor(ctx),
                               sum_only=not premul_sum_supported(ctx), owner="fsdp2")
    return done


def _shard_placement(shard_size: int, param: Any) -> Any:
    """Where FSDP2 splits a parameter: on its leading dim (torch's default) unless this
    rank holds fewer rows than there are shard ranks, when FSDP2 would pad that dim to
    the shard size (a fused [experts, ...] tensor of 8 experts over 32 ranks: four times
    its bytes on every rank, and in every all-gather); then on the next dim (each
    expert's rows), as torchtitan does for its experts, where that dim splits evenly
    (FSDP2 pads tensor dim 0 only and refuses an uneven split of any other). A parameter
    whose halves expert tensor parallelism splits apart (a packed ``[gate; up]``,
    ``_StridedShard`` over tp) is split on a dim nothing else splits: on the experts' dim
    it would take a second strided placement, which torch cannot gather back
    (``full_tensor``, checkpoints)."""
    from torch.distributed.tensor import DTensor, Shard

    from composer_par.plugin import torch_private

    local = param.to_local() if isinstance(param, DTensor) else param
    strided_shard = torch_private.strided_shard()
    if isinstance(param, DTensor) and any(isinstance(p, strided_shard)
                                          for p in param.placements):
        split = {p.dim for p in param.placements if isinstance(p, Shard)}
        free = [d for d in range(local.ndim)
                if d not in split and (d == 0 or local.shape[d] % shard_size == 0)]
        if free:
            return Shard(free[-1])
    if local.ndim > 1 and local.shape[0] < shard_size and local.shape[1] % shard_size == 0:
        return Shard(1)
    return None


def model_plan_units(model: Any, blocks: list[Any]) -> tuple[list[OwnUnit], list[JoinedUnit]]:
    """The units of the model's own FSDP plan beside ``blocks``, those of small
    parameters joined with a neighbour (composer_par.plugin.fsdp_units), and what joined
    what."""
    return join_small_units(model, blocks, own_units(model, blocks)[0])


def _units_text(units: list[OwnUnit]) -> str:
    return ", ".join(f"{u.key} ({u.style})" for u in units)
