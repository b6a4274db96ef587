#!/usr/bin/env bash
# The routed pair with and without look-ahead (docs/DESIGN.md section 3), beside its large model alone:
# alternating fresh-server rounds through `tokenrouter bench compare`.
#
#   benchmarks/look_ahead_rounds.sh CONFIG CONCURRENCY ROUNDS OUT_PREFIX [REQUESTS]
#
# CONFIG is the pair's YAML; a copy with `launch.look_ahead: false` is written beside OUT_PREFIX. Odd
# rounds run alone, the pair, the pair without look-ahead; even rounds the reverse. Each run (REQUESTS
# arith questions of 32 tokens, default 32) appends to OUT_PREFIX_alone.jsonl, _la.jsonl or
# _nola.jsonl and prints "system tok/s mean-e2e-s p99-e2e-s".
set -euo pipefail
CONFIG=$1; C=$2; ROUNDS=$3; OUT=$(realpath -m "$4"); REQUESTS=${5:-32}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
OFF=${OUT}_no_look_ahead.yaml
"$PY" - "$CONFIG" "$OFF" <<'EOF'
import sys

import yaml

cfg = yaml.safe_load(open(sys.argv[1]))
cfg.setdefault("launch", {})["look_ahead"] = False
yaml.safe_dump(cfg, open(sys.argv[2], "w"), sort_keys=False)
EOF
one() {  # tag config system
    OMP_NUM_THREADS=1 "$HERE/.venv/bin/tokenrouter" bench compare --config "$2" --workload arith --systems "$3" \
        --concurrency "$C" --num-requests "$REQUESTS" --max-tokens 32 --out "${OUT}_$1.jsonl" >/dev/null 2>&1
    echo "$1 $(tail -1 "${OUT}_$1.jsonl" | "$PY" -c 'import json, sys; d = json.load(sys.stdin)
print(round(d["output_throughput"], 1), round(d["e2e_s"]["mean"], 2), round(d["e2e_s"]["p99"], 2))')"
}
for i in $(seq 1 "$ROUNDS"); do
    echo "round $i $(date -u +%H:%M:%S)"
    if [ $((i % 2)) = 1 ]; then
        one alone "$CONFIG" large; one la "$CONFIG" tokenrouter; one nola "$OFF" tokenrouter
    else
        one nola "$OFF" tokenrouter; one la "$CONFIG" tokenrouter; one alone "$CONFIG" large
    fi
done
