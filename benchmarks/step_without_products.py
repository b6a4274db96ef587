"""How much of an eager decode step is not the matrix products: the same generation twice, once as
served and once with every product (the 30 layers' and the head's) replaced by a result
cached per row count and weight, so the rest of the step (norms, rotary, attention, residual adds,
SiLU, scheduling, sampling) runs unchanged and the products cost nothing. Tokens of the second run
are meaningless; only its time is read.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_without_products.py --batch 8

SmolLM2-135M-Instruct (prepared once), B prompts of 16 ids, 128 greedy tokens each (EOS ignored),
the better of two runs each way.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tokenrouter.llm import LLM
from tokenrouter.models import packed_linear
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.training.default_model import ensure_smollm2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model-path", help="Hugging Face folder (default: SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model_path or str(ensure_smollm2()))
    prompts = [[100 + i + j for j in range(16)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def best_of_two() -> float:
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        return min(times) / args.tokens * 1e3

    full = best_of_two()
    real = packed_linear.linear
    cached: dict[tuple[int, int], torch.Tensor] = {}

    def once(x: torch.Tensor, weight: object, product: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = (x.shape[0], id(weight))
        if key not in cached:
            cached[key] = product()
        return cached[key]

    # every product, the head's too, goes through packed_linear.linear
    packed_linear.linear = lambda x, packed, bias: once(x, packed, lambda: real(x, packed, bias))
    try:
        rest = best_of_two()
    finally:
        packed_linear.linear = real
    print(f"batch {args.batch}: {full:.1f} ms a step as served, {rest:.1f} ms with the products cached "
          f"({100 * (full - rest) / full:.0f}% of the step is products)")


if __name__ == "__main__":
    main()
