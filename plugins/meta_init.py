"""MetaInit: ``to_empty`` on the target device, then layout-invariant initialization.

The same seed gives bitwise the same full parameters on any mesh layout and world
size. Calling ``reset_parameters`` on sharded parameters cannot give that: random ops
on a DTensor draw per local shard (on CPU every rank even draws the same numbers), so
the values would depend on the layout. Instead each module, children before parents
(as ``nn.Module.apply``), gets full-size scratch tensors for its own parameters, is
initialized under a generator seeded from (seed, module path), and each rank keeps
only its shard of the result. A rank holds one module's full parameters at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    IMPORT_STRING_RULE,
    Finding,
    Plugin,
    Rule,
    Severity,
    SuggestAxis,
    SuggestChoice,
    clean_name,
    hookimpl,
    import_string_findings,
    int_option,
)

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import ApplyContext

InitFn = Callable[["nn.Module"], None]

RULES = (
    Rule("CP404", Severity.ERROR, "a module that MetaInit cannot initialize",
         "give the module a reset_parameters() that initializes its own tensors (buffers "
         "too), or pass MetaInit(init_fn=...)",
         "class Scale(nn.Module):\n    def __init__(self, width):\n        super().__init__()\n"
         "        self.gain = nn.Parameter(torch.ones(width))  # no reset_parameters()\n\n"
         "ParallelPlan(MeshSpec()).use(MetaInit()).validate(model_holding_a_scale)"),
    IMPORT_STRING_RULE,
)


def _init_fn(value: Any) -> str | InitFn | None:
    if value is None or callable(value):
        return value
    if isinstance(value, str) and ":" in value:
        return value
    raise TypeError(f"init_fn must be a callable or 'module:function'; got {value!r}")


@attrs.frozen
class MetaInit(Plugin):
    """Materialize a meta-built model and initialize it identically on every layout.

    Options: ``seed``; ``device`` (default: the plan's device); ``init_fn`` (a callable
    or ``"module:function"`` taking one module, called children-first on each module that
    owns tensors). Without ``init_fn`` a Hugging Face model's ``_init_weights`` is used,
    as its ``post_init`` calls it: on every module, children first, those owning no
    tensors too (GPT-2's rule on each attention and MLP rescales their c_proj weights;
    the weights such a rule writes are found by a dry run over fake tensors), a tied
    parameter initialized by its first owner only, buffers such as rotary inverse
    frequencies recomputed. Else each module's ``reset_parameters()`` (or
    ``_reset_parameters()``). A module whose tensors none of these writes (and only its
    constructor sets: Apertus's XIELU activation) is built once on CPU with the
    arguments it was built with, read back from same-named attributes of it or of the
    nearest module above it (``composer_par.plugin.initialize.constructed``), and its
    tensors copied. A module that owns parameters or buffers and has none of these is
    validation error CP404.
    """

    name: ClassVar[str] = "meta_init"
    provides: ClassVar[frozenset[str]] = frozenset({"materialize"})
    rules: ClassVar[tuple[Rule, ...]] = RULES

    seed: int = int_option(0, low=0, high=2**63 - 1)
    device: str | None = None
    init_fn: str | InitFn | None = attrs.field(default=None, converter=_init_fn)

    # -- which function initializes a module --------------------------------------------

    def initializer(self, root: nn.Module) -> Callable[[nn.Module], InitFn | None]:
        """For each module, the call that initializes it, or None if there is none."""
        from composer_par.plugin.initialize import initializer

        return initializer(root, self.init_fn)

    # -- hooks -----------------------------------------------------------------------

    @hookimpl
    def composer_par_suggest(self) -> list[SuggestAxis]:
        """Every suggested plan builds its model on meta and initializes it here."""
        used = [SuggestChoice("", {"seed": self.seed, **self.options()})]
        return [SuggestAxis(self.name, None, 90, (1,), lambda ctx: used)]

    @hookimpl
    def composer_par_validate_plan(self) -> list[Finding]:
        """An init_fn string naming a package not installed here, found without importing
        anything (``composer-par validate`` without a model): CP224."""
        return import_string_findings("init_fn", self.init_fn)

    @hookimpl
    def composer_par_validate_model(self, model: nn.Module) -> list[Finding]:
        from composer_par.plugin.initialize import (
            Constructions,
            post_order,
            without_initializer,
        )

        try:
            lacking = without_initializer(model, model.modules(), self.init_fn)
        except (ImportError, AttributeError, ValueError) as exc:  # ValueError: ':f'
            return [Finding("CP404", f"init_fn {self.init_fn!r} cannot be imported: {exc}",
                            fix="give init_fn as 'importable.module:function'")]
        found: list[Finding] = []
        # A module whose constructor, called again with the same arguments, sets all its
        # tensors is initialized by building it once on CPU (a copy: nothing changes).
        paths = {id(m): p for p, m in model.named_modules()}
        built = Constructions(self.seed)
        lacking = [m for m in lacking if built.built_like(model, paths[id(m)]) is None]
        # Reported in initialization order.
        missing = {id(m) for m in lacking}
        if not missing:
            return found
        for path, module in post_order(model):
            if id(module) in missing:
                owned = [n for n, _ in module.named_parameters(recurse=False)]
                owned += [n for n, _ in module.named_buffers(recurse=False)]
                found.append(Finding(
                    "CP404",
                    f"module {clean_name(path) or '<root>'} ({type(module).__name__}) owns "
                    f"{', '.join(owned)} but has no reset_parameters(), so MetaInit cannot "
                    "initialize it",
                    fix=f"give {type(module).__name__} a reset_parameters() that initializes "
                    "its own tensors (buffers too), or pass MetaInit(init_fn=...)",
                ))
        return found

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        where = self.device or "the plan's device"
        return [("materialize", f"to_empty on {where}; initialize every module from seed "
                 f"{self.seed}, identical on any layout")]

    @hookimpl
    def composer_par_materialize(self, ctx: ApplyContext) -> str:
        import torch

        from composer_par.plugin.initialize import materialize

        device = (torch.device(self.device) if self.device
                  else ctx.parameter_device or ctx.device)
        count, peak = materialize(ctx.model, device, self.seed, self.init_fn)
        if not self.device and ctx.parameter_device not in (None, ctx.device):
            # Parameters stay where the data-parallel plugin keeps them; buffers (rotary
            # tables) are the forward's own and go to the device it runs on.
            for module in ctx.model.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = buffer.to(ctx.device)
        ctx.notes["meta_init_peak_full_bytes"] = peak
        return f"to_empty on {device}; initialized {count} module(s) with seed {self.seed}"
