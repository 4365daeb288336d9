"""Everything a plugin author touches, in one import (placeholder; the guide follows)."""

from composer_par.findings import Finding, Report, Rule, Severity, did_you_mean
from composer_par.plugin.base import (
    PROJECT,
    STAGES,
    Claim,
    Declaration,
    Plugin,
    Role,
    Stage,
    hookimpl,
    hookspec,
)
from composer_par.plugin.comm import (
    COLLECTIVES,
    CommHook,
    CommSetup,
    GradBucket,
    GradReducer,
    InstalledCommHook,
    all_reduce_mean,
)
from composer_par.plugin.context import AppliedStep, ApplyContext
from composer_par.plugin.options import blocks_option, dim_option, ordering_option

__all__ = [
    "COLLECTIVES",
    "PROJECT",
    "STAGES",
    "AppliedStep",
    "ApplyContext",
    "Claim",
    "CommHook",
    "CommSetup",
    "Declaration",
    "Finding",
    "GradBucket",
    "GradReducer",
    "InstalledCommHook",
    "Plugin",
    "Report",
    "Role",
    "Rule",
    "Severity",
    "Stage",
    "all_reduce_mean",
    "blocks_option",
    "did_you_mean",
    "dim_option",
    "hookimpl",
    "hookspec",
    "ordering_option",
]
