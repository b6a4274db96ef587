"""Importing tokenrouter gives torch's large CPU blocks transparent huge pages (tokenrouter/__init__.py),
unless the user set THP_MEM_ALLOC_ENABLE: a fresh interpreter, a weight-sized tensor, its pages counted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_PROBE = """
import re
import tokenrouter, torch
x = torch.empty(64 * 2 ** 20 // 4)
x.fill_(1.0)
rollup = open('/proc/self/smaps_rollup').read()
print(re.search(r'AnonHugePages:\\s+(\\d+)', rollup).group(1))
"""


def _huge_kib(env_value: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _MODE.exists() or "[madvise]" not in _MODE.read_text(),
                    reason="the kernel gives huge pages only where asked (madvise) on this check")
def test_import_gives_large_blocks_huge_pages_and_a_users_value_stands() -> None:
    assert _huge_kib(None) >= 32 * 1024  # half the tensor, at least, in 2 MiB pages
    assert _huge_kib("0") == 0
