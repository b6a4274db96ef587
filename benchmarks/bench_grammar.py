"""Per-token cost of grammar-constrained decoding on CPU: xgrammar against outlines-core.

For each library and schema this measures, on one core:
- compile: the schema compiled against the tokenizer's vocabulary (once per request or schema);
- fill: per token, computing the allowed-token bitmask for the current state;
- apply: per token, applying it to one float32 logits row of the model's vocabulary with the
  library's own CPU kernel (fill + apply = mask: the work a grammar request adds to each step);
- advance: per token, moving the state over the committed token;
- rebuild: a fresh matcher advanced over a whole committed output (what keeping no matcher across a
  hand-off would cost), against keeping one (no cost).

The tokens are those of a valid JSON instance of the schema, tokenized by the model's tokenizer, so
every step follows a path the grammar allows.

    OMP_NUM_THREADS=1 python benchmarks/bench_grammar.py \
        --tokenizer ~/.cache/tokenrouter/models/smollm2-135m-instruct-v2 --repeats 5

Either library may be missing: its rows are skipped (install both to compare).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "enum+int": ({"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                                   "score": {"type": "integer"}},
                  "required": ["answer", "score"], "additionalProperties": False},
                 {"answer": "maybe", "score": 12345}),
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "engines", "poetry"],
         "address": {"city": "London", "zip": "W1"}}),
}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        # A fresh compiler each time: its cache would make every compile after the first free.
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def new_mask(self) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self, m: Any, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)  # its CPU kernel

    def advance(self, m: Any, tok: int) -> None:
        assert m.accept_token(tok)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        import outlines_core as oc
        from outlines_core.kernels import torch as oc_torch

        self.oc, self.kernels, self.vocab = oc, oc_torch, vocab
        # Token strings as bytes: byte-level BPE tokens map back through the GPT-2 byte alphabet.
        dec = {u: b for b, u in byte_alphabet().items()}
        tokens: dict[bytes, list[int]] = {}
        special = set(tokenizer.all_special_ids)
        for tok, i in tokenizer.get_vocab().items():
            if i == eos or i in special:
                continue
            try:
                raw = bytes(dec[c] for c in tok)
            except KeyError:
                raw = tok.encode()
            tokens.setdefault(raw, []).append(i)
        self.vocabulary = oc.Vocabulary(eos, tokens)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def new_mask(self) -> torch.Tensor:
        return self.kernels.allocate_token_bitmask(self.vocab)

    def fill(self, m: Any, bitmask: torch.Tensor) -> None:
        self.kernels.fill_next_token_bitmask(m, bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.kernels.apply_token_bitmask_inplace(logits, bitmask)  # torch.compile'd: warmed up below

    def advance(self, m: Any, tok: int) -> None:
        m.advance(tok)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def compact(instance: Any) -> str:
    # The form xgrammar emits without free whitespace (", " and ": " separators).
    return json.dumps(instance, separators=(", ", ": "))


def bench(lib: Any, schema: dict[str, Any], text_ids: list[int], vocab: int, repeats: int) -> dict[str, float]:
    compile_s = [timed(lambda: lib.compile(schema))[0] for _ in range(repeats)]
    compiled = lib.compile(schema)
    bitmask = lib.new_mask()
    row = torch.randn(1, vocab)
    lib.apply(row.clone(), bitmask)  # warm-up (outlines-core's kernel compiles on first use)
    fill_s, apply_s, adv_s = [], [], []
    for _ in range(repeats):
        m = lib.matcher(compiled)
        for tok in text_ids:
            logits = row.clone()
            t0 = time.perf_counter()
            lib.fill(m, bitmask)
            t1 = time.perf_counter()
            lib.apply(logits, bitmask)
            t2 = time.perf_counter()
            lib.advance(m, tok)
            t3 = time.perf_counter()
            fill_s.append(t1 - t0)
            apply_s.append(t2 - t1)
            adv_s.append(t3 - t2)
            assert torch.isfinite(logits[0, tok]), f"{lib.name}: the instance's token {tok} was masked"

    def rebuild() -> None:
        m = lib.matcher(compiled)
        for tok in text_ids:
            lib.advance(m, tok)

    rebuild_s = [timed(rebuild)[0] for _ in range(repeats)]
    med = statistics.median
    return {"compile_ms": med(compile_s) * 1e3, "fill_us": med(fill_s) * 1e6, "apply_us": med(apply_s) * 1e6,
            "mask_us": med([f + a for f, a in zip(fill_s, apply_s)]) * 1e6, "advance_us": med(adv_s) * 1e6,
            "rebuild_ms": med(rebuild_s) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a local Hugging Face tokenizer folder")
    ap.add_argument("--vocab-size", type=int, default=None, help="the logits width (default: the model config's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--libraries", default="xgrammar,outlines-core")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    vocab = args.vocab_size or AutoConfig.from_pretrained(args.tokenizer, local_files_only=True).vocab_size
    eos = tok.eos_token_id
    libs = {"xgrammar": XGrammar, "outlines-core": OutlinesCore}
    print(f"tokenizer {args.tokenizer}, logits width {vocab}, torch threads 1, repeats {args.repeats}")
    print(f"{'library':<14}{'schema':<10}{'tokens':>7}{'compile ms':>12}{'fill us':>9}{'apply us':>10}"
          f"{'mask us':>9}{'advance us':>12}{'rebuild ms':>12}")
    results: dict[tuple[str, str], dict[str, float]] = {}
    for lib_name in args.libraries.split(","):
        try:
            lib = libs[lib_name](tok, vocab, eos)
        except ImportError as e:
            print(f"{lib_name:<14}not installed ({e})")
            continue
        for sname, (schema, instance) in SCHEMAS.items():
            ids = tok.encode(compact(instance), add_special_tokens=False)
            r = bench(lib, schema, ids, vocab, args.repeats)
            results[lib_name, sname] = r
            print(f"{lib_name:<14}{sname:<10}{len(ids):>7}{r['compile_ms']:>12.1f}{r['fill_us']:>9.1f}"
                  f"{r['apply_us']:>10.1f}{r['mask_us']:>9.1f}{r['advance_us']:>12.1f}{r['rebuild_ms']:>12.3f}")
    for sname in SCHEMAS:
        a, b = results.get(("outlines-core", sname)), results.get(("xgrammar", sname))
        if a and b:
            print(f"{sname}: outlines-core / xgrammar: fill {a['fill_us'] / b['fill_us']:.2f}x, "
                  f"mask {a['mask_us'] / b['mask_us']:.2f}x, compile {a['compile_ms'] / b['compile_ms']:.2f}x")


if __name__ == "__main__":
    main()
