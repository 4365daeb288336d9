"""What every importer does with a key it does not know (CP912)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from composer_par.findings import did_you_mean
from composer_par.migrate.draft import Draft


def unknown_key(draft: Draft, key: str, value: Any, known: Iterable[str]) -> None:
    """CP912: ``key`` is none the importer knows; the plan goes on without it."""
    leaf = key.rpartition(".")[2]
    draft.find("CP912", key, value, f"not a setting the importer knows"
               f"{did_you_mean(leaf, sorted(set(known)))}; the plan leaves it out",
               f"check the spelling against the {draft.tool} documentation; a setting of a "
               "newer release may need a newer composer-par")
