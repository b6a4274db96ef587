#!/usr/bin/env bash
# The test suite: set up the environment if needed, then run pytest. Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"

# The routing page's browser tests (tests/test_routing_page.py) drive the system's chromium through
# Playwright (never a browser Playwright downloads). Installed here when missing and we are root;
# under CI its absence is an error, elsewhere those tests skip.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing chromium for the browser tests (apt-get)" >&2
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
            >&2 || { echo "ERROR: apt-get could not install chromium, which the browser tests need" >&2; exit 1; }
        command -v chromium >/dev/null 2>&1 || { echo "ERROR: chromium is still missing after apt-get" >&2; exit 1; }
    elif [ -n "${CI:-}" ]; then
        echo "ERROR: chromium is missing and cannot be installed here (not root, or no apt-get)" >&2
        exit 1
    else
        echo "note: no chromium; the browser tests will skip (as root: apt-get install chromium)" >&2
    fi
fi

cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
