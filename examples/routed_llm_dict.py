"""A routed pair built in code: RoutedLLM takes the group config as a dict of the YAML files' shape
(examples/*.yaml), so a program can assemble it from its own settings.

    python examples/routed_llm_dict.py SMALL_FOLDER LARGE_FOLDER [--router ROUTER_FOLDER] [--device cuda:0]

With --router (a folder from `tokenrouter convert-router` or `tokenrouter train-router`) R2R routes
the pair at the router's threshold; without, the Bernoulli router hands each position to the large
model with probability 0.1 and needs no router. To try it on the CPU, a tiny random pair (its text is
nonsense; the routing is real):

    python -c "from tokenrouter.models.random_model import build_random_model as b; \\
               b('/tmp/tokenrouter-tiny/small', seed=1); b('/tmp/tokenrouter-tiny/large', seed=2, hidden_size=128)"
    python examples/routed_llm_dict.py /tmp/tokenrouter-tiny/small /tmp/tokenrouter-tiny/large
"""

from __future__ import annotations

import argparse
from typing import Any

from tokenrouter import SamplingParams
from tokenrouter.routed_llm import RoutedLLM

PROMPTS = ["The capital of France is", "Two plus two equals"]


def group(small: str, large: str, router: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """The group config: a model list and an algorithm, as in a YAML file (a misspelt field is an
    error that names it)."""
    return {
        "name": "pair-in-code",
        "models": [
            {"name": "small", "path": small, "device": device, "kv_cache_tokens": 8192},
            {"name": "large", "path": large, "device": device, "kv_cache_tokens": 8192},
        ],
        "algorithm": {"name": "r2r", "router": router} if router else {"name": "bernoulli", "p": 0.1},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("small", help="the small model's folder")
    parser.add_argument("large", help="the large model's folder (same tokenizer)")
    parser.add_argument("--router", default=None, help="an R2R router folder; without one, Bernoulli routing")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:N for both models")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    with RoutedLLM(group(args.small, args.large, args.router, args.device)) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)
        run = llm.last_run
    print(f"routed by {llm.config.algorithm}")
    for out in outputs:
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
        print(f"  tokens by model {out.extra['tokens_per_model']}, hand-offs {out.extra['handoffs']}")
    assert run is not None
    print(f"all prompts: tokens by model {run.tokens_per_model}, hand-offs {run.handoffs}, {run.wall_seconds:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
