#!/usr/bin/env bash
# The GPU check, in one run of under 10 minutes on one CUDA GPU:
#   1. the CUDA parity tests (our logits against transformers on CUDA, float32 and bfloat16),
#   2. CUDA graph capture: graphs against the eager step (same greedy tokens, logits within 1e-4,
#      every bucket, a padded one, prefix hits, preemption, a PENDING request, catch-ups), and no
#      eager step reaching cuDNN's attention,
#   3. the default pair's shapes on the GPU: the routed pair against its large model alone through
#      the entry at concurrency 1, 8 and 32 (benchmarks/gpu_pair.py),
#   4. decode tok/s of a Qwen3-0.6B-shaped random model in bfloat16 at batch 1, 8, 32 and 64,
#      eager against CUDA graphs, with the capture time.
# Steps 1-3 keep going after a failure; the script exits 1 at the end if any failed.
# Usage (from the repository root, with the project installed in .venv):
#   bash benchmarks/gpu_check.sh            # PY=/path/to/python to use another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())"

echo "== 1-2. CUDA parity and graph capture tests"
failed=()
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_model_parity.py tests/test_compiled_step.py \
    tests/test_attention_backend.py -k cuda -rs || failed+=("tests: exit $?")

echo "== 3. the default pair's shapes: routed pair against the large model alone"
timeout 200 "$PY" benchmarks/gpu_pair.py --device cuda:0 --concurrency 1 8 32 || failed+=("pair: exit $?")

echo "== 4. decode benchmark, Qwen3-0.6B-shaped random model, bfloat16"
timeout 120 "$PY" - <<'EOF'
import tempfile, time
import torch
from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.models.random_model import build_random_model
from tokenrouter.sampling_params import SamplingParams

folder = build_random_model(tempfile.mkdtemp(), "qwen3", "30m", seed=0, hidden_size=1024, intermediate_size=3072,
                            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                            vocab_size=151936, max_position_embeddings=4096)
prompt_len, output_len = 128, 128
for eager in (True, False):
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model_path=str(folder), device="cuda", dtype="bfloat16", max_running_requests=64,
                              kv_cache_tokens=64 * 512, chunked_prefill_size=8192, disable_cuda_graph=eager, load_tokenizer=False))
    mode = "eager" if eager else "cuda-graph"
    print(f"{mode}: engine start {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(0)
    for bs in (1, 8, 32, 64):
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        for _ in range(bs):
            eng.add_request(torch.randint(3, 151936, (prompt_len,), generator=g).tolist(), params)
        eng.step()  # the prefill
        torch.cuda.synchronize()
        t0, n = time.perf_counter(), 0
        while eng.has_unfinished():
            n += len(eng.step().updated)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"{mode} batch {bs:>2}: {n / dt:8.1f} tok/s decode ({dt / (n / bs) * 1e3:.2f} ms/step)", flush=True)
EOF
if ((${#failed[@]})); then
    echo "== failed: ${failed[*]}"
    exit 1
fi
echo "== done"
