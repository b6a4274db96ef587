"""Random-weight Hugging Face model folders, built offline and deterministically from a seed.

Used for the embedded default model (until a trained pair exists), the tests and the benchmarks. The
folder is a real checkpoint (config.json, model.safetensors, tokenizer.json, generation_config.json)
written by transformers, so loading it exercises the same path as a downloaded model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

# A byte-level tokenizer (every byte a token, no merges): any text encodes, multi-byte characters span
# several tokens, and it needs no training data.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PRESETS: dict[str, dict[str, Any]] = {
    # For tests: builds and runs in milliseconds.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=512),
    # The embedded default until the trained pair exists: about 3M parameters.
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=320, max_position_embeddings=2048),
    # The engine benchmark: about 30M parameters.
    "30m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048),
}


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_random_model(folder: str | Path, arch: str = "llama", preset: str = "tiny", seed: int = 0,
                       **overrides: Any) -> Path:
    """Write a random-weight model of the given family ("llama", "qwen2" or "qwen3") to folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    folder = Path(folder)
    tokenizer = build_tokenizer()
    kw = dict(PRESETS[preset], **overrides)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kw.setdefault("bos_token_id", eos)
    kw.setdefault("eos_token_id", eos)
    if arch == "llama":
        kw.setdefault("rope_theta", 10000.0)
        cfg, cls = LlamaConfig(**kw), LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = Qwen2Config(**kw), Qwen2ForCausalLM
    elif arch == "qwen3":
        kw.setdefault("head_dim", 2 * kw["hidden_size"] // kw["num_attention_heads"])
        kw.setdefault("tie_word_embeddings", True)
        cfg, cls = Qwen3Config(**kw), Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown architecture {arch!r}: llama, qwen2 or qwen3")
    torch.manual_seed(seed)
    model = cls(cfg)
    # The default init draws weights with std 0.02, which makes every logit nearly equal; a wider
    # spread gives distinct greedy choices, so exactness tests are meaningful. Biases start at zero,
    # where a misplaced or missing one would go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=eos)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
