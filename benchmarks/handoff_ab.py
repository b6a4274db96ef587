"""SmolLM2's batch-1 decode step with and without the bfloat16 hand-off between the quantized products
and the fused ops, and with its Q8_0 head screened as two int4 nibble planes or as int8 per channel.

Question: what do the two choices in tokenrouter/models/llama.py (`DecoderLayer.fused_forward`'s
bfloat16 path, `quantize_linear_weights`' head form) save a token at one row?

One engine on SmolLM2's folder (its GGUF blocks as stored, `--threads` torch threads); each of the four
combinations is switched in place (the flat layers' quantized weights, the head screen's form), and
rounds run them in rotated order: `--tokens` greedy tokens from a 16-id prompt each, EOS ignored.
Prints the median and best milliseconds a token per combination.

    .venv/bin/python benchmarks/handoff_ab.py --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenrouter.llm import LLM
from tokenrouter.models import quantized_linear
from tokenrouter.models.gguf_weights import GGUF_FILE, read_gguf
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.training.default_model import ensure_smollm2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_smollm2()
    llm = LLM(str(path))
    model = llm.engine.model
    head = model.lm_head_screened
    assert head is not None, "the screened head needs the skinny kernel (a C compiler)"
    source = read_gguf(path / GGUF_FILE, model.config)["model.embed_tokens.weight"]
    forms = {}
    for name, (quantized, blocks) in {"two planes": (quantized_linear.from_blocks(source), source),
                                      "int8": (quantized_linear.int8_per_channel(head.weight), None)}.items():
        head.add_quantized(quantized, blocks)
        forms[name] = (head.quantized, head.quantized_bounds)
    flats = [layer.flat for layer in model.model.layers]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    combos = [(h, b) for h in forms for b in (False, True)]

    def run(combo: tuple[str, bool], r: int) -> float:
        head.quantized, head.quantized_bounds = forms[combo[0]]
        for layer, flat in zip(model.model.layers, flats):
            layer.flat = flat if combo[1] else flat._replace(quantized=None)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=[[100 + r + j for j in range(16)]], sampling_params=params, use_tqdm=False)
        return (time.perf_counter() - start) / args.tokens * 1e3

    for combo in combos:
        run(combo, 0)
    times: dict[tuple[str, bool], list[float]] = {c: [] for c in combos}
    for r in range(args.rounds):
        for combo in combos[r % len(combos):] + combos[:r % len(combos)]:
            times[combo].append(run(combo, r))
    print(f"SmolLM2 alone, one row, {args.threads} threads, {args.tokens} tokens, {args.rounds} rounds (ms a token)")
    for (h, b), t in times.items():
        print(f"  head {h:10s}  hand-off {'bfloat16' if b else 'float32 '}  median {statistics.median(t):.2f}  "
              f"best {min(t):.2f}")


if __name__ == "__main__":
    main()
