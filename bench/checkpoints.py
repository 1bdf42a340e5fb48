"""The test suite's checkpoint maker (`tests/checkpoints.py`), loaded by path for the benchmarks (run as scripts,
they do not have the repository root on their import path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def builder() -> Any:
    spec = importlib.util.spec_from_file_location("checkpoints", ROOT / "tests" / "checkpoints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
