"""Router training (tokenrouter.training): calibration, heads learning a known function, saved routers
deciding as before saving, end-to-end training on the tiny pair, serving with the result, determinism."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenrouter import SamplingParams
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.routing.routers import load_router, model_fingerprint, save_router
from tokenrouter.training import Features, auc, calibrate, read_corpus, train_head, train_router
from tokenrouter.training.calibrate import evaluate, routed
from tokenrouter.training.cli import main as cli_main
from tokenrouter.training.train import head_scores, split_by_sequence

# CPU pinned: bit-for-bit determinism is only promised there.
FAST = dict(seq_len=48, max_tokens=1500, epochs=4, batch_size=128, blocks=2, continuation=4, progress=False,
            device="cpu")


def fingerprint(path) -> str:
    cfg = json.loads((path / "config.json").read_text())
    return model_fingerprint(cfg, load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"])


def corpus_texts(n: int = 60, seed: int = 0) -> list[str]:
    """A few KB of made-up sentences (the models are random; the text only has to be text)."""
    rng = random.Random(seed)
    words = ("the a one cat dog bird fish sat ran flew swam on under over near mat tree river house "
             "quickly slowly today yesterday red green blue small large").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 20))).capitalize() + "." for _ in range(n)]


def group(paths: dict, algorithm: dict) -> dict:
    return {"models": [{"name": n, "path": str(paths[n]), "kv_cache_tokens": 2048, "page_size": 4}
                       for n in ("small", "large")], "algorithm": algorithm}


# ------------------------------------------------------------------------------------------ calibration
@pytest.mark.parametrize("rule", [">=", ">", "<"])
def test_calibrate_meets_recall_with_fewest_routed(rule):
    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(2000, generator=g) < 0.3).float()
    # Positives score high for >= and >, low for < (CITER's confidence that the small token is fine).
    signal = labels if rule != "<" else 1 - labels
    scores = torch.sigmoid(3 * (signal - 0.5) + torch.randn(2000, generator=g))
    for target in (0.5, 0.8, 0.95, 1.0):
        cal = calibrate(scores, labels, target_recall=target, rule=rule)
        assert cal.recall >= target
        m = evaluate(scores, labels, cal.threshold, rule)
        assert m["recall"] == cal.recall and m["large_share"] == cal.large_share
        # One step further (a float32 ulp past the next positive) would lose recall: fewest routed.
        pos = scores[labels > 0.5]
        hit = routed(pos, cal.threshold, rule)
        boundary = pos[hit].min() if rule != "<" else pos[hit].max()
        tighter = float(boundary) + (1e-6 if rule != "<" else -1e-6)
        assert evaluate(scores, labels, tighter, rule)["recall"] < target
    share = calibrate(scores, None, target_share=0.25, rule=rule)
    assert abs(share.large_share - 0.25) < 1e-3
    assert calibrate(scores, labels, target_share=0.0, rule=rule).large_share == 0.0


def test_calibrate_reaches_target_recall_on_held_out_data():
    g = torch.Generator().manual_seed(1)
    labels = (torch.rand(40_000, generator=g) < 0.2).float()
    scores = torch.sigmoid(2.0 * labels + torch.randn(40_000, generator=g))
    cal = calibrate(scores[:20_000], labels[:20_000], target_recall=0.9)
    held = evaluate(scores[20_000:], labels[20_000:], cal.threshold, ">=")
    assert abs(held["recall"] - 0.9) < 0.02


def test_auc_rank_formula_matches_pair_count():
    g = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 20, (300,), generator=g).float()  # many ties
    labels = (torch.rand(300, generator=g) < 0.4).float()
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    diff = pos[:, None] - neg[None, :]
    brute = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    assert auc(scores, labels) == pytest.approx(brute, abs=1e-12)
    assert auc(scores, labels, higher_is_positive=False) == pytest.approx(1 - brute, abs=1e-12)
    assert auc(scores, torch.ones(300)) != auc(scores, torch.ones(300))  # NaN with one class


# ------------------------------------------------------------------------- heads on a known function
@pytest.fixture(scope="module")
def synthetic(pair_paths) -> Features:
    """The tiny small model's real features on random tokens; the label is a fixed random projection
    of the hidden state above its median (so a linear function of what every head reads)."""
    from transformers import AutoModelForCausalLM

    small = AutoModelForCausalLM.from_pretrained(pair_paths["small"], dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 259, (48, 64), generator=g)
    with torch.no_grad():
        hidden = small.model(input_ids=ids).last_hidden_state
        logits = small.lm_head(hidden)
    hidden, logits = hidden.reshape(-1, hidden.shape[-1]), logits.reshape(-1, logits.shape[-1])
    proj = hidden @ torch.randn(hidden.shape[1], generator=g)
    label = (proj > proj.median()).float()
    # Co-LLM: the large model is much better exactly where label = 1, so the mixture loss is
    # minimised by deferring there.
    lp_good, lp_bad = torch.full_like(label, -0.5), torch.full_like(label, -4.0)
    return Features(hidden=hidden, label=label, seq=torch.arange(48).repeat_interleave(64),
                    token=logits.argmax(-1), top_logits=logits.topk(16, dim=-1).values,
                    embed=small.model.embed_tokens.weight.detach().clone(),
                    lp_small=torch.where(label > 0.5, lp_bad, lp_good),
                    lp_large=torch.where(label > 0.5, lp_good, lp_bad), differs=label.clone())


@pytest.mark.parametrize("kind", ["citer", "r2r", "co_llm"])
def test_heads_learn_a_known_function_of_the_hidden_state(kind, synthetic, tmp_path):
    res = train_head(kind, synthetic, seed=0, epochs=15, lr=3e-3, blocks=2, progress=False, device="cpu")
    m = res.metrics
    assert m["positions"] == res.held_idx.numel() > 0
    # The majority class is ~0.5 here, so AUC 0.5 / accuracy 0.5 is the trivial baseline.
    assert m["auc"] >= 0.9, m
    assert m["recall"] >= 0.95
    assert m["large_share"] < 0.9  # a constant router meeting the recall would route everything
    # The held-out split is whole sequences.
    assert not set(synthetic.seq[res.train_idx].tolist()) & set(synthetic.seq[res.held_idx].tolist())

    # Saved and reloaded: the same scores, bit for bit, and the same threshold.
    folder = save_router(tmp_path / kind, res.head, res.threshold, pair={})
    loaded = load_router(folder, kind)
    before = head_scores(kind, res.head, synthetic)
    after = head_scores(kind, loaded.head, synthetic)
    assert torch.equal(before, after)
    assert loaded.threshold == res.threshold
    assert torch.equal(routed(before, res.threshold, res.calibration.rule),
                       routed(after, loaded.threshold, res.calibration.rule))


def test_split_by_sequence_is_seeded():
    seq = torch.arange(20).repeat_interleave(5)
    a, b, c = (split_by_sequence(seq, 0.25, s) for s in (7, 7, 8))
    assert torch.equal(a[1], b[1]) and not torch.equal(a[1], c[1])
    assert torch.unique(seq[a[1]]).numel() == 5


# ---------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def r2r_router(pair_paths, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "r2r"
    return train_router("r2r", pair_paths["small"], pair_paths["large"], corpus_texts(), out, seed=5, **FAST)


def test_train_router_end_to_end_r2r_serves(r2r_router, pair_paths, model_paths):
    meta = json.loads((r2r_router / "router.json").read_text())
    m = meta["metrics"]
    for key in ("auc", "recall", "precision", "large_share", "threshold", "positions"):
        assert key in m
    assert m["recall"] is None or m["recall"] >= 0.95
    assert meta["training"]["data"]["positions"] > 1000
    assert meta["arch"]["top_k"] == 100  # min(--top-k 100, vocab 320)

    router = load_router(r2r_router, "r2r")
    router.check_pair("small", fingerprint(pair_paths["small"]))
    router.check_pair("large", fingerprint(pair_paths["large"]))
    with pytest.raises(ValueError, match="trained for another small model"):
        router.check_pair("small", fingerprint(model_paths["llama"]))

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with RoutedLLM(group(pair_paths, {"name": "r2r", "router": str(r2r_router)})) as llm:
        out = llm.generate(prompt_token_ids=[[5, 17, 42, 99, 7]], sampling_params=params, use_tqdm=False,
                           timeout=120)
    c = out[0].outputs[0]
    assert len(c.token_ids) == 8 and set(c.token_models) <= {"small", "large"}


def test_train_router_is_deterministic(r2r_router, pair_paths, tmp_path):
    again = train_router("r2r", pair_paths["small"], pair_paths["large"], corpus_texts(), tmp_path / "again",
                         seed=5, **FAST)
    a, b = load_file(str(r2r_router / "router.safetensors")), load_file(str(again / "router.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = (json.loads((p / "router.json").read_text()) for p in (r2r_router, again))
    assert ma["threshold"] == mb["threshold"] and ma["metrics"] == mb["metrics"]


@pytest.mark.parametrize("kind", ["citer", "co_llm"])
def test_train_router_end_to_end_other_kinds(kind, pair_paths, model_paths, tmp_path):
    out = train_router(kind, pair_paths["small"], pair_paths["large"], corpus_texts(), tmp_path / kind,
                       seed=1, **FAST)
    router = load_router(out, kind)
    router.check_pair("small", fingerprint(pair_paths["small"]))
    with pytest.raises(ValueError, match="another small model"):
        router.check_pair("small", fingerprint(model_paths["llama"]))
    meta = router.meta
    assert 0.0 <= meta["threshold"] <= 1.0
    assert meta["calibration"]["rule"] == {"citer": "<", "co_llm": ">"}[kind]
    if kind == "co_llm":
        assert meta["metrics"]["nll_mixture"] <= min(meta["metrics"]["nll_small"], meta["metrics"]["nll_large"]) + 0.05


def noisy_copy(src, dst, alpha: float, seed: int = 5):
    """The model with Gaussian noise (alpha x each matrix's std) on its matrices: a 'large' model that
    agrees with the small one at most positions, so the labels are not all one class."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for k, v in sd.items():
        if v.dim() == 2:
            sd[k] = v + alpha * v.std() * torch.randn(v.shape, generator=g)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_router_on_a_correlated_pair_beats_chance(pair_paths, tmp_path):
    """With a large model that usually agrees (a noisy copy of the small one), whether the models
    disagree is predictable from the small model's hidden state (small top-2 margins), so a trained
    CITER router ranks held-out positions well above chance."""
    large = noisy_copy(pair_paths["small"], tmp_path / "noisy", alpha=0.1)
    out = train_router("citer", pair_paths["small"], large, corpus_texts(200), tmp_path / "citer", seed=0,
                       **{**FAST, "max_tokens": 6000, "epochs": 15})
    meta = json.loads((out / "router.json").read_text())
    assert 0.05 < meta["training"]["data"]["differs_share"] < 0.6
    assert meta["metrics"]["auc"] >= 0.65, meta["metrics"]
    assert meta["metrics"]["recall"] >= 0.95


def test_co_llm_full_finetune_saves_a_servable_small_model(pair_paths, tmp_path):
    out = train_router("co_llm", pair_paths["small"], pair_paths["large"], corpus_texts(), tmp_path / "co",
                       seed=2, full_finetune=True, finetune_epochs=2, finetune_lr=1e-3, **FAST)
    small = out / "small_model"
    meta = json.loads((out / "router.json").read_text())
    assert meta["pair"]["small"]["path"] == str(small.resolve())
    router = load_router(out, "co_llm")
    router.check_pair("small", fingerprint(small))
    with pytest.raises(ValueError, match="another small model"):
        router.check_pair("small", fingerprint(pair_paths["small"]))  # the weights changed
    ft = [h for h in meta["training"]["history"] if h["phase"] == "finetune"]
    assert min(h["held_out_loss"] for h in ft[1:]) < ft[0]["held_out_loss"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    paths = {"small": small, "large": pair_paths["large"]}
    with RoutedLLM(group(paths, {"name": "co_llm", "router": str(out), "eta": meta["threshold"]})) as llm:
        res = llm.generate(prompt_token_ids=[[9, 8, 7, 6]], sampling_params=params, use_tqdm=False, timeout=120)
    assert len(res[0].outputs[0].token_ids) == 6


# --------------------------------------------------------------------------------- inputs and the CLI
def test_mismatched_vocabularies_are_refused(pair_paths, tmp_path):
    other = tmp_path / "other_vocab"
    shutil.copytree(pair_paths["large"], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizers differ.*share one vocabulary"):
        train_router("citer", pair_paths["small"], other, corpus_texts(), tmp_path / "x", **FAST)


def test_corpus_formats(tmp_path):
    (tmp_path / "a.txt").write_text("first text")
    (tmp_path / "b.jsonl").write_text('{"text": "second"}\n\n{"text": "third", "id": 3}\n')
    (tmp_path / "skip.md").write_text("not read")
    assert read_corpus(tmp_path / "a.txt") == ["first text"]
    assert read_corpus(tmp_path / "b.jsonl") == ["second", "third"]
    assert read_corpus(tmp_path) == ["first text", "second", "third"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object"):
        read_corpus(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="does not exist"):
        read_corpus(tmp_path / "missing.txt")


def test_cli_standalone(pair_paths, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in corpus_texts()))
    out = tmp_path / "router"
    argv = ["--kind", "citer", "--small", str(pair_paths["small"]), "--large", str(pair_paths["large"]),
            "--corpus", str(corpus), "--out", str(out), "--seq-len", "48", "--max-tokens", "1200",
            "--epochs", "3", "--target-large-share", "0.5", "--quiet"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "router written to" in printed and "AUC" in printed
    assert 'serves this calibrated threshold ("tau": ' in printed
    meta = load_router(out, "citer").meta
    assert meta["calibration"]["target_share"] == 0.5
    assert abs(meta["metrics"]["large_share"] - 0.5) < 0.05
    assert cli_main(argv[:-1] + ["--held-out", "1.5", "--quiet"]) == 2
    assert "held_out must be in (0, 1)" in capsys.readouterr().err


def test_fingerprints_do_not_depend_on_the_serving_dtype(pair_paths, tmp_path):
    """A router trained once serves with the pair loaded in float32 or bfloat16."""
    from tokenrouter.engine.config import EngineConfig
    from tokenrouter.engine.engine import Engine
    from tokenrouter.routing.routers import engine_fingerprint

    out = train_router("citer", pair_paths["small"], pair_paths["large"], corpus_texts(20), tmp_path / "bf",
                       seed=0, **{**FAST, "epochs": 1})
    router = load_router(out, "citer")
    for dtype in ("bfloat16", "float32"):
        engine = Engine(EngineConfig(model_path=str(pair_paths["small"]), dtype=dtype, device="cpu",
                                     kv_cache_tokens=256, page_size=4))
        router.check_pair("small", engine_fingerprint(engine))
    with pytest.raises(ValueError, match="another small model"):
        router.check_pair("small", "0" * 16)


# ------------------------------------------------------------------------------------ R2R continuations
def test_branch_continuations_equal_prefilling_each_branch(pair_paths):
    """Branching off one pass (cache copy, masked tail, branch position ids) gives exactly the greedy
    tokens of running each prefix + candidate token from scratch."""
    from transformers import AutoModelForCausalLM

    from tokenrouter.training.labels import branch_continuations

    large = AutoModelForCausalLM.from_pretrained(str(pair_paths["large"]), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(3, 300, (40,), generator=g).tolist()
    pos = torch.tensor([0, 5, 5, 17, 38, 39])
    first = torch.randint(3, 300, (6,), generator=g)
    got = branch_continuations(large, seq, pos, first, steps=5)
    assert got.shape == (6, 5)
    for r in range(6):
        ids = torch.tensor([seq[:int(pos[r]) + 1] + [int(first[r])]])
        want = []
        with torch.no_grad():
            for _ in range(5):
                nxt = large(input_ids=ids).logits[0, -1].argmax()
                want.append(int(nxt))
                ids = torch.cat([ids, nxt.view(1, 1)], 1)
        assert got[r].tolist() == want, f"row {r} (branch at {int(pos[r])})"
