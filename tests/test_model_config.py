"""What config.json the engine accepts, what it refuses (naming the field), and the attention biases each
family gets: the published Qwen2 configs load, a sliding window that is really on is refused."""

from __future__ import annotations

import pytest
import torch
from engine_utils import Logits, add, make_engine, max_logit_diff, prompts_of, run_to_end

from tokenrouter.models import build_model
from tokenrouter.models.config import ModelConfig, ModelLoadError

# The fields of released config.json files that the engine reads, plus the sliding-window ones.
QWEN25_1_5B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 1536,
    "intermediate_size": 8960, "max_position_embeddings": 32768, "max_window_layers": 21,
    "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
}
R1_DISTILL_QWEN_1_5B = dict(
    QWEN25_1_5B_INSTRUCT, max_position_embeddings=131072, rope_theta=10000, sliding_window=4096,
    tie_word_embeddings=False, use_mrope=False, eos_token_id=151643)
R1_DISTILL_QWEN_32B = dict(
    R1_DISTILL_QWEN_1_5B, hidden_size=5120, intermediate_size=27648, max_window_layers=64, num_attention_heads=40,
    num_hidden_layers=64, num_key_value_heads=8, rms_norm_eps=1e-05, rope_theta=1000000.0, sliding_window=131072,
    vocab_size=152064)
MISTRAL = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096,
}


@pytest.mark.parametrize("config", [QWEN25_1_5B_INSTRUCT, R1_DISTILL_QWEN_1_5B, R1_DISTILL_QWEN_32B],
                         ids=["qwen2.5-1.5b-instruct", "r1-distill-qwen-1.5b", "r1-distill-qwen-32b"])
def test_published_qwen2_configs_load_with_a_bias_on_qkv_only(config):
    cfg = ModelConfig.from_dict(config)
    assert cfg.architecture == "qwen2" and not cfg.qk_norm
    assert cfg.qkv_bias and not cfg.o_proj_bias
    assert cfg.head_dim == 128 and cfg.rope_scaling is None
    assert ModelConfig.from_dict({k: v for k, v in config.items() if k != "architectures"}) == cfg  # by model_type


def test_qwen2_model_has_a_bias_on_q_k_v_and_none_on_o_proj():
    cfg = ModelConfig.from_dict(dict(R1_DISTILL_QWEN_1_5B, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1))
    with torch.device("meta"):
        attn = build_model(cfg).model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.qkv_proj.bias.shape == ((4 + 2 * 2) * 16,)
    assert attn.o_proj.bias is None
    assert not hasattr(attn, "q_norm")


def test_llama_attention_bias_stays_on_all_four_projections(tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenrouter.models.random_model import build_random_model

    path = build_random_model(tmp_path / "m", "llama", "tiny", seed=4, attention_bias=True)
    cfg = ModelConfig.from_folder(path)
    assert cfg.qkv_bias and cfg.o_proj_bias
    eng = make_engine(path)
    assert eng.model.model.layers[0].self_attn.o_proj.bias is not None
    reqs = add(eng, prompts_of([3, 17], seed=2), max_tokens=4, ignore_eos=True)
    logits: Logits = {}
    run_to_end(eng, logits)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert max_logit_diff(hf, reqs, logits) <= 1e-4


@pytest.mark.parametrize("change, fields", [
    (dict(use_sliding_window=True), ["use_sliding_window", "sliding_window 4096", "7 of the 28 layers",
                                     "max_window_layers 21"]),
    (dict(use_sliding_window=True, layer_types=["full_attention"] * 27 + ["sliding_attention"]),
     ["use_sliding_window", "1 of the 28 layers", "layer_types"]),
], ids=["max_window_layers", "layer_types"])
def test_a_qwen2_sliding_window_that_is_on_is_refused_naming_the_fields(change, fields):
    with pytest.raises(ModelLoadError, match="sliding-window attention is not supported") as err:
        ModelConfig.from_dict(dict(R1_DISTILL_QWEN_1_5B, **change))
    for field in fields:
        assert field in str(err.value), (field, str(err.value))


def test_a_mistral_sliding_window_is_refused_naming_the_field():
    with pytest.raises(ModelLoadError, match="sliding_window is 4096, shorter than max_position_embeddings 32768"):
        ModelConfig.from_dict(MISTRAL)
    assert ModelConfig.from_dict(dict(MISTRAL, sliding_window=None)).architecture == "llama"
    assert ModelConfig.from_dict(dict(MISTRAL, sliding_window=32768)).architecture == "llama"  # sees everything


@pytest.mark.parametrize("use, first, window", [
    (False, 1, 8), (True, 1, 8), (True, 3, 8), (True, 0, 64), (True, 2, 63), (None, 1, 8),
])
def test_the_sliding_window_rule_is_transformers_own(use, first, window):
    """Refused exactly where transformers' Qwen2 gives some layer a window shorter than the context."""
    from transformers import Qwen2Config

    d = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 320,
         "max_position_embeddings": 64, "sliding_window": window, "max_window_layers": first}
    if use is not None:
        d["use_sliding_window"] = use
    hf = Qwen2Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    cuts = hf.sliding_window is not None and hf.sliding_window < d["max_position_embeddings"] and \
        "sliding_attention" in hf.layer_types
    try:
        ModelConfig.from_dict(d)
        refused = False
    except ModelLoadError:
        refused = True
    assert refused == cuts


@pytest.mark.parametrize("change, message", [
    (dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe"),
     "unsupported model architecture 'Qwen2MoeForCausalLM'; supported: .*Qwen2ForCausalLM"),
    (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
     "unsupported rope scaling 'yarn' in rope_scaling"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}),
     "unsupported rope scaling 'dynamic' in rope_parameters"),
], ids=["architecture", "hidden_act", "rope_scaling", "rope_parameters"])
def test_what_stays_unsupported_is_refused_naming_the_field(change, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(dict(QWEN25_1_5B_INSTRUCT, **change))
