"""python -m ferry.bench runs and reports what it measured."""

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bench_reports_each_point(transport):
    out = subprocess.run(
        [sys.executable, "-m", "ferry.bench", "--transport", transport, "--sizes", "4K,1M",
         "--seconds", "0.2", "--no-reference", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["op"], r["block_bytes"]) for r in rows] == [
        ("write", 4096), ("read", 4096), ("write", 1 << 20), ("read", 1 << 20)
    ]
    assert all(r["transport"] == transport and r["gbps"] > 0 for r in rows)
    assert rows[0]["depth"] == 2 and rows[2]["depth"] == 32


def test_bench_help_and_bad_flags():
    h = subprocess.run([sys.executable, "-m", "ferry.bench", "--help"], capture_output=True, text=True)
    assert h.returncode == 0 and "writev_async" in h.stdout
    bad = subprocess.run([sys.executable, "-m", "ferry.bench", "--sizes", "4Q"], capture_output=True, text=True)
    assert bad.returncode == 2 and "4Q" in bad.stderr
