"""Per-token cost of stop-string matching.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_stop_strings.py

The matcher (tokenrouter/engine/stop_strings.py) searches only the text's tail, so a token costs the
same after 100 characters as after 100,000; the server bounds the number and length of stop strings
(--max-stop-strings 16, --max-stop-chars 256 by default), which bounds that cost. The last rows show
what an unbounded count costs per token (the issue's probe sent 700,000 stop strings).
"""

from __future__ import annotations

import random
import string
import time

from tokenrouter.engine.stop_strings import find_stop


def per_token_us(text_len: int, count: int, length: int, tokens: int = 2000) -> float:
    rng = random.Random(0)
    stops = ["".join(rng.choices(string.ascii_letters, k=length)) for _ in range(count)]
    # Digits: no stop string ever matches. The last 4 characters are the new token's text.
    text = "".join(rng.choices(string.digits, k=text_len))
    t0 = time.perf_counter()
    for _ in range(tokens):
        assert find_stop(text, 4, stops, include=False) is None
    return (time.perf_counter() - t0) / tokens * 1e6


def main() -> None:
    print(f"{'text chars':>10} {'stops':>8} {'stop chars':>10} {'us/token':>10}")
    for text_len in (100, 100_000):
        for count, length in ((1, 8), (16, 8), (16, 256)):
            print(f"{text_len:>10} {count:>8} {length:>10} {per_token_us(text_len, count, length):>10.1f}")
    print("past the default limits (refused with 400 by the server):")
    for count in (1_000, 100_000):
        print(f"{100:>10} {count:>8} {8:>10} {per_token_us(100, count, 8, tokens=20):>10.1f}")


if __name__ == "__main__":
    main()
