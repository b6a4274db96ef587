#!/usr/bin/env bash
# The test suite: set up the environment if needed, then run pytest. Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
