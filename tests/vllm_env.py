"""Where the tests find vLLM: `make install` builds it in its own environment (`.venv-vllm`, the stand-in for
the engine's image), or `SHARDWISE_VLLM_PYTHON` names another interpreter that imports vllm."""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARSE = Path(__file__).with_name("vllm_parse.py")


@cache
def vllm_python() -> str | None:
    """An interpreter with vLLM, or None."""
    python = os.environ.get("SHARDWISE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        return None
    # find the package without importing it (an import of vLLM takes seconds; this runs at collection)
    probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is "
                            "None)"], cwd="/", capture_output=True, timeout=60)
    return python if probe.returncode == 0 else None


SKIP_REASON = ("vLLM is not installed: `make install` builds its environment in .venv-vllm "
               "(or set SHARDWISE_VLLM_PYTHON to an interpreter with vllm)")
