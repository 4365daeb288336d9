"""transformers is an optional extra (``composer-par[hf]``): nothing in composer_par
imports it, at import time or while validating and applying a plan to a model that is
not a transformers model. Each check runs in a fresh interpreter, whose ``sys.modules``
says what was imported."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def test_transformers_is_the_hf_extra_and_a_test_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    assert any(d.startswith("transformers") for d in extras["hf"])
    assert any(d.startswith("transformers") for d in extras["test"])
    assert not any(d.startswith("transformers") for d in project["dependencies"])


# The modules that subclass a trainer's classes import that trainer (lightning imports
# transformers); their adapters (composer_par.integrations.hf_trainer, .lightning) import
# them only when a class is first asked for.
TRAINER_CLASS_MODULES = ["composer_par.integrations._plan_trainer",
                         "composer_par.integrations._fabric_strategy",
                         "composer_par.integrations._trainer_strategy"]


def test_importing_every_module_imports_no_transformers() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import composer_par, composer_par.plugins\n"
        f"skip = {TRAINER_CLASS_MODULES!r}\n"
        "for pkg in (composer_par, composer_par.plugins):\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        # __main__ runs the command line\n"
        "        if not info.name.endswith('__main__') and info.name not in skip:\n"
        "            importlib.import_module(info.name)\n"
        "assert 'composer_par.plugins.tp.auto' in sys.modules\n"
        "assert 'composer_par.integrations.hf_trainer' in sys.modules\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    _run(code)


def test_tp_auto_on_a_model_without_transformers_imports_none() -> None:
    # The torchtitan-named Llama of composer_par.models: TP(plan="auto") recognizes its
    # names; transformers is looked at only for a transformers model.
    code = (
        "import sys, torch\n"
        "from composer_par import MeshSpec, MetaInit, ParallelPlan, TP, FSDP2\n"
        "from composer_par.testing.tasks import llama\n"
        "with torch.device('meta'):\n"
        "    model = llama.build()\n"
        "plan = ParallelPlan(MeshSpec(dp_shard=2, tp=2)).use(FSDP2()).use(TP())"
        ".use(MetaInit())\n"
        "report = plan.validate(model, world_size=4)\n"
        "assert report.ok, report.format()\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    _run(code)
