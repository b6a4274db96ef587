"""The five built-in algorithms on tiny models: who writes which position, and token exactness."""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch
from engine_utils import check_exact, need_compiler, prompts_of
from safetensors.torch import load_file, save_file

from tokenrouter import SamplingParams
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.routing import make_algorithm
from tokenrouter.routing.routers import (
    CiterRouter,
    DeferralHead,
    R2RReleasedRouter,
    R2RRouter,
    model_fingerprint,
    save_router,
)
from tokenrouter.runtime.entry.entry import SubserverDied

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def fingerprint(path) -> str:
    cfg = json.loads((path / "config.json").read_text())
    return model_fingerprint(cfg, load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"])


@pytest.fixture(scope="module")
def hf(pair_paths):
    from transformers import AutoModelForCausalLM

    return {n: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for n, p in pair_paths.items()}


@pytest.fixture(scope="module")
def routers(pair_paths, hf, tmp_path_factory):
    """Untrained heads whose thresholds are their median score on a probe: about half the tokens
    route, which is what the mechanics tests need."""
    root = tmp_path_factory.mktemp("routers")
    pair = {r: {"fingerprint": fingerprint(p)} for r, p in pair_paths.items()}
    torch.manual_seed(0)
    small = hf["small"]
    probe = torch.tensor(prompts_of([64], seed=99))
    with torch.no_grad():
        hidden = small.model(input_ids=probe).last_hidden_state[0]
        logits = small.lm_head(hidden)
        emb = small.model.embed_tokens(logits.argmax(-1))
    out = {}
    for kind, head in (("citer", CiterRouter(64)), ("co_llm", DeferralHead(64)),
                       ("r2r", R2RRouter(64, top_k=8, width=32, blocks=2))):
        head.eval()
        with torch.no_grad():
            z = head(hidden, emb, logits.topk(8).values) if kind == "r2r" else head(hidden)
        out[kind] = save_router(root / kind, head, threshold=float(torch.sigmoid(z).median()), pair=pair)
    return out


def group(pair_paths, algorithm: dict, names=("small", "large"), paths=None) -> dict:
    paths = paths or pair_paths
    return {"models": [{"name": n, "path": str(paths[n]), "kv_cache_tokens": 4096, "page_size": 4} for n in names],
            "algorithm": algorithm}


def run(cfg: dict, prompts, params=GREEDY):
    with RoutedLLM(cfg) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
        return outs, llm.last_run


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_r2r_served_scorer_matches_the_module(rows):
    """The folded serving form (routers.py FoldedR2R) scores as the module does, for each row's own
    token, both in its C kernel (r2r_kernel.c: rows in fours and singles, a width that is no whole
    vector, a top-k that is no whole run of 8) and as torch calls; a token outside the vocabulary is
    refused; a released-layout head's scorer is its module."""
    need_compiler()
    torch.manual_seed(3)
    head = R2RRouter(48, top_k=12, width=20, blocks=3).eval()
    with torch.no_grad():
        for p in head.parameters():  # away from the init's zero biases and unit norms
            p.add_(0.3 * torch.randn_like(p))
    embed = torch.randn(200, 48)
    hidden, logits = torch.randn(rows, 48), torch.randn(rows, 12)
    tokens = torch.randint(0, 200, (rows,))
    with torch.no_grad():
        want = head(hidden, embed[tokens], logits)
    scorer = head.scorer(embed)
    assert scorer.kernel is not None
    got = scorer(hidden, tokens, logits)
    assert got.shape == want.shape == (rows,)
    assert want.abs().min() > 1e-3  # not trivially zero
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scorer.forward_torch(hidden, tokens, logits), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scorer(hidden, torch.full((rows,), 200), logits)
    assert scorer(hidden[:0], tokens[:0], logits[:0]).shape == (0,)
    released = R2RReleasedRouter(48, 12, 48, [16, 16]).eval()
    with torch.no_grad():
        torch.testing.assert_close(released.scorer(embed)(hidden, tokens, logits),
                                   released(hidden, embed[tokens], logits))


@pytest.mark.parametrize("kind,param", [("citer", "tau"), ("co_llm", "eta"), ("r2r", "threshold")])
def test_deferral_algorithms_are_exact_and_write_one_peer_token(kind, param, pair_paths, hf, routers):
    prompts = prompts_of([4, 9, 15, 22], seed=30)
    median = json.loads((routers[kind] / "router.json").read_text())["threshold"]
    algo = {"name": kind, "router": str(routers[kind]), param: median}
    outs, stats = run(group(pair_paths, algo), prompts)
    large = last_by_large = 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert check_exact(hf, prompt, c.token_ids, c.token_models) >= 14
        large += c.token_models.count("large")
        last_by_large += c.token_models[-1] == "large"
    assert 0 < large < 64, "the test router should route some tokens, not all"
    # Every visit to the large model writes exactly one token: one hand-off there, one back
    # (none back when that token ended the request).
    assert stats.handoffs == 2 * large - last_by_large


def test_citer_hands_exactly_the_positions_where_its_rule_fires(pair_paths, hf, routers):
    """The large model writes position p iff the CITER head, recomputed offline from the small model's
    last hidden state after prompt + output[:p], gives a confidence below tau."""
    from tokenrouter.routing.routers import load_router

    head = load_router(routers["citer"], "citer").head
    tau = json.loads((routers["citer"] / "router.json").read_text())["threshold"]
    prompts = prompts_of([5, 11, 17], seed=41)
    outs, _ = run(group(pair_paths, {"name": "citer", "router": str(routers["citer"]), "tau": tau}), prompts)
    checked = fired = 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        seq = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            hidden = hf["small"].model(input_ids=seq).last_hidden_state[0]
            # Position p is decided on the hidden state of the token before it (row len(prompt) + p - 1).
            confidence = torch.sigmoid(head(hidden[len(prompt) - 1:-1]))
        for p, (conf, model) in enumerate(zip(confidence.tolist(), c.token_models)):
            if abs(conf - tau) < 1e-4:
                continue  # too close to call across kernels
            rule = conf < tau
            assert (model == "large") == rule, (f"position {p}: confidence {conf:.6f} vs tau {tau:.6f}, "
                                                f"written by {model}")
            checked += 1
            fired += rule
    assert checked >= 40 and 0 < fired < checked, (checked, fired)


def test_router_for_another_pair_is_refused(pair_paths, routers, tmp_path):
    bad = tmp_path / "citer"
    shutil.copytree(routers["citer"], bad)
    meta = json.loads((bad / "router.json").read_text())
    meta["pair"]["small"]["fingerprint"] = "0123456789abcdef"
    (bad / "router.json").write_text(json.dumps(meta))
    with pytest.raises(SubserverDied, match="trained for another small model"):
        RoutedLLM(group(pair_paths, {"name": "citer", "router": str(bad)}))


@pytest.mark.parametrize("kind", ["citer", "r2r", "co_llm"])
def test_router_for_another_large_model_is_refused(kind, pair_paths, routers, tmp_path):
    bad = tmp_path / kind
    shutil.copytree(routers[kind], bad)
    meta = json.loads((bad / "router.json").read_text())
    meta["pair"]["large"] = {"fingerprint": "0123456789abcdef", "path": "/models/another-large"}
    (bad / "router.json").write_text(json.dumps(meta))
    with pytest.raises(SubserverDied, match="trained for another large model") as err:
        RoutedLLM(group(pair_paths, {"name": kind, "router": str(bad)}))
    assert f"trained for large model /models/another-large (fingerprint 0123456789abcdef), this group's large " \
           f"model is {pair_paths['large']} (fingerprint {fingerprint(pair_paths['large'])})" in str(err.value)


def test_bad_algorithm_settings_are_clear(pair_paths, routers, tmp_path):
    with pytest.raises(ValueError, match="not a router folder"):
        make_algorithm("citer", ["small", "large"], {"router": str(tmp_path)})
    with pytest.raises(ValueError, match="holds a 'co_llm' router"):
        make_algorithm("citer", ["small", "large"], {"router": str(routers["co_llm"])})
    with pytest.raises(ValueError, match="exactly 2 models"):
        make_algorithm("r_stitch", ["a", "b", "c"], {})
    with pytest.raises(ValueError, match="positive weight"):
        make_algorithm("ensemble", ["a", "b"], {"weights": [1.0, -1.0]})
    with pytest.raises(ValueError, match="unknown routing algorithm"):
        make_algorithm("magic", ["a", "b"], {})


@pytest.fixture(scope="module")
def peaky_pair(pair_paths, tmp_path_factory):
    """The pair with sharper output distributions (LM heads scaled), so entropies straddle a threshold."""
    root = tmp_path_factory.mktemp("peaky")
    out = {}
    for name, path in pair_paths.items():
        dest = root / name
        shutil.copytree(path, dest)
        sd = load_file(str(dest / "model.safetensors"))
        sd["lm_head.weight"] = sd["lm_head.weight"] * 4.0
        save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
        out[name] = dest
    return out


def test_r_stitch_spans(peaky_pair):
    from transformers import AutoModelForCausalLM

    hf = {n: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for n, p in peaky_pair.items()}

    def norm_entropy(model: str, seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            lsm = torch.log_softmax(hf[model](input_ids=torch.tensor([seq])).logits[0], -1)
        return -(lsm.exp() * lsm).sum(-1) / math.log(320)

    prompts = prompts_of([5, 12, 19, 8], seed=31)
    # A tau inside both models' ranges, so spans of both kinds happen.
    probe = torch.cat([norm_entropy(m, prompts[1]) for m in hf])
    tau = float(probe.median())
    outs, _ = run(group(peaky_pair, {"name": "r_stitch", "tau": tau}), prompts)
    long_span = False
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert check_exact(hf, prompt, c.token_ids, c.token_models) >= 14
        seq = prompt + c.token_ids
        h = {m: norm_entropy(m, seq) for m in hf}
        for j, writer in enumerate(c.token_models):
            row = len(prompt) + j - 1  # the row whose distribution produced token j
            prev = c.token_models[j - 1] if j else "small"
            if writer == "small":
                assert h["small"][row] < tau  # the small model kept it: it was confident
            elif prev == "small":
                assert h["small"][row] >= tau  # the small model was unsure and sent it up
            elif h["large"][row - 1] >= tau:
                long_span = True  # the large model kept writing: it was still unsure
            else:
                # It handed back after its last token, and the small model sent this one up again.
                assert h["small"][row] >= tau
            if writer == "large" and j + 1 < len(c.token_models) and c.token_models[j + 1] == "small":
                assert h["large"][row] < tau  # the span ended when the large model became confident
    assert long_span, "the large model never kept writing: the test tau is uninformative"


@pytest.fixture(scope="module")
def trio(pair_paths, tmp_path_factory):
    from tokenrouter.models.random_model import build_random_model

    root = tmp_path_factory.mktemp("trio")
    return {**pair_paths, "medium": build_random_model(root / "medium", "llama", "tiny", seed=13, hidden_size=96,
                                                      num_hidden_layers=2, intermediate_size=192)}


def test_ensemble_three_models(trio):
    from transformers import AutoModelForCausalLM

    hf = {n: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for n, p in trio.items()}
    names = ("small", "medium", "large")
    prompts = prompts_of([3 + 5 * i for i in range(12)], seed=32)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, seed=None)
    with RoutedLLM(group(trio, {"name": "ensemble", "weights": [0.5, 0.3, 0.2]}, names=names, paths=trio)) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
        stats = llm.last_run
        # Every model frees every copy once the request ends, also a PENDING copy at a model the
        # finisher never exchanged the request with (the finish is passed on along the hand-off path).
        deadline = time.monotonic() + 10
        while True:
            left = {n: (s.live_requests, s.total_pages - s.free_pages - s.cached_pages)
                    for n, s in llm.entry.stats().items()}
            if all(v == (0, 0) for v in left.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert all(v == (0, 0) for v in left.values()), left
    counts = dict.fromkeys(names, 0)
    switches = total = 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert check_exact(hf, prompt, c.token_ids, c.token_models) >= 35
        for m in c.token_models:
            counts[m] += 1
        switches += sum(a != b for a, b in zip(c.token_models, c.token_models[1:]))
        total += len(c.token_models)
    # 480 draws: each share within 4.5 standard deviations of its weight.
    for name, w in zip(names, (0.5, 0.3, 0.2)):
        sd = math.sqrt(w * (1 - w) / total)
        assert abs(counts[name] / total - w) < 4.5 * sd, (name, counts[name] / total)
    # Consecutive tokens switch models with probability 1 - sum(w^2) = 0.62.
    rate = switches / (total - len(prompts))
    assert abs(rate - 0.62) < 4.5 * math.sqrt(0.62 * 0.38 / (total - len(prompts)))
    assert stats.handoffs == switches + sum(o.outputs[0].token_models[0] != "small" for o in outs)


def test_ensemble_draws_match_weights_offline():
    alg = make_algorithm("ensemble", ["a", "b", "c", "d"], {"weights": [4, 3, 2, 1]})
    writers = alg.writers(list(range(20000)), [7] * 20000)
    for i, w in enumerate((0.4, 0.3, 0.2, 0.1)):
        share = writers.count(i) / 20000
        assert abs(share - w) < 4.5 * math.sqrt(w * (1 - w) / 20000)


def test_different_vocabularies_are_refused(pair_paths, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(pair_paths["large"], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {k + "x" if v == 5 else k: v for k, v in tok["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="different vocabularies"):
        RoutedLLM(group(pair_paths, {"name": "bernoulli", "p": 0.5}, paths={"small": pair_paths["small"],
                                                                           "large": other}))
