"""The project's scripts (scripts/*.py, scripts/gpu/*.py) are files, not a package: tests load one as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script(relative: str):
    """scripts/NAME.py (a path under the repository) as a module named NAME, registered in sys.modules: a script's
    dataclasses look their module up while the class is made."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
