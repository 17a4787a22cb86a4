from __future__ import annotations

import subprocess
import sys


def test_import_gpuc_does_not_import_gpu_libraries() -> None:
    code = (
        "import sys, gpuc, gpuc.tl, gpuc.pl, gpuc.get, gpuc.datasets\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'cupy', 'cupyx', 'cuml', 'faiss'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
