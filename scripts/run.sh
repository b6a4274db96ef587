#!/usr/bin/env bash
# The main job: set up the environment if needed, then run tokenrouter on the embedded default model.
# Extra arguments go to `tokenrouter generate`.
source "$(dirname "$0")/env.sh"
exec "$VENV/bin/tokenrouter" generate "$@"
