"""What a process pays at start: every subserver process imports the package, so a library that only
some paths use is imported where they run, not with the module (engine/compiled_step.py imports
inductor when a compiled step is built; planner/__init__.py loads the chain, and with it scipy, on
first use). Each was 0.8-1.4 s of every process's start."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch._inductor", "torch._dynamo", "scipy.stats", "scipy.sparse")


def imported_after(statement: str) -> dict[str, bool]:
    code = f"import json, sys\n{statement}\nprint(json.dumps({{m: m in sys.modules for m in {list(HEAVY)!r}}}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_subserver_process_imports_neither_inductor_nor_scipy():
    assert imported_after("import tokenrouter.runtime.subserver.process") == dict.fromkeys(HEAVY, False)


def test_the_planners_names_still_load_on_use():
    got = imported_after("from tokenrouter.planner import Overheads, throughput_curve\n"
                         "assert callable(throughput_curve) and Overheads.__name__ == 'Overheads'")
    assert got["scipy.stats"] and not got["torch._inductor"]
