"""The client stays thin: importing it loads neither TensorFlow nor the server."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_client_loads_no_tensorflow_and_no_server() -> None:
    code = (
        "import sys, pergrad.client\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')\n"
        "       or m.startswith('pergrad.server')]\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
