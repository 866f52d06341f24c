"""Running Triton kernels on the CPU in tests: TRITON_INTERPRET=1 must be set before triton is imported, so the
cases of a test module run in ONE subprocess (`run_cases`: this pytest process, and GPU tests in it, stay
unaffected), which prints their results as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def patch_interpreter() -> None:
    """Triton 3.6's interpreter converts 1-element arrays with int(), which NumPy >= 2.4 refuses (`for i in
    range(0, n, BLOCK)` over a runtime int fails); make __index__ take the element. Call in the subprocess."""
    import numpy as np
    from triton.runtime import interpreter as _interp

    _orig = _interp._patch_lang_tensor

    def _patched(tensor, scope):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    _interp._patch_lang_tensor = _patched


def run_cases(test_file: str) -> dict:
    """Run `test_file` as a script under TRITON_INTERPRET=1 and return the JSON its last line prints."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter subprocess failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
