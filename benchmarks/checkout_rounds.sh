#!/usr/bin/env bash
# Two checkouts served side by side: alternating fresh-server rounds of the routed pair and its large
# model alone, each checkout's code in its own server, through `tokenrouter bench compare`.
#
#   benchmarks/checkout_rounds.sh BASE_DIR CONFIG CONCURRENCY ROUNDS OUT_PREFIX [REQUESTS]
#
# BASE_DIR is another checkout (e.g. `git worktree add /tmp/base COMMIT`); it runs from its own folder
# with PYTHONPATH on it, so this repository's editable install does not shadow it; "new" is this
# checkout. Odd rounds run base large, base pair, new large, new pair; even rounds the reverse. Each
# run (REQUESTS arith questions of 32 tokens, default 32) appends to OUT_PREFIX_base.jsonl or
# OUT_PREFIX_new.jsonl and prints "checkout system tok/s".
set -euo pipefail
BASE=$(cd "$1" && pwd); CONFIG=$2; C=$3; ROUNDS=$4; OUT=$(realpath -m "$5"); REQUESTS=${6:-32}
HERE=$(cd "$(dirname "$0")/.." && pwd)
one() {  # checkout system
    local dir=$HERE pp=""
    if [ "$1" = base ]; then dir=$BASE; pp=$BASE; fi
    (cd "$dir" && PYTHONPATH=$pp OMP_NUM_THREADS=1 "$HERE/.venv/bin/tokenrouter" bench compare --config "$CONFIG" \
        --workload arith --systems "$2" --concurrency "$C" --num-requests "$REQUESTS" --max-tokens 32 \
        --out "${OUT}_$1.jsonl" >/dev/null 2>&1)
    echo "$1 $2 $(tail -1 "${OUT}_$1.jsonl" | "$HERE/.venv/bin/python" -c 'import json, sys; print(round(json.load(sys.stdin)["output_throughput"], 1))')"
}
for i in $(seq 1 "$ROUNDS"); do
    echo "round $i $(date -u +%H:%M:%S)"
    if [ $((i % 2)) = 1 ]; then
        one base large; one base tokenrouter; one new large; one new tokenrouter
    else
        one new tokenrouter; one new large; one base tokenrouter; one base large
    fi
done
