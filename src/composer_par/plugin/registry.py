"""Plugin discovery through the ``composer_par.plugins`` entry-point group.

The built-ins register through the same entry points as third parties. Two
environment variables narrow what is loaded (comma-separated registry names):

* ``COMPOSER_PAR_PLUGINS_ALLOW`` -- only these (the built-ins are not exempt);
* ``COMPOSER_PAR_PLUGINS_BLOCK`` -- never these.

A variable that is set names exactly the plugins it lists, after splitting at commas and
stripping blanks: set to ``""``, ``" "`` or ``","`` it lists none, so an empty
``COMPOSER_PAR_PLUGINS_ALLOW`` allows nothing and an empty ``COMPOSER_PAR_PLUGINS_BLOCK``
blocks nothing -- the same as ``Registry(allow=[])`` and ``Registry(block=[])``. Only an
unset ``COMPOSER_PAR_PLUGINS_ALLOW`` allows every installed plugin.

Loading a plugin class must not import torch: plugin modules import it lazily.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

import attrs

from composer_par.findings import did_you_mean
from composer_par.plugin.base import Plugin

GROUP = "composer_par.plugins"
ALLOW_ENV = "COMPOSER_PAR_PLUGINS_ALLOW"
BLOCK_ENV = "COMPOSER_PAR_PLUGINS_BLOCK"


class RegistryError(LookupError):
    """An unknown, blocked or broken plugin; the message says which and what to do."""


@attrs.frozen
class PluginInfo:
    name: str
    entry_point: str  # "module:Class"
    distribution: str
    version: str

    def load(self) -> type[Plugin]:
        module_name, _, attr = self.entry_point.partition(":")
        try:
            import importlib

            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as exc:  # a broken third-party plugin must not take the CLI down
            raise RegistryError(
                f"plugin {self.name!r} from {self.distribution} {self.version} failed to load "
                f"({self.entry_point}): {type(exc).__name__}: {exc}"
            ) from exc
        if not (isinstance(obj, type) and issubclass(obj, Plugin)):
            raise RegistryError(
                f"entry point {self.name!r} ({self.entry_point}) is not a Plugin subclass"
            )
        return obj


def _names(value: str | None) -> frozenset[str] | None:
    """The names a variable lists; None only when it is unset (set but empty: none)."""
    if value is None:
        return None
    return frozenset(v.strip() for v in value.split(",") if v.strip())


class Registry:
    """The plugins installed in this environment, after the allow/block lists."""

    def __init__(
        self,
        *,
        allow: Iterable[str] | None = None,
        block: Iterable[str] | None = None,
        environ: Mapping[str, str] | None = None,
        extra: Iterable[type[Plugin]] = (),
    ) -> None:
        env = os.environ if environ is None else environ
        self.allow = frozenset(allow) if allow is not None else _names(env.get(ALLOW_ENV))
        self.block = frozenset(block) if block is not None else (_names(env.get(BLOCK_ENV)) or
                                                                 frozenset())
        self._infos: dict[str, PluginInfo] = {}
        self.blocked: list[str] = []
        for ep in metadata.entry_points(group=GROUP):
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                ep.name,
                ep.value,
                dist.metadata["Name"] if dist is not None else "?",
                dist.version if dist is not None else "?",
            )
            self._add(info)
        self._classes: dict[str, type[Plugin]] = {}
        for cls in extra:  # plugins handed in directly (tests, notebooks)
            self._add(PluginInfo(cls.name, f"{cls.__module__}:{cls.__qualname__}", "(direct)", ""))
            if cls.name in self._infos:
                self._classes[cls.name] = cls

    def _add(self, info: PluginInfo) -> None:
        if info.name in self.block or (self.allow is not None and info.name not in self.allow):
            self.blocked.append(info.name)
            return
        self._infos[info.name] = info

    def names(self) -> list[str]:
        return sorted(self._infos)

    def info(self, name: str) -> PluginInfo:
        if name not in self._infos:
            if name in self.blocked:
                raise RegistryError(
                    f"plugin {name!r} is blocked by {ALLOW_ENV}/{BLOCK_ENV} in the environment"
                )
            raise RegistryError(
                f"unknown plugin {name!r}{did_you_mean(name, self._infos)}; installed: "
                f"{', '.join(self.names()) or 'none'}"
            )
        return self._infos[name]

    def get(self, name: str) -> type[Plugin]:
        if name not in self._classes:
            self._classes[name] = self.info(name).load()
        return self._classes[name]

    def describe(self) -> list[dict[str, Any]]:
        """Name, version, distribution, claimed dims and stages of every plugin."""
        rows = []
        for name in self.names():
            info = self._infos[name]
            row: dict[str, Any] = {
                "name": name,
                "version": info.version,
                "distribution": info.distribution,
                "entry_point": info.entry_point,
            }
            try:
                cls = self.get(name)
                decl = _default_declaration(cls)
                row["dims"] = [f"{c.dim} ({c.role.value})" for c in decl.claims] if decl else []
                row["stages"] = [s.label for s in cls.stages()]
                row["options"] = list(cls.option_names())
            except RegistryError as exc:
                row["error"] = str(exc)
            rows.append(row)
        return rows


def _default_declaration(cls: type[Plugin]) -> Any:
    try:
        return cls().declare()
    except TypeError:  # a plugin with required options has no default claims to show
        return None
