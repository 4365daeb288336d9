"""Option helpers: attrs fields that validate what a plan file hands a plugin.

Plan files pass any TOML value, so each helper checks its type and names the option
in the error (the plan reports it as CP210 / CP506).
"""

from __future__ import annotations

from typing import Any

import attrs

from composer_par.dtypes import CANONICAL, DtypeError, dtype_name, optional_dtype_name
from composer_par.findings import Finding, Rule, Severity


def _plugin_names(value: Any) -> tuple[str, ...]:
    """``after = "meta_init"`` means one name, not its letters."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"after/before take a plugin name or a list of them; got {value!r}")
    return tuple(value)


def ordering_option() -> Any:
    """An ``after`` / ``before`` option: plugin names to run after / before in a stage.

    Plan files hand in any TOML value, so a wrong type fails here, naming the option.
    """
    return attrs.field(default=(), converter=_plugin_names)


def _mesh_dim_name(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"{attribute.name} must be a mesh dim name; got {value!r}")


def dim_option(default: str) -> Any:
    """A ``dim`` option: the mesh dim the plugin claims (whether the mesh has it is CP203)."""
    return attrs.field(default=default, validator=_mesh_dim_name)


def _block_names(value: Any) -> str | tuple[str, ...] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(
        f"blocks must be a module path or a non-empty list of class names; got {value!r}"
    )


def blocks_option() -> Any:
    """A ``blocks`` option: a module path (``"layers"``) or block class names
    (``["DecoderLayer"]``); None lets the shared block finder detect them."""
    return attrs.field(default=None, converter=_block_names)


class OptionError(TypeError, ValueError):
    """An option value of the wrong type or out of range; the message names the option.

    Both a TypeError and a ValueError, as attrs' own validators raise either.
    """


def _int_between(low: int | None, high: int | None) -> Any:
    if low is not None and high is not None:
        wanted = f"an int in [{low}, {high}]"
    elif low is not None:
        wanted = f"an int >= {low}"
    elif high is not None:
        wanted = f"an int <= {high}"
    else:
        wanted = "an int"

    def check(instance: Any, attribute: Any, value: Any) -> None:
        # bool is an int in Python; `every = true` in a plan file is a mistake, not 1.
        if (isinstance(value, bool) or not isinstance(value, int)
                or (low is not None and value < low) or (high is not None and value > high)):
            raise OptionError(f"{attribute.name} must be {wanted}; got {value!r}")

    return check


def int_option(default: int, *, low: int | None = None, high: int | None = None) -> Any:
    """An int option within ``[low, high]`` (either bound may be left open).

    Refuses bools and floats: ``every = true`` or ``rank = 2.0`` fail, naming the option.
    """
    return attrs.field(default=default, validator=_int_between(low, high))


def _number_to_float(value: Any) -> Any:
    # bool is an int in Python: left as it is, for the check to refuse.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _positive_finite(instance: Any, attribute: Any, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, float) or not value > 0:  # NaN is not > 0
        raise OptionError(f"{attribute.name} must be a number > 0 or None; got {value!r}")
    if value == float("inf"):
        raise OptionError(f"{attribute.name} must be finite; got inf")


def positive_number_option() -> Any:
    """An optional number option (None: unset), stored as a float: finite and > 0.

    Refuses bools, strings, NaN and infinity, naming the option (a gradient divide factor
    of ``inf`` would zero every gradient, silently)."""
    return attrs.field(default=None, converter=_number_to_float, validator=_positive_finite)


def _true_or_false(instance: Any, attribute: Any, value: Any) -> None:
    # Not bool(value): 0, 1 and "false" would silently mean something.
    if not isinstance(value, bool):
        raise OptionError(f"{attribute.name} must be true or false; got {value!r}")


def bool_option(default: bool) -> Any:
    """A true/false option; 0, 1 and strings such as ``"yes"`` are refused."""
    return attrs.field(default=default, validator=_true_or_false)


def dtype_option(default: str | None = None) -> Any:
    """A floating-point dtype option, stored by its canonical name (``"bfloat16"``).

    Takes every spelling of :mod:`composer_par.dtypes` (``"bf16"``, ``"BF16"``, ``"fp32"``,
    ``torch.bfloat16``, ...); None means unset. A bad value fails naming the option.
    """
    return attrs.field(default=default, converter=_canonical_dtype, validator=_known_dtype)


def _canonical_dtype(value: Any) -> Any:
    # A converter is not told the option's name: a bad value passes through unchanged
    # for the validator, which is, to refuse.
    try:
        return optional_dtype_name(value)
    except DtypeError:
        return value


def _known_dtype(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and value not in CANONICAL:
        try:
            dtype_name(value)
        except DtypeError as exc:
            raise OptionError(f"{attribute.name}: {exc}") from None


# A plan-level finding of the plugins that take a "module:function" option: a warning,
# since the package may be installed where the job runs and not where it is validated.
IMPORT_STRING_RULE = Rule(
    "CP224", Severity.WARNING,
    "a 'module:function' option names a package not installed here",
    "install the package where you validate too; or, if it is installed on the machines "
    "the job runs on, nothing to do: validating with the model imports it and refuses "
    "the plan if it does not import",
    "ParallelPlan(MeshSpec()).use(ActivationCheckpoint(mode=\"selective\", "
    "policy=\"my_policies:save_attention\")).validate()")


def import_string_problem(spec: str) -> str | None:
    """Why a ``"package.module:function"`` option cannot name anything installed here,
    found without importing it (None: it may; importing it is the only full check).

    For the plan-level hooks, which run without a model, on a laptop, and must not run
    user code (which may import torch): the top-level package is looked up, not
    imported."""
    import importlib.util

    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr or not all(
            part.isidentifier() for part in (*module_name.split("."), *attr.split("."))):
        return f"{spec!r} is not 'package.module:function'"
    top = module_name.split(".", 1)[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    if found is None:
        return f"{spec!r}: no module {top!r} is installed here (or on the path)"
    return None


def import_string_findings(option: str, spec: Any) -> list[Finding]:
    """The plan-level finding on a ``"module:function"`` option (nothing for a callable, or
    for a package found here): CP224, a warning."""
    problem = import_string_problem(spec) if isinstance(spec, str) else None
    if problem is None:
        return []
    return [Finding("CP224", f"{option} {problem}: it is imported when the plan is "
                    "validated with the model, and applied", fix=IMPORT_STRING_RULE.fix)]
