"""A model from a Hugging Face ``config.json`` alone: no weights, no network, no code of
the user's. ``--model`` takes the file (or a model directory holding it) where it takes
``MODULE:FACTORY``, so ``validate``, ``estimate``, ``suggest`` and ``selfcheck`` run on
the models people have a directory of.

The model class is the config's first ``architectures`` entry where transformers has it,
else the causal LM transformers maps the config's ``model_type`` to; it is built in the
config's dtype (``dtype``, a bfloat16 checkpoint's), as ``from_pretrained`` would load
it. Nothing from a model directory runs here: a config that also names its repository's
own code (``auto_map``, as DeepSeek-V3's does) builds transformers' own class for its
``model_type``, and one whose ``model_type`` transformers lacks is refused (never the
interactive question transformers asks about running that code). transformers is
imported only when a config is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"


class ConfigModelError(ValueError):
    """The config cannot make a model here (the message says why and what to do)."""


def config_file(spec: str) -> Path | None:
    """The ``config.json`` that ``spec`` names (the file, or a directory holding it), or
    None where ``spec`` is no such path (a ``MODULE:FACTORY``)."""
    path = Path(spec)
    if path.is_dir() and (path / CONFIG_NAME).is_file():
        return path / CONFIG_NAME
    if path.is_file() and path.suffix == ".json":
        return path
    return None


def not_a_config(spec: str) -> str | None:
    """Why ``spec``, written as a path, names no config (None: it is not written as one)."""
    path = Path(spec)
    if path.is_dir():
        return f"{spec} is a directory without a {CONFIG_NAME}"
    if path.exists():
        return f"{spec} is not a .json file"
    if spec.endswith(".json") or "/" in spec or "\\" in spec:
        return f"{spec}: no such file or directory"
    return None


def factory_from_config(path: Path) -> Callable[[], Any]:
    """A zero-argument builder of the model ``path`` (a config.json) describes."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigModelError(f"{path} is a Hugging Face config, and building its model "
                               "needs transformers: pip install 'composer-par[hf]'") from exc
    try:
        # trust_remote_code=False: transformers would otherwise ask on stdin.
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True,
                                                         trust_remote_code=False)
    except Exception as exc:  # not a config transformers knows, or unreadable
        if _names_own_code(path):
            raise ConfigModelError(
                f"{path} is a model whose code comes with its repository (auto_map), which "
                "is not run here: give --model MODULE:FACTORY, a function that builds the "
                "model") from exc
        raise ConfigModelError(f"{path}: transformers cannot read it as a model config "
                               f"({type(exc).__name__}: {exc})") from exc
    named = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, named, None) if named else None
    dtype = getattr(config, "dtype", None)

    def build() -> Any:
        if cls is None:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                                 trust_remote_code=False)
        with _default_dtype(dtype):  # as from_config builds it
            return cls(config)

    build.__qualname__ = f"{named or config.model_type} from {path}"
    return build


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` (a torch.dtype or its name; None: left)."""
    import torch

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _names_own_code(path: Path) -> bool:
    import json

    try:
        return bool(json.loads(path.read_text()).get("auto_map"))
    except (OSError, ValueError, AttributeError):
        return False


__all__ = ["CONFIG_NAME", "ConfigModelError", "config_file", "factory_from_config",
           "not_a_config"]
