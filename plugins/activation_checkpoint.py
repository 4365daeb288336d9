"""ActivationCheckpoint: recompute the shared blocks' activations in backward.

``mode="full"`` saves nothing inside a checkpointed block (its inputs only) and
recomputes its whole forward in backward, stopping as soon as the tensors backward needs
are back unless ``early_stop=False``. ``mode="selective"`` saves what ``save`` names and
recomputes the rest, through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``:
``"matmul"`` the outputs of the matrix multiplications (the expensive ops; with
``matmul_every=N`` only the 1st, (N+1)-th, ... of each block), ``"collectives"`` the
outputs of the functional collectives (``torch.ops._c10d_functional``: what TP and
DTensor issue), so that a recomputation in backward never issues a collective again.
``policy`` replaces those choices with the user's own op policy. ``every=N`` checkpoints
the N-th, 2N-th, ... block (1-based, as torchtitan counts).

Why no wrapper module: ``checkpoint_wrapper`` inserts ``_checkpoint_wrapped_module.``
into every parameter name under the block, which then reaches ``named_parameters()``,
optimizer state, TP patterns and anything keyed by name. torch's composable
``checkpoint`` keeps names but works through forward hooks, which ``torch.compile`` of the
block would trace into. Instead each checkpointed block gets an instance-level
``forward`` that calls its class's forward under ``torch.utils.checkpoint.checkpoint``:
the module tree, the names and the module objects FSDP groups stay exactly the model's,
and ``torch.compile`` traces the checkpoint as one region (measured on torch 2.13 with
the eager, aot_eager and inductor backends, full and selective).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs

from composer_par.plugin import (
    ALREADY_WRAPPED,
    CHECKPOINT_MARK,
    IMPORT_STRING_RULE,
    SPLIT_BACKWARD,
    ComputeTerm,
    Declaration,
    EstimatePart,
    EstimateSettings,
    Finding,
    Plugin,
    Role,
    Rule,
    Severity,
    SuggestAxis,
    SuggestChoice,
    SuggestContext,
    already_wrapped,
    blocks_option,
    hookimpl,
    import_string_findings,
    int_option,
    ordering_option,
    torch_private,
    wrapped_block_findings,
)

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import ApplyContext, Block

# The instance attribute that marks a block this plugin checkpointed (and in which mode);
# the shared already-wrapped check knows it.
MARK = CHECKPOINT_MARK
# The instance attribute holding how a checkpointed block recomputes (a CheckpointHow).
HOW = CHECKPOINT_MARK + "_how"

# aten ops whose outputs selective mode saves: the matrix multiplications, which are what
# a recompute would spend its time on. nn.Linear reaches the dispatcher as mm/addmm.
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")

# The namespaces of the functional collectives, every op and every overload in them
# (all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_to_all_single,
# broadcast, the coalesced forms, wait_tensor, ...): what TP's redistributions and
# DTensor issue. c10d's own ops (dist.all_reduce and friends) are left out: they write
# into their arguments, and a selective checkpoint caches outputs, not mutations.
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd"})

# aten ops of the fused attention kernels (what scaled_dot_product_attention runs on each
# device), whose outputs "attention" saves: the output and its log-sum-exp.
ATTENTION_OPS = ("_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")

# What selective mode can save, and what it saves unless told otherwise: matmul and
# collective outputs, so that a recomputation in backward runs no collective again.
SAVABLE = ("matmul", "collectives", "attention")
DEFAULT_SAVE = ("matmul", "collectives")

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@functools.cache
def _overloads(names: tuple[str, ...]) -> frozenset[Any]:
    """Every overload of the aten ops named (those this torch has)."""
    import torch

    aten = torch.ops.aten
    found: set[Any] = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            found.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(found)


def is_attention(op: Any) -> bool:
    """Whether ``op`` is one of the fused attention kernels."""
    return op in _overloads(ATTENTION_OPS)


def is_matmul(op: Any) -> bool:
    """Whether ``op`` (an aten OpOverload) is one of the matrix multiplications."""
    return op in _overloads(MATMUL_OPS)


def is_collective(op: Any) -> bool:
    """Whether ``op`` is a functional collective (any op of ``_c10d_functional``)."""
    return getattr(op, "namespace", None) in COLLECTIVE_NAMESPACES


def selective_policy(save: tuple[str, ...] = DEFAULT_SAVE, matmul_every: int = 1) -> Any:
    """A fresh op policy for one checkpointed region: save what ``save`` names (with
    ``matmul_every=N``, the 1st, (N+1)-th, ... matmul of the region), recompute the rest.

    The matmul count lives in the policy, one per forward of the region and one per its
    recompute (``ctx.is_recompute``), so a recompute that asks the policy again makes
    the forward's decisions; a new region (each block, each forward) gets a new policy
    from :func:`selective_context_fn`.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    save_matmul, save_collectives = "matmul" in save, "collectives" in save
    save_attention = "attention" in save
    seen = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if is_matmul(op):
            if not save_matmul:
                return CheckpointPolicy.PREFER_RECOMPUTE
            index = seen[ctx.is_recompute]
            seen[ctx.is_recompute] = index + 1
            if index % matmul_every == 0:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        if save_collectives and is_collective(op):
            return CheckpointPolicy.MUST_SAVE
        if save_attention and is_attention(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context_fn(save: tuple[str, ...] = DEFAULT_SAVE, matmul_every: int = 1) -> Any:
    """A ``context_fn`` of selective mode (by default: save matmul and collective outputs,
    recompute the rest), for ``torch.utils.checkpoint.checkpoint``."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch_private.uncount_profiler_ranges()
    return create_selective_checkpoint_contexts(selective_policy(save, matmul_every))


def policy_context_fn(policy: Callable[..., Any]) -> Any:
    """The ``context_fn`` of a user-given op policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch_private.uncount_profiler_ranges()
    return create_selective_checkpoint_contexts(policy)


def resolve_policy(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """The op policy a ``"package.module:function"`` string names (a callable as is).

    Raises ValueError naming the string and what is wrong with it.
    """
    if callable(spec):
        return spec
    module_name, _, attr_path = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"policy {spec!r}: cannot import module {module_name!r} "
                         f"({type(exc).__name__}: {exc})") from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ValueError(f"policy {spec!r}: {module_name!r} has no {attr_path!r}") from exc
    if not callable(target):
        raise ValueError(f"policy {spec!r} is a {type(target).__name__}, not a callable "
                         "(ctx, op, *args, **kwargs) -> CheckpointPolicy")
    return target  # type: ignore[no-any-return]


@attrs.frozen
class CheckpointHow:
    """How one checkpointed block recomputes: full (with ``early_stop`` None: torch's
    setting), or selective with the built-in choices or a user's op policy."""

    mode: str = "full"
    save: tuple[str, ...] = DEFAULT_SAVE
    matmul_every: int = 1
    policy: Callable[..., Any] | None = None
    early_stop: bool | None = None


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a checkpointed block: its class's forward under checkpoint.

    Module-level (not a closure) and bound with ``types.MethodType`` so that a deepcopy
    of the block is bound to the copy, never to the original.
    """
    import torch
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    how: CheckpointHow = self.__dict__.get(HOW) or CheckpointHow(self.__dict__[MARK])
    forward = type(self).forward
    if how.mode == "selective":
        # A partial built here, not a function kept on the block: dynamo traces a
        # context_fn only as a function or a functools.partial it can see being made.
        if how.policy is not None:
            context_fn = functools.partial(policy_context_fn, how.policy)
        else:
            context_fn = functools.partial(selective_context_fn, how.save, how.matmul_every)
        return checkpoint(forward, self, *args, use_reentrant=False, context_fn=context_fn,
                          **kwargs)
    # No context_fn at all for full mode: dynamo (torch 2.13) refuses to trace
    # checkpoint(..., context_fn=noop_context_fn) ("checkpoint not implemented for
    # LazyVariableTracker context_fn"), although noop is the default.
    # Under torch.compile the partitioner decides what the compiled backward recomputes,
    # and dynamo would break the graph at set_checkpoint_early_stop (torch marks it not
    # to be traced): a compiled block leaves the setting out.
    if how.early_stop is None or torch.compiler.is_compiling():
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    # torch reads the early-stop setting when the checkpoint's forward starts (into the
    # frame its backward recomputes from), and the global one overrides the argument:
    # set around the call, it holds for this block's backward whatever encloses it.
    with set_checkpoint_early_stop(how.early_stop):
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def checkpoint_block(block: nn.Module, mode: str | CheckpointHow) -> None:
    """Make ``block`` recompute its activations in backward; names and module unchanged.

    ``mode``: ``"full"``, ``"selective"`` (saves matmul and collective outputs) or a
    :class:`CheckpointHow` for the other choices.
    """
    why = already_wrapped(block)
    if why:
        raise RuntimeError(f"cannot checkpoint {type(block).__name__}: it {why}")
    how = mode if isinstance(mode, CheckpointHow) else CheckpointHow(mode)
    object.__setattr__(block, MARK, how.mode)
    object.__setattr__(block, HOW, how)
    object.__setattr__(block, "forward", types.MethodType(_checkpointed_forward, block))


def chosen(count: int, every: int) -> list[int]:
    """Indices of the blocks ``every`` selects: the N-th, 2N-th, ... (1-based)."""
    return [i for i in range(count) if (i + 1) % every == 0]


RULES = (
    Rule("CP422", Severity.INFO, "the generation cache is off in checkpointed training",
         "nothing to do; generate() and evaluation still use the cache",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(ActivationCheckpoint())"
         ".use(MetaInit()).validate(llama_for_causal_lm)"),
    Rule("CP423", Severity.WARNING,
         "the model says it does not support gradient checkpointing",
         "check that the model trains the same with and without the plugin, or drop it",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(ActivationCheckpoint())"
         ".use(MetaInit()).validate(model_with_supports_gradient_checkpointing_false)"),
    IMPORT_STRING_RULE,
)


def caches_in_training(model: Any) -> bool:
    """Whether ``model`` (a Hugging Face model) would build a generation cache in a
    training forward: its config says ``use_cache`` and its forward takes the argument,
    by name or through ``**kwargs`` (GraniteMoe's causal LM hands those on to its inner
    model, whose forward takes it)."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                        for p in params.values())


def _no_cache_in_training(module: Any, args: Any, kwargs: Any) -> Any:
    """A training forward of a checkpointed model runs without a generation cache: the
    recomputation in backward would append every block's keys and values to it again
    (transformers' own gradient checkpointing turns it off the same way)."""
    if module.training:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _save_tuple(value: Any) -> Any:
    # One name alone reads as the list of that name; anything else goes to the validator.
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list | tuple) else value


def _check_save(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"save must be a list of names from {list(SAVABLE)}; got {value!r}")
    unknown = [v for v in value if v not in SAVABLE]
    if unknown:
        raise ValueError(f"save names {unknown}, which selective checkpointing does not know: "
                         f"it saves {list(SAVABLE)}")
    if len(set(value)) != len(value):
        raise ValueError(f"save names an output kind twice: {list(value)}")


def _check_policy(instance: Any, attribute: Any, value: Any) -> None:
    if value is None or callable(value):
        return
    if not isinstance(value, str) or not _DOTTED.fullmatch(value):
        raise ValueError(
            f"policy must be a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy or a "
            f"'package.module:function' string naming one; got {value!r}")


def _check_early_stop(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"early_stop must be true or false; got {value!r}")


@attrs.frozen
class ActivationCheckpoint(Plugin):
    """Activation checkpointing on the shared blocks (stage ``activation_checkpoint``).

    Options: ``mode`` (``"full"``: recompute each checkpointed block entirely;
    ``"selective"``: keep what ``save`` names, recompute the rest); ``every`` (checkpoint
    every N-th block; 1 = all); ``save`` (selective: ``"matmul"`` and/or ``"collectives"``
    outputs; default both, so backward issues no collective again); ``matmul_every``
    (selective: save one matmul output in N, the 1st, (N+1)-th, ...); ``policy``
    (selective: the user's op policy, a callable ``(ctx, op, *args, **kwargs) ->
    CheckpointPolicy`` or a ``"package.module:function"`` string, instead of ``save``);
    ``early_stop`` (full: stop recomputing once backward has what it needs, torch's
    default, or recompute the whole block); ``blocks`` (a module path or block class
    names; else the blocks another plugin names, else detected).
    """

    name: ClassVar[str] = "activation_checkpoint"
    needs_blocks: ClassVar[bool] = True
    rules: ClassVar[tuple[Rule, ...]] = (ALREADY_WRAPPED, *RULES)

    mode: Literal["full", "selective"] = attrs.field(
        default="full", validator=attrs.validators.in_(("full", "selective"))
    )
    every: int = int_option(1, low=1)
    blocks: str | tuple[str, ...] | None = blocks_option()
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()
    save: tuple[str, ...] = attrs.field(default=DEFAULT_SAVE, converter=_save_tuple,
                                        validator=_check_save)
    matmul_every: int = int_option(1, low=1)
    policy: str | Callable[..., Any] | None = attrs.field(default=None, validator=_check_policy)
    early_stop: bool | None = attrs.field(default=None, validator=_check_early_stop)

    def __attrs_post_init__(self) -> None:
        # Options that mean nothing in the chosen mode are refused, not ignored.
        selective_only = [f"{k}={v!r}" for k, v in (
            ("save", self.save), ("matmul_every", self.matmul_every),
            ("policy", self.policy)) if v != attrs.fields_dict(type(self))[k].default]
        if self.mode == "full" and selective_only:
            raise ValueError(
                f"{', '.join(selective_only)} choose what selective checkpointing saves, and "
                "mode='full' saves nothing inside a block: use mode='selective', or drop "
                f"{' and '.join(s.split('=')[0] for s in selective_only)}")
        if self.mode == "selective" and self.early_stop is not None:
            raise ValueError(
                "early_stop applies to mode='full' (whether its recomputation stops once "
                "backward has the tensors it needs): selective mode recomputes only what its "
                "policy does not save; drop early_stop, or use mode='full'")
        if self.policy is not None and (self.save != DEFAULT_SAVE or self.matmul_every != 1):
            raise ValueError(
                "policy decides for every op itself: save and matmul_every would be ignored; "
                "drop them, or drop policy")
        if self.mode == "selective" and not self.save and self.policy is None:
            raise ValueError(
                "save=[] saves nothing: that is full recomputation; use mode='full' (or "
                "save=['matmul'], ['collectives'] or both)")
        if self.matmul_every != 1 and "matmul" not in self.save:
            raise ValueError(
                f"matmul_every={self.matmul_every} picks which matmul outputs to save, and save "
                f"is {list(self.save)}: add 'matmul' to save, or drop matmul_every")

    def how(self, policy: Callable[..., Any] | None = None) -> CheckpointHow:
        """How the blocks recompute (``policy``: the resolved op policy, if any)."""
        if self.mode == "full":
            return CheckpointHow("full", early_stop=self.early_stop)
        return CheckpointHow("selective", self.save, self.matmul_every, policy)

    def declare(self) -> Declaration:
        # Compile (or any plugin) learns how the blocks are wrapped from this: the mode
        # names the kind (a policy or the save choices are selective checkpointing too).
        return attrs.evolve(super().declare(), checkpointing=self.mode)

    @hookimpl
    def composer_par_estimate_settings(self) -> EstimateSettings:
        if self.mode == "full":
            reissue = "all" if self.early_stop is False else "early_stop"
        else:
            # A selective policy that recomputes collectives reissues them as full
            # checkpointing does, up to the last tensor backward needs (measured).
            saved = self.policy is None and "collectives" in self.save
            reissue = "none" if saved else "early_stop"
        every_matmul = (self.matmul_every if self.mode == "selective" and self.policy is None
                        and self.matmul_every != 1 else None)
        attention = (True if self.mode == "selective" and self.policy is None
                     and "attention" in self.save else None)
        collectives = (False if self.mode == "selective" and self.policy is None
                       and "collectives" not in self.save else None)
        return EstimateSettings(activation_checkpoint=self.mode, checkpoint_every=self.every,
                                checkpoint_reissue=reissue,
                                checkpoint_matmul_every=every_matmul,
                                checkpoint_saves_attention=attention,
                                checkpoint_saves_collectives=collectives)

    @hookimpl
    def composer_par_suggest(self) -> list[SuggestAxis]:
        """No checkpointing, selective, full: from the fastest to the leanest; with a
        model-parallel dim (tensor, expert or context parallelism), between the last
        two, selective that issues the collectives again in backward instead of keeping
        their outputs (the gathered inputs are a whole sequence each under sequence
        parallelism; expert parallelism's routed pairs, two hidden states each)."""
        own = {k: v for k, v in self.options().items() if k != "mode"}
        none = SuggestChoice()
        # torch's selective checkpointing allows one recompute of a block; a schedule
        # that splits the backward recomputes it twice (CP606)
        once = frozenset({SPLIT_BACKWARD})
        selective = SuggestChoice("AC selective", {**own, "mode": "selective"}, 1,
                                  refuses=once)
        regather = SuggestChoice("AC selective save=matmul",
                                 {**own, "mode": "selective", "save": ["matmul"]}, 2,
                                 refuses=once)
        full = SuggestChoice("AC full", {**own, "mode": "full"}, 3)

        def modes(ctx: SuggestContext) -> list[SuggestChoice]:
            if any(n > 1 and ctx.roles.get(d) is Role.MODEL_PARALLEL
                   for d, n in ctx.sizes.items()):
                return [none, selective, regather, full]
            return [none, selective, full]

        return [SuggestAxis(self.name, None, 60, (1,), modes, first_fit=True)]

    @hookimpl
    def composer_par_estimate(self, layout: Any, model: Any, workload: Any,
                              stage: Any) -> EstimatePart | None:
        """The forward it runs again in backward: every checkpointed block's under full
        checkpointing; under selective, the matmuls whose outputs it does not save and
        every other op (attention among them)."""
        mode = workload.activation_checkpoint
        if stage is not None or mode not in ("full", "selective") or not model.layers:
            return None
        share = (model.layers // layout.checkpoint_every) / model.layers
        matmuls = attention = share
        if mode == "selective" and self.policy is None and "matmul" in self.save:
            # of a Llama block's 7 matmuls, the 1st, (N+1)-th, ... are saved
            saved = len(range(0, 7, max(1, layout.checkpoint_matmul_every)))
            matmuls = share * (7 - saved) / 7
        if mode == "selective" and self.policy is None and "attention" in self.save:
            attention = 0.0
        what = ("checkpointed blocks' forward" if mode == "full" else
                "checkpointed blocks' ops it does not save (attention and unsaved matmuls)"
                if attention else "checkpointed blocks' ops it does not save (unsaved "
                "matmuls)")
        return EstimatePart(compute=(ComputeTerm(f"recomputation: the {what}",
                                                 forward_share=matmuls,
                                                 attention_share=attention),))

    @hookimpl
    def composer_par_validate_model(self, model: nn.Module, blocks: list[Block]
                                    ) -> list[Finding]:
        found = wrapped_block_findings(blocks)
        name = type(model).__name__
        if getattr(model, "supports_gradient_checkpointing", True) is False:
            found.append(Finding(
                "CP423",
                f"{name}.supports_gradient_checkpointing is False: transformers does not "
                "checkpoint this model's layers (their forward may keep state between calls, "
                "which a recomputation in backward would change); the plugin checkpoints "
                "its blocks anyway",
                fix="check that the model trains the same with and without the plugin "
                "(parity), or drop the plugin"))
        if caches_in_training(model):
            found.append(Finding(
                "CP422",
                f"{name}.config.use_cache is True: its training forwards run with "
                "use_cache=False, as transformers' own gradient checkpointing does (a block "
                "recomputed in backward would append its keys and values to the generation "
                "cache a second time: a size mismatch in the first step)",
                fix="nothing to do; generate() and evaluation (model.eval()) still use the "
                "cache"))
        if blocks and not chosen(len(blocks), self.every):
            found.append(Finding(
                "CP210",
                f"every={self.every} selects none of the {len(blocks)} block(s): nothing would "
                "be checkpointed",
                fix=f"use every <= {len(blocks)} (1 checkpoints every block), or drop the plugin",
            ))
        if isinstance(self.policy, str):  # the model is built: user code may run now
            try:
                resolve_policy(self.policy)
            except ValueError as exc:
                found.append(Finding(
                    "CP210", str(exc),
                    fix=f"make {self.policy.partition(':')[0]!r} importable on every rank "
                    "(installed, or on PYTHONPATH) with a function (ctx, op, *args, **kwargs) "
                    "-> CheckpointPolicy under the name after the colon, or pass the callable "
                    "itself"))
        return found

    @hookimpl
    def composer_par_validate_plan(self) -> list[Finding]:
        """A policy string naming a package not installed here, found without importing
        anything (``composer-par validate`` without a model): CP224."""
        return import_string_findings("policy", self.policy)

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        which = "every block" if self.every == 1 else f"every {_ordinal(self.every)} block"
        return [("activation_checkpoint", f"{self.mode} checkpointing of {which}: "
                 f"{self._how_text()}")]

    def _how_text(self) -> str:
        if self.mode == "full":
            stop = {None: "", True: " (early stop on: recomputation ends once backward has "
                    "what it needs)", False: " (early stop off: the whole forward is "
                    "recomputed)"}[self.early_stop]
            return "recompute the whole block in backward" + stop
        if self.policy is not None:
            shown = self.policy if isinstance(self.policy, str) else getattr(
                self.policy, "__qualname__", repr(self.policy))
            return f"the op policy {shown} decides what is saved"
        kinds = []
        if "matmul" in self.save:
            kinds.append("matmul" if self.matmul_every == 1
                         else f"1 in {self.matmul_every} matmul")
        if "collectives" in self.save:
            kinds.append("collective")
        if "attention" in self.save:
            kinds.append("attention")
        text = f"save {' and '.join(kinds)} outputs, recompute the rest"
        if "collectives" in self.save:
            text += " (no collective issued again in backward)"
        return text

    @hookimpl
    def composer_par_activation_checkpoint(self, ctx: ApplyContext) -> str:
        policy = resolve_policy(self.policy) if self.policy is not None else None
        how = self.how(policy)
        picked = chosen(len(ctx.blocks), self.every)
        for index in picked:
            checkpoint_block(ctx.blocks[index][1], how)
        ctx.notes["checkpointed_blocks"] = [ctx.blocks[i][0] for i in picked]
        detail = f"{self.mode} checkpointing on {len(picked)} of {len(ctx.blocks)} block(s)"
        if picked and caches_in_training(ctx.model):
            ctx.model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
            detail += "; generation cache off in training forwards"
        return detail


__all__ = ["ActivationCheckpoint", "CheckpointHow", "checkpoint_block", "is_collective",
           "is_matmul", "policy_context_fn", "resolve_policy", "selective_context_fn",
           "selective_policy"]
