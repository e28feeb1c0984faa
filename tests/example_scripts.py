"""The example scripts (``examples/*.py``) as modules, for tests that call their functions on
thread ranks. Importable from every folder under ``tests/``: ``tests/conftest.py`` puts this
folder on ``sys.path``."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str) -> ModuleType:
    """``examples/<name>.py``, imported once per process under its own name."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
