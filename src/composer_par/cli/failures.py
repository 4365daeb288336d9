"""Whose code failed: composer_par's, an installed plugin's, or the user's model code.

An exception the CLI did not expect is a bug somewhere; the message should send the
reader to the right place. The frames of its traceback are walked from the outermost
in: each frame belongs to composer_par (core and built-in plugins), to a third-party
plugin (a module of a distribution registered in the plugin entry-point group), to the
user's model code (``--model MODULE:FACTORY``), or to none of them (the standard
library, torch, ...). The innermost frame that belongs to one of the three names the
culprit: a plugin that passes bad arguments to torch is that plugin's bug, even though
the exception is raised inside torch.
"""

from __future__ import annotations

import traceback
from importlib import metadata

import attrs

COMPOSER_PAR = "composer_par"


@attrs.frozen
class Culprit:
    """``kind`` is "composer_par", "plugin" or "user"; ``module`` the innermost module of
    it in the traceback; ``plugin`` and ``distribution`` name a third-party plugin."""

    kind: str
    module: str
    plugin: str = ""
    distribution: str = ""

    def describe(self) -> str:
        if self.kind == "plugin":
            where = f"module {self.module}" + (f", distribution {self.distribution}"
                                               if self.distribution else "")
            return f"the plugin {self.plugin!r} ({where})"
        if self.kind == "user":
            return f"the model code (module {self.module})"
        return "composer_par"


def _top(module: str) -> str:
    return module.partition(".")[0]


def third_party_plugins() -> dict[str, tuple[str, str]]:
    """Top-level package -> (plugin name, distribution) of every plugin entry point that
    is not composer_par's own."""
    from composer_par.plugin.registry import GROUP

    found: dict[str, tuple[str, str]] = {}
    try:
        entry_points = list(metadata.entry_points(group=GROUP))
    except Exception:  # broken metadata must not hide the failure being reported
        return found
    for ep in entry_points:
        top = _top(ep.value.partition(":")[0].strip())
        if not top or top == COMPOSER_PAR:
            continue
        dist = getattr(ep, "dist", None)
        found.setdefault(top, (ep.name, dist.name if dist is not None else ""))
    return found


def culprit(exc: BaseException, *, user_module: str | None = None) -> Culprit:
    """The owner of the innermost frame of ``exc``'s traceback that belongs to
    composer_par, to a third-party plugin or (when given) to ``user_module``'s package;
    composer_par when no frame belongs to any of them."""
    plugins = third_party_plugins()
    # The model's siblings are the user's code too: "pkg.models:build" may call pkg.layers.
    user_package = (user_module.rpartition(".")[0] or user_module) if user_module else None
    found = Culprit("composer_par", COMPOSER_PAR)
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        module = str(frame.f_globals.get("__name__", ""))
        top = _top(module)
        if user_package is not None and (module in (user_module, user_package)
                                         or module.startswith(user_package + ".")):
            found = Culprit("user", module)
        elif top == COMPOSER_PAR:
            found = Culprit("composer_par", module)
        elif top in plugins:
            name, dist = plugins[top]
            found = Culprit("plugin", module, name, dist)
    return found


def summary(exc: BaseException) -> str:
    """``Type: message`` on one line (``Type`` alone when there is no message)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


__all__ = ["Culprit", "culprit", "summary", "third_party_plugins"]
