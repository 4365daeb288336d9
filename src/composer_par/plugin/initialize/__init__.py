"""Layout-invariant initialization, shared by every plugin that materializes a model
(MetaInit, and the loaders for the tensors their files lack).

The same seed gives bitwise the same full tensors on any mesh layout: each module,
children before parents (:func:`post_order`), is initialized by the call
:func:`initializer` picks for it, under a generator seeded from (seed, module path)
(:func:`module_seed`), with full-size scratch tensors of which each rank keeps its part
(:func:`init_module`, :func:`keep_local_part`). A parameter its initializer left
unwritten stops the materialization (:class:`UninitializedError`).

One module per job: :mod:`.lookup` (which call initializes a module), :mod:`.seeding`
(the random state), :mod:`.unwritten` (the unwritten-parameter check),
:mod:`.materialization` (``to_empty`` and the initialization walk), :mod:`.local_part`
(a rank's part of a whole tensor), :mod:`.constructed` (tensors only a constructor sets,
from the module built once on CPU). Plugins import this package inside their hooks,
never at their top (it imports torch).
"""

from composer_par.plugin.initialize.constructed import Constructions
from composer_par.plugin.initialize.local_part import keep_local_part
from composer_par.plugin.initialize.lookup import (
    InitFn,
    initializer,
    owns_tensors,
    resolve_init_fn,
    without_initializer,
)
from composer_par.plugin.initialize.materialization import (
    InitResult,
    init_children_of,
    init_module,
    materialize,
    post_order,
)
from composer_par.plugin.initialize.seeding import module_seed, rng_of
from composer_par.plugin.initialize.unwritten import UninitializedError

__all__ = [
    "Constructions",
    "InitFn",
    "InitResult",
    "UninitializedError",
    "init_children_of",
    "init_module",
    "initializer",
    "keep_local_part",
    "materialize",
    "module_seed",
    "owns_tensors",
    "post_order",
    "resolve_init_fn",
    "rng_of",
    "without_initializer",
]
