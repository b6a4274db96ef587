"""R2R's six published routers, each built here as its release lays it out, with random weights, and
converted by `tokenrouter convert-router`.

Each layout is thu-nics/R2R's own: the pair config (config/SMALL+LARGE.yaml), the checkpoint dict
r2r/models/router.py save_model writes, with the init_args and common_args that
resource/default_training_config*.json train with, HiddenStatesTokenLMHeadLogitsClassifier's
state_dict keys (in its registration order) and shapes at the real sizes, and the file where the
release is downloaded to (README.md: default_router.pt from nics-efc/R2R_router, one folder per pair
in nics-efc/R2R_router_collections). Every release converts and scores as their forward pass does; the
DeepSeek-R1-Distill-Qwen pair's router (a Qwen2-architecture pair) and Qwen3-0.6B+Qwen3-8B's serve on
tiny models of their small model's geometry, each token's writer the one its score decides.
"""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from routing_utils import Rig

from tokenrouter.cli import main
from tokenrouter.models.random_model import build_random_model
from tokenrouter.routing.r2r_release import DEFAULT_SMALL, convert_r2r_router, find_release
from tokenrouter.routing.routers import load_router, router_meta
from tokenrouter.runtime.messages import AddReq, Tokens
from tokenrouter.sampling_params import SamplingParams

MODEL_TYPE = "HiddenStatesTokenLMHeadLogitsClassifier"
INPUTS = ["hidden_states", "token", "logits"]
TOP_K = 100  # logits_size in every training config
WIDTHS = [1024] * 6  # hidden_dims in every training config
EXPANSION = 4


def grid(k: int) -> float:
    """Their threshold search's k-th candidate (r2r/models/router.py: np.linspace(0.01, 0.99, 100))."""
    return float(np.linspace(0.01, 0.99, 100)[k])


@dataclass(frozen=True)
class Release:
    pair: str  # config/PAIR.yaml
    small: str  # quick.model_path: the model whose hidden states and embedding the router reads
    large: str  # reference.model_path
    large_name: str  # reference.model_name, as the config spells it
    hidden: int  # hidden_states_size: the small model's hidden size
    router_path: str  # router.router_path
    folder: str  # its folder in nics-efc/R2R_router_collections (README.md, "Pretrained routers")
    threshold: float  # common_args.threshold
    params: tuple[str, str]  # quick.param, reference.param
    memory: tuple[float, float] = (0.15, 0.80)  # quick / reference mem_fraction_static
    first: bool = False  # the first release: init_args with dtype and without pretrained_model_name


R1_SMALL, R1_LARGE = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
RELEASES = {r.pair: r for r in [
    # Published first as nics-efc/R2R_router's default_router.pt, the threshold its evaluation uses
    # (script/evaluate/eval_configs/r2r_configs.json); the Qwen3 ones hold a value of the same grid.
    Release("DeepSeek-R1-Distill-Qwen-1.5B+DeepSeek-R1-Distill-Qwen-32B", R1_SMALL, R1_LARGE,
            "DeepSeek-R1-Distill-Qwen-32B", 1536, "nics-efc/R2R_router",
            "DeepSeek-R1-Distill-Qwen-1.5B+DeepSeek-R1-Distill-Qwen-1.5B-32B", 0.40595959595959596, ("1.5", "32"),
            first=True),
    Release("Qwen3-0.6B+Qwen3-8B", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "Qwen3-8B", 1024,
            "GY2233/Qwen3_0_6B_Qwen3_8B", "Qwen3-0.6B+Qwen3-8B", grid(30), ("0.6", "8")),
    Release("Qwen3-0.6B+Qwen3-30B-A3BB", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-30B-A3B", "Qwen3-32B", 1024,
            "GY2233/Qwen3_0_6B_Qwen3_30B_A3B", "Qwen3-0.6B+Qwen3-30B-A3B", grid(33), ("0.6", "30")),
    Release("Qwen3-0.6B+Qwen3-32B", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-32B", "Qwen3-32B", 1024,
            "nics-efc/R2R_router_collections/Qwen3-0.6B+Qwen3-32B/default_router.pt", "Qwen3-0.6B+Qwen3-32B",
            grid(36), ("0.6", "32")),
    Release("Qwen3-1.7B+Qwen3-8B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B", "Qwen3-8B", 2048,
            "GY2233/Qwen3_1_7B_Qwen3_8B", "Qwen3-1.7B+Qwen3-8B", grid(39), ("1.7", "8")),
    Release("Qwen3-4B+Qwen3-8B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B", "Qwen3-8B", 2560,
            "GY2233/Qwen3_4B_Qwen_8B", "Qwen3-4B+Qwen-8B", grid(42), ("4", "8"), memory=(0.30, 0.65)),
]}


def init_args(r: Release) -> dict[str, Any]:
    """The init_args save_model stores: the training config's, in its order (capture_init_args turns
    the first release's dtype string into a torch.dtype)."""
    args: dict[str, Any] = {"hidden_states_size": r.hidden, "logits_size": TOP_K, "hidden_dims": WIDTHS,
                            "expansion_factor": EXPANSION, "dropout_rate": 0.1}
    if r.first:
        args["dtype"] = torch.float32
    args.update(use_position_embedding=False, freeze_lm_head=True, normalize_input=False)
    if not r.first:
        args["pretrained_model_name"] = r.small
    return args


def their_state_dict(hidden: int, embed: int, widths: list[int], top_k: int = TOP_K, normalize: bool = False,
                     embedding: torch.Tensor | None = None, seed: int = 7) -> OrderedDict[str, torch.Tensor]:
    """Random tensors under HiddenStatesTokenLMHeadLogitsClassifier's state_dict keys and shapes, in
    its registration order (ClassifierBackbone makes its blocks before input_projection). Weights
    are drawn as their _init_weights scales them (kaiming), with random biases and norms so a
    misplaced one shows."""
    g = torch.Generator().manual_seed(seed)
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()

    def linear(name: str, d_out: int, d_in: int) -> None:
        sd[name + ".weight"] = torch.randn(d_out, d_in, generator=g) * (2 / d_in) ** 0.5
        sd[name + ".bias"] = torch.randn(d_out, generator=g) * 0.1

    def norm(name: str, d: int) -> None:
        sd[name + ".weight"] = 1 + 0.1 * torch.randn(d, generator=g)
        sd[name + ".bias"] = 0.1 * torch.randn(d, generator=g)

    if normalize:
        norm("layer_norm_hidden_states", hidden)
        norm("layer_norm_token", hidden)
    if embedding is not None:
        sd["token_embeddings.weight"] = embedding
    linear("logits_projection", hidden, top_k)
    linear("combined_projection", widths[0], 2 * hidden + embed)
    dims = [*widths, widths[-1]]
    for i in range(len(widths)):
        p, d_in, d_out = f"backbone.blocks.{i}.", dims[i], dims[i + 1]
        norm(p + "layer_norm", d_in)
        linear(p + "mlp.0", d_in * EXPANSION, d_in)
        linear(p + "mlp.3", d_out, d_in * EXPANSION)
        if d_in != d_out:
            linear(p + "dim_change", d_out, d_in)
    linear("backbone.input_projection", widths[0], widths[0])
    norm("backbone.output_layer.0", dims[-1])
    linear("backbone.output_layer.1", 1, dims[-1])
    return sd


def save_checkpoint(path: Path, state: dict[str, torch.Tensor], init: dict[str, Any], threshold: float) -> Path:
    """torch.save of save_model's dict."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_type": MODEL_TYPE, "init_args": init,
                "common_args": {"threshold": threshold, "input_type": INPUTS},
                "model_specific_args": {}, "state_dict": state}, path)
    return path


def their_pair_config(r: Release) -> dict[str, Any]:
    """config/PAIR.yaml as the repository has it."""
    think = (151648, 151649) if r.first else (151667, 151668)

    def model(path: str, name: str, param: str, memory: float, **extra: Any) -> dict[str, Any]:
        return {"model_name": name, "model_path": path, "param": param, **extra, "mem_fraction_static": memory}

    large = (r.large, r.large_name, r.params[1])
    return {
        "special_tokens": {"think_start": think[0], "think_end": think[1]},
        "quick": model(r.small, r.small.split("/")[1], r.params[0], r.memory[0]),
        "reference": model(*large, r.memory[1]),
        "continuation_main": model(*large, 0.90, tp_size=2, base_gpu_id=2),
        "continuation_reference": model(*large, 0.90, tp_size=1, base_gpu_id=3),
        "verify": {"model_name": "Qwen2.5-72B-Instruct", "model_path": "Qwen/Qwen2.5-72B-Instruct",
                   "mem_fraction_static": 0.90, "max_new_tokens": 16, "base_gpu_id": 4, "tp_size": 4},
        "router": {"router_name": r.pair.replace("A3BB", "A3B"), "router_path": r.router_path,
                   "override_init_args": {"pretrained_model_name": r.small}},
    }


def publish(r: Release, root: Path, state: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    """The release as downloaded (its checkpoint file, or its collection folder) and its pair config."""
    config = root / "config" / f"{r.pair}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(their_pair_config(r), indent=2))
    if r.first:  # README.md: "place the file default_router.pt under resource/"
        return save_checkpoint(root / "resource" / "default_router.pt", state, init_args(r), r.threshold), config
    # `hf download nics-efc/R2R_router_collections --include "PAIR/**" --local-dir resource`
    save_checkpoint(root / "resource" / r.folder / "default_router.pt", state, init_args(r), r.threshold)
    return root / "resource" / r.folder, config


def their_scores(sd: dict[str, torch.Tensor], widths: list[int], hidden: torch.Tensor, token_emb: torch.Tensor,
                 top_logits: torch.Tensor, normalize: bool = False) -> torch.Tensor:
    """Their forward pass in eval mode (HiddenStatesTokenLMHeadLogitsClassifier.forward,
    ClassifierBackbone, ClassifierBlock), op by op, then the sigmoid NeuralSwitching applies."""
    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, sd[name + ".weight"], sd[name + ".bias"])

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), sd[name + ".weight"], sd[name + ".bias"])

    if normalize:
        hidden, token_emb = norm(hidden, "layer_norm_hidden_states"), norm(token_emb, "layer_norm_token")
        top_logits = torch.softmax(top_logits, dim=-1)
    x = lin(torch.cat([hidden, token_emb, lin(top_logits, "logits_projection")], dim=-1), "combined_projection")
    x = lin(x, "backbone.input_projection")
    for i in range(len(widths)):
        p = f"backbone.blocks.{i}"
        residual = lin(x, p + ".dim_change") if p + ".dim_change.weight" in sd else x
        x = residual + lin(F.gelu(lin(norm(x, p + ".layer_norm"), p + ".mlp.0")), p + ".mlp.3")
    return torch.sigmoid(lin(norm(x, "backbone.output_layer.0"), "backbone.output_layer.1")).squeeze(-1)


def random_inputs(hidden: int, rows: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    top = torch.randn(rows, TOP_K, generator=g).sort(dim=-1, descending=True).values * 4
    return torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g), top


@pytest.mark.parametrize("name", list(RELEASES))
def test_each_release_converts_and_scores_as_theirs(tmp_path, name):
    r = RELEASES[name]
    sd = their_state_dict(r.hidden, r.hidden, WIDTHS)
    published, config = publish(r, tmp_path, sd)
    try:
        folder = convert_r2r_router(published, tmp_path / "router", config)
        meta = router_meta(folder, "r2r")
        assert meta["arch"] == {"layout": "thu-nics/R2R", "hidden_size": r.hidden, "top_k": TOP_K,
                                "embed_dim": r.hidden, "hidden_dims": WIDTHS, "expansion_factor": EXPANSION,
                                "normalize_input": False}
        assert meta["threshold"] == r.threshold and meta["source"]["threshold_from"] == "common_args.threshold"
        assert meta["pair"] == {"small": {"name": r.small}, "large": {"name": r.large}}
        assert Path(meta["source"]["checkpoint"]).name == "default_router.pt"
        h, e, top = random_inputs(r.hidden)
        with torch.no_grad():
            ours = torch.sigmoid(load_router(folder, "r2r").head(h, e, top))
            want = their_scores(sd, WIDTHS, h, e, top)
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)
        assert float(ours.max() - ours.min()) > 0.05  # the comparison is not vacuous: scores spread, unsaturated
    finally:
        for big in ("resource", "router"):  # a release's checkpoint and its conversion: a quarter of a GB each
            shutil.rmtree(tmp_path / big, ignore_errors=True)


@pytest.fixture(scope="module")
def served_pairs(tmp_path_factory, model_paths) -> dict[str, dict[str, Path]]:
    """Tiny models of each served release's small-model geometry (hidden size, heads, KV heads, head
    size; one layer, the byte-level vocabulary), with the tiny model of the same family as the large."""
    root = tmp_path_factory.mktemp("r2r-geometry")
    r1 = build_random_model(root / "r1-small", "qwen2", "tiny", seed=21, hidden_size=1536, num_attention_heads=12,
                            num_key_value_heads=2, intermediate_size=256, num_hidden_layers=1)
    qwen3 = build_random_model(root / "qwen3-small", "qwen3", "tiny", seed=22, hidden_size=1024,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=256,
                               num_hidden_layers=1)
    return {"DeepSeek-R1-Distill-Qwen-1.5B+DeepSeek-R1-Distill-Qwen-32B": {"small": r1, "large": model_paths["qwen2"]},
            "Qwen3-0.6B+Qwen3-8B": {"small": qwen3, "large": model_paths["qwen3"]}}


@pytest.mark.parametrize("name", ["DeepSeek-R1-Distill-Qwen-1.5B+DeepSeek-R1-Distill-Qwen-32B", "Qwen3-0.6B+Qwen3-8B"])
def test_release_serves_on_its_pair_geometry(tmp_path, served_pairs, name, capsys):
    r, paths = RELEASES[name], served_pairs[name]
    assert json.loads((paths["small"] / "config.json").read_text())["hidden_size"] == r.hidden
    published, config = publish(r, tmp_path, their_state_dict(r.hidden, r.hidden, WIDTHS))
    out = tmp_path / "converted"
    assert main(["convert-router", str(published), "--out", str(out), "--r2r-config", str(config),
                 "--small", str(paths["small"]), "--large", str(paths["large"])]) == 0
    assert f"threshold {r.threshold}" in capsys.readouterr().out
    rig = Rig(paths, 0.0, algorithm={"name": "r2r", "router": str(out)})  # binding checks both fingerprints
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

        def run(rid: str, routing: dict[str, Any]) -> list[tuple[str, float, float]]:
            """(writer, score, threshold) of each token of a traced request."""
            rig.send("small", AddReq(rid, [5, 6, 7, 8, 9], params, seed=1, routing=routing, trace=True))
            rig.pump(lambda: bool(rig.finished(rid)), f"{rid} finished")
            events = [(m.model, e) for m in rig.msgs if isinstance(m, Tokens) for e in m.items if e.rid == rid]
            assert len(events) == 12
            return [(model, e.trace.score, e.trace.threshold) for model, e in events]

        assert [w for w, _, _ in run("all-large", {"threshold": 0.0})] == ["large"] * 12
        official = run("official", {})
        assert all(t == pytest.approx(r.threshold, abs=1e-7) for _, _, t in official)  # compared in float32
        # A threshold inside the scores the router gave, so both models write.
        split = run("split", {"threshold": float(np.median([s for _, s, _ in official]))})
        for tokens in (official, split):
            assert all((w == "large") == (s >= t) for w, s, t in tokens), tokens
        assert {w for w, _, _ in split} == {"small", "large"}, split
        rig.settle()
        assert rig.small.algorithm.params_of == {} and rig.large.algorithm.params_of == {}
    finally:
        rig.close()


def tiny_checkpoint(path: Path, hidden: int = 64, embedding: torch.Tensor | None = None, **init: Any) -> Path:
    """A release-layout checkpoint at a tiny width, for what does not depend on the sizes."""
    args = {"hidden_states_size": hidden, "logits_size": TOP_K, "hidden_dims": [32, 32], "expansion_factor": EXPANSION,
            "freeze_lm_head": True, **init}
    return save_checkpoint(path, their_state_dict(hidden, hidden, [32, 32], embedding=embedding), args, grid(40))


def test_release_folder_chosen_as_their_loader_chooses(tmp_path):
    def folder(name: str, files: list[str]) -> Path:
        d = tmp_path / name
        d.mkdir(parents=True)
        for f in files:
            (d / f).write_text("")
        return d

    # load_model's candidates in order, else the first .pt by name; the trimmed file before NAME_all.pt.
    assert find_release(folder("a", ["router.pt", "default_router_sampling.pt", "a.pt"]))[0].name == "router.pt"
    assert find_release(folder("b", ["default_router_sampling.pt", "a.pt", "default_router.pt"]))[0].name \
        == "default_router.pt"
    chosen, config = find_release(folder("c", ["classifier_0714_all.pt", "classifier_0714.pt", "classifier_0714.json"]))
    assert (chosen.name, config) == ("classifier_0714.pt", None)
    assert find_release(folder("d", ["model_configs.json", "x.pt"]))[1].name == "model_configs.json"
    for pair in ("Qwen3-0.6B+Qwen3-8B", "Qwen3-4B+Qwen-8B"):  # the collection: a folder per pair
        folder(f"collection/{pair}", ["default_router.pt"])
    with pytest.raises(ValueError, match=r"give one of its pairs' files: Qwen3-0\.6B\+Qwen3-8B/default_router\.pt"):
        find_release(tmp_path / "collection")

    # A downloaded pair folder's config.yaml is its pair config.
    release = tmp_path / "Qwen3-0.6B+Qwen3-8B"
    tiny_checkpoint(release / "default_router.pt", pretrained_model_name="Qwen/Qwen3-0.6B")
    (release / "config.yaml").write_text(json.dumps(their_pair_config(RELEASES["Qwen3-0.6B+Qwen3-8B"])))
    meta = router_meta(convert_r2r_router(release, tmp_path / "out"))
    assert meta["pair"]["large"] == {"name": "Qwen/Qwen3-8B"}
    assert meta["source"]["pair_config"] == str(release / "config.yaml")


def test_small_model_named_without_a_pair_config(tmp_path):
    first = tiny_checkpoint(tmp_path / "first.pt", dtype=torch.float32)  # no pretrained_model_name
    assert router_meta(convert_r2r_router(first, tmp_path / "a"))["pair"]["small"] == {"name": DEFAULT_SMALL}
    qwen3 = tiny_checkpoint(tmp_path / "qwen3.pt", pretrained_model_name="Qwen/Qwen3-1.7B")
    assert router_meta(convert_r2r_router(qwen3, tmp_path / "b"))["pair"]["small"] == {"name": "Qwen/Qwen3-1.7B"}


def test_threshold_from_argument_then_pair_config_then_checkpoint(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "default_router.pt")
    cfg = their_pair_config(RELEASES["Qwen3-0.6B+Qwen3-8B"])
    cfg["router"]["threshold"] = 0.3  # their server takes the config's before its --threshold
    config = tmp_path / "pair.yaml"
    config.write_text(json.dumps(cfg))
    meta = router_meta(convert_r2r_router(ckpt, tmp_path / "a", config))
    assert (meta["threshold"], meta["source"]["threshold_from"]) == (0.3, "pair config router.threshold")
    assert meta["source"]["official_threshold"] == grid(40)
    meta = router_meta(convert_r2r_router(ckpt, tmp_path / "b", config, threshold=0.2))
    assert (meta["threshold"], meta["source"]["threshold_from"]) == (0.2, "argument")


def test_configs_without_a_router_checkpoint_refused(tmp_path):
    """config/..._entropy.yaml and _aleatoric.yaml switch on the small model's uncertainty: no router."""
    ckpt = tiny_checkpoint(tmp_path / "default_router.pt")
    for strategy, field in (("entropy", "entropy_threshold"), ("immediate", "aleatoric_threshold")):
        cfg = their_pair_config(RELEASES["DeepSeek-R1-Distill-Qwen-1.5B+DeepSeek-R1-Distill-Qwen-32B"])
        cfg["router"] = {"router_name": "DeepSeek-R1-Distill-Qwen-1.5B+DeepSeek-R1-Distill-Qwen-1.5B-32B",
                         "switching_strategy": strategy, field: 0.45}
        config = tmp_path / f"{strategy}.yaml"
        config.write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=f"router.switching_strategy is '{strategy}'"):
            convert_r2r_router(ckpt, tmp_path / "out", config)


def test_weights_that_do_not_fit_init_args_refused(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "default_router.pt")
    raw = torch.load(ckpt, weights_only=True)
    raw["init_args"]["hidden_dims"] = [32, 32, 32]
    torch.save(raw, ckpt)
    with pytest.raises(ValueError, match="(?s)does not match its init_args.*backbone.blocks.2"):
        convert_r2r_router(ckpt, tmp_path / "out")


def test_all_file_embedding_must_be_the_small_models(tmp_path, pair_paths, model_paths):
    """NAME_all.pt keeps the embedding of the small model it was trained with: converting it for
    another small model is refused, naming the tensor."""
    from safetensors.torch import load_file

    small = pair_paths["small"]
    own = load_file(str(small / "model.safetensors"))["model.embed_tokens.weight"]
    hidden = own.shape[1]
    ckpt = tiny_checkpoint(tmp_path / "default_router_all.pt", hidden, embedding=own.clone())
    meta = router_meta(convert_r2r_router(ckpt, tmp_path / "a", small=small, large=pair_paths["large"]))
    assert meta["pair"]["small"]["path"] == str(small)
    other = model_paths["llama"]  # same hidden size and vocabulary, other weights
    with pytest.raises(ValueError, match=r"token_embeddings\.weight in .* is not small model"):
        convert_r2r_router(ckpt, tmp_path / "b", small=other)
