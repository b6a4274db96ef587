#!/usr/bin/env bash
# The main job: set up the environment if needed, then serve the OpenAI-compatible API on the
# embedded default model at http://127.0.0.1:8000. Extra arguments go to `tokenrouter serve`.
source "$(dirname "$0")/env.sh"
exec "$VENV/bin/tokenrouter" serve "$@"
