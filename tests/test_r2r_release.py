"""R2R's published routers: a checkpoint written in thu-nics/R2R's own layout (r2r/models/router.py:
save_model's dict, HiddenStatesTokenLMHeadLogitsClassifier's parameter names and shapes) with random
weights converts to a router folder whose scores equal a reference implementation of their forward
pass, and serves as our R2R algorithm with its official threshold."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from routing_utils import Rig

from tokenrouter.cli import main
from tokenrouter.routing import make_algorithm
from tokenrouter.routing.r2r_release import convert_r2r_router
from tokenrouter.routing.routers import load_router, router_meta
from tokenrouter.runtime.messages import AddReq
from tokenrouter.sampling_params import SamplingParams

TOP_K = 16
HIDDEN_DIMS = [32, 48, 48]  # the first block changes width (a dim_change projection), the others do not
EXPANSION = 4
THRESHOLD = 0.40595959595959596  # as in their r2r_configs.json


def their_state_dict(hidden: int, embed: int, vocab: int, normalize: bool, with_embedding: bool) -> OrderedDict:
    """Random tensors under the names and shapes HiddenStatesTokenLMHeadLogitsClassifier's
    state_dict() has (its ClassifierBackbone and ClassifierBlocks included)."""
    g = torch.Generator().manual_seed(7)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    if normalize:
        sd["layer_norm_hidden_states.weight"], sd["layer_norm_hidden_states.bias"] = 1 + t(hidden), t(hidden)
        sd["layer_norm_token.weight"], sd["layer_norm_token.bias"] = 1 + t(hidden), t(hidden)
    if with_embedding:
        sd["token_embeddings.weight"] = t(vocab, embed)
    sd["logits_projection.weight"], sd["logits_projection.bias"] = t(hidden, TOP_K), t(hidden)
    sd["combined_projection.weight"] = t(HIDDEN_DIMS[0], 2 * hidden + embed)
    sd["combined_projection.bias"] = t(HIDDEN_DIMS[0])
    sd["backbone.input_projection.weight"] = t(HIDDEN_DIMS[0], HIDDEN_DIMS[0])
    sd["backbone.input_projection.bias"] = t(HIDDEN_DIMS[0])
    dims = [*HIDDEN_DIMS, HIDDEN_DIMS[-1]]
    for i in range(len(HIDDEN_DIMS)):
        p, d_in, d_out = f"backbone.blocks.{i}.", dims[i], dims[i + 1]
        sd[p + "layer_norm.weight"], sd[p + "layer_norm.bias"] = 1 + t(d_in), t(d_in)
        sd[p + "mlp.0.weight"], sd[p + "mlp.0.bias"] = t(d_in * EXPANSION, d_in), t(d_in * EXPANSION)
        sd[p + "mlp.3.weight"], sd[p + "mlp.3.bias"] = t(d_out, d_in * EXPANSION), t(d_out)
        if d_in != d_out:
            sd[p + "dim_change.weight"], sd[p + "dim_change.bias"] = t(d_out, d_in), t(d_out)
    sd["backbone.output_layer.0.weight"], sd["backbone.output_layer.0.bias"] = 1 + t(dims[-1]), t(dims[-1])
    sd["backbone.output_layer.1.weight"], sd["backbone.output_layer.1.bias"] = t(1, dims[-1]), t(1)
    return sd


def write_checkpoint(path: Path, hidden: int, vocab: int, normalize: bool = False,
                     with_embedding: bool = False) -> OrderedDict:
    """A router checkpoint as their save_model writes it: torch.save of this dict."""
    sd = their_state_dict(hidden, hidden, vocab, normalize, with_embedding)
    torch.save({
        "model_type": "HiddenStatesTokenLMHeadLogitsClassifier",
        "init_args": {"hidden_states_size": hidden, "logits_size": TOP_K, "hidden_dims": HIDDEN_DIMS,
                      "expansion_factor": EXPANSION, "dropout_rate": 0.1, "use_position_embedding": False,
                      "freeze_lm_head": True, "normalize_input": normalize,
                      "pretrained_model_name": "Qwen/Qwen3-0.6B", "dtype": torch.float32},
        "common_args": {"threshold": THRESHOLD, "input_type": ["hidden_states", "token", "logits"]},
        "model_specific_args": {},
        "state_dict": sd,
    }, path)
    return sd


def reference_scores(sd: dict[str, torch.Tensor], normalize: bool, hidden: torch.Tensor, token_emb: torch.Tensor,
                     top_logits: torch.Tensor) -> torch.Tensor:
    """Their forward pass in eval mode (r2r/models/router.py), written out op by op, then sigmoid."""
    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, sd[name + ".weight"], sd[name + ".bias"])

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), sd[name + ".weight"], sd[name + ".bias"])

    if normalize:
        hidden, token_emb = norm(hidden, "layer_norm_hidden_states"), norm(token_emb, "layer_norm_token")
        top_logits = torch.softmax(top_logits, dim=-1)
    x = lin(torch.cat([hidden, token_emb, lin(top_logits, "logits_projection")], dim=-1), "combined_projection")
    x = lin(x, "backbone.input_projection")
    for i in range(len(HIDDEN_DIMS)):
        p = f"backbone.blocks.{i}"
        residual = lin(x, p + ".dim_change") if p + ".dim_change.weight" in sd else x
        x = residual + lin(F.gelu(lin(norm(x, p + ".layer_norm"), p + ".mlp.0")), p + ".mlp.3")
    return torch.sigmoid(lin(norm(x, "backbone.output_layer.0"), "backbone.output_layer.1")).squeeze(-1)


def pair_config(path: Path) -> Path:
    """Their config/Qwen3-0.6B+Qwen3-8B.yaml (JSON text), trimmed to the sections the converter reads."""
    path.write_text(json.dumps({
        "quick": {"model_name": "Qwen3-0.6B", "model_path": "Qwen/Qwen3-0.6B"},
        "reference": {"model_name": "Qwen3-8B", "model_path": "Qwen/Qwen3-8B"},
        "router": {"router_name": "Qwen3-0.6B+Qwen3-8B", "router_path": "GY2233/Qwen3_0_6B_Qwen3_8B",
                   "override_init_args": {"pretrained_model_name": "Qwen/Qwen3-0.6B"}},
    }, indent=2))
    return path


@pytest.mark.parametrize("normalize", [False, True])
def test_scores_equal_their_forward(tmp_path, normalize):
    hidden, vocab = 40, 300
    ckpt = tmp_path / "default_router.pt"
    sd = write_checkpoint(ckpt, hidden, vocab, normalize, with_embedding=normalize)  # _all.pt keeps the embedding
    folder = convert_r2r_router(ckpt, tmp_path / "router", pair_config(tmp_path / "pair.yaml"))
    meta = router_meta(folder, "r2r")
    assert meta["threshold"] == THRESHOLD and meta["arch"]["top_k"] == TOP_K
    assert meta["pair"]["small"]["name"] == "Qwen/Qwen3-0.6B" and meta["pair"]["large"]["name"] == "Qwen/Qwen3-8B"
    router = load_router(folder, "r2r")
    g = torch.Generator().manual_seed(3)
    h, e = torch.randn(64, hidden, generator=g), torch.randn(64, hidden, generator=g)
    top = torch.randn(64, TOP_K, generator=g).sort(dim=-1, descending=True).values * 4
    with torch.no_grad():
        ours = torch.sigmoid(router.head(h, e, top))
        want = reference_scores(sd, normalize, h, e, top)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)
    assert 0.05 < float((ours >= THRESHOLD).float().mean()) < 0.95  # the check is not vacuous


class Payload:
    """An object whose unpickling runs code (it makes the folder `path`): torch.load(weights_only=True)
    refuses its global, so the code never runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_refusals(tmp_path):
    bad, ran = tmp_path / "evil.pt", tmp_path / "the-payload-ran"
    torch.save({"model_type": "HiddenStatesTokenLMHeadLogitsClassifier", "state_dict": {}, "x": Payload(ran)}, bad)
    try:
        convert_r2r_router(bad, tmp_path / "out")
        error = ""
    except Exception as e:  # noqa: BLE001 - whatever it raised, the check below comes first
        error = str(e)
    assert not ran.exists(), "reading the checkpoint ran code from its pickle"
    assert "weights_only" in error, error
    other = tmp_path / "other.pt"
    torch.save({"model_type": "LogitsClassifier", "init_args": {}, "state_dict": {}}, other)
    with pytest.raises(ValueError, match="not supported"):
        convert_r2r_router(other, tmp_path / "out")


def test_cli_converts_and_r2r_serves_it(tmp_path, pair_paths, capsys):
    hidden = json.loads((pair_paths["small"] / "config.json").read_text())["hidden_size"]
    vocab = json.loads((pair_paths["small"] / "config.json").read_text())["vocab_size"]
    ckpt = tmp_path / "router.pt"
    write_checkpoint(ckpt, hidden, vocab)
    out = tmp_path / "converted"
    assert main(["convert-router", str(ckpt), "--out", str(out), "--small", str(pair_paths["small"]),
                 "--large", str(pair_paths["large"])]) == 0
    assert f"threshold {THRESHOLD}" in capsys.readouterr().out
    alg = make_algorithm("r2r", ["small", "large"], {"router": str(out)})
    assert alg.threshold == THRESHOLD  # the official threshold is the default
    # Served by in-process subservers (binding checks both models' fingerprints); a request whose own
    # threshold is 0 sends every position to the large model, the other runs at the official one.
    rig = Rig(pair_paths, 0.0, algorithm={"name": "r2r", "router": str(out)})
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        rig.send("small", AddReq("all-large", [5, 6, 7, 8], params, seed=1, routing={"threshold": 0.0}))
        rig.send("small", AddReq("official", [5, 6, 7, 8], params, seed=1))
        rig.pump(lambda: bool(rig.finished("all-large")) and bool(rig.finished("official")), "both finished")
        assert [m for m, _, _ in rig.tokens("all-large")] == ["large"] * 6
        assert len(rig.tokens("official")) == 6
        rig.settle()  # the finish notices reach the model the request did not end on
        assert rig.small.algorithm.params_of == {} and rig.large.algorithm.params_of == {}
    finally:
        rig.close()
