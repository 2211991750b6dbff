"""Specification of ``bench/scatter_rows.py``: XLA's CPU scatter-add timed by row width."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_prints_each_width_for_sorted_and_random_indices_with_the_ratio_to_rows_of_four():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "scatter_rows.py"), "--edges", "2000", "--rows", "300",
                           "--repeat", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("receiver-sorted", "random"):
        row = re.search(rf"^\s*{name}((?:\s+[\d.]+){{4}})\s+([\d.]+)x$", proc.stdout, flags=re.MULTILINE)
        assert row, proc.stdout
        assert len(row.group(1).split()) == 4 and float(row.group(2)) > 0
