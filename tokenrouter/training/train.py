"""Training router heads (CITER, R2R, Co-LLM) on teacher-forced features, and the end-to-end
`train_router` that goes from two model folders and a corpus to a router folder.

Heads train in float32 with AdamW; held-out sequences (a seeded split by sequence) drive early
stopping (best held-out loss kept, stop after `patience` epochs without improvement) and then the
threshold calibration and the metrics written into router.json.

- CITER: BCE on "small token acceptable" (= small greedy == large greedy).
- R2R: BCE on "divergent" (see labels.py).
- Co-LLM: `init_epochs` of BCE on the weak labels (the models' greedy tokens differ), then the
  mixture likelihood -log[(1 - s(z)) p_small(x_t) + s(z) p_large(x_t)] over the corpus tokens. With
  `full_finetune` the small model itself is then fine-tuned together with the head on the same loss
  and saved next to the router (the published method); without it only the head is trained.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from tokenrouter.routing.routers import CiterRouter, DeferralHead, R2RRouter, model_fingerprint, save_router
from tokenrouter.training.calibrate import RULE_OF_KIND, Calibration, auc, calibrate, evaluate
from tokenrouter.training.labels import Features, build_features, check_same_vocab, make_sequences
from tokenrouter.training.large_answers import Exchange

KINDS = ("citer", "r2r", "co_llm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainSettings:
    """Every knob of router training (the CLI flags map one to one)."""

    seed: int = 0
    # data
    seq_len: int = 256
    max_tokens: int | None = 100_000
    max_sequences: int | None = None
    held_out: float = 0.2  # share of sequences held out (early stopping, calibration, metrics)
    # labels
    top_k: int = 100  # R2R: top-k logits (capped at the vocabulary size)
    continuation: int = 8  # R2R: greedy tokens the large model writes after each candidate
    label_batch_size: int = 8  # sequences per teacher-forcing forward
    continuation_batch_size: int = 64  # rows per continuation forward (two per candidate)
    # head training
    epochs: int = 30
    lr: float = 1e-3
    weight_decay: float = 5e-4
    batch_size: int = 256
    patience: int = 5
    pos_weight: float = 1.0  # BCE weight of positives (tokens that should go to the large model)
    width: int | None = None  # R2R body width (default: a quarter of the hidden size, at least 64)
    blocks: int = 6  # R2R residual blocks
    init_epochs: int = 3  # Co-LLM: epochs of BCE on the weak labels before the mixture loss
    # Co-LLM full fine-tuning of the small model (the published method)
    full_finetune: bool = False
    finetune_epochs: int = 3
    finetune_lr: float = 1e-5
    finetune_batch_size: int = 8  # sequences per step
    # calibration
    target_recall: float | None = None  # default 0.95 when target_share is not given
    target_share: float | None = None
    # runtime
    device: str = "auto"
    dtype: str = "float32"
    progress: bool = True

    def validate(self) -> None:
        if not 0.0 < self.held_out < 1.0:
            raise ValueError(f"held_out must be in (0, 1), got {self.held_out}")
        if self.target_recall is not None and self.target_share is not None:
            raise ValueError("give a target recall or a target large share, not both")
        for name in ("epochs", "batch_size", "seq_len", "top_k", "continuation", "label_batch_size",
                     "continuation_batch_size", "blocks", "finetune_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.patience < 1 or self.init_epochs < 0 or self.finetune_epochs < 0:
            raise ValueError("patience must be >= 1, init_epochs and finetune_epochs >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


def make_settings(settings: TrainSettings | None = None, **kw: Any) -> TrainSettings:
    s = copy.copy(settings) if settings is not None else TrainSettings()
    names = {f.name for f in dataclasses.fields(TrainSettings)}
    unknown = sorted(set(kw) - names)
    if unknown:
        raise ValueError(f"unknown training settings {unknown}; known: {sorted(names)}")
    for k, v in kw.items():
        setattr(s, k, v)
    s.validate()
    return s


# ----------------------------------------------------------------------------------------------- heads
def make_head(kind: str, hidden_size: int, top_k: int = 100, width: int | None = None, blocks: int = 6) -> nn.Module:
    if kind == "citer":
        return CiterRouter(hidden_size)
    if kind == "r2r":
        return R2RRouter(hidden_size, top_k=top_k, width=width, blocks=blocks)
    if kind == "co_llm":
        return DeferralHead(hidden_size)
    raise ValueError(f"unknown router kind {kind!r}: {', '.join(KINDS)}")


def head_inputs(kind: str, feats: Features, idx: torch.Tensor,
                device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """The head's inputs for positions idx (features stay on the CPU; the batch moves to `device`)."""
    h = feats.hidden[idx]
    if kind == "r2r":
        if feats.embed is None or feats.token is None or feats.top_logits is None:
            raise ValueError("r2r features need embed, token and top_logits")
        out: tuple[torch.Tensor, ...] = (h, feats.embed[feats.token[idx]], feats.top_logits[idx])
    else:
        out = (h,)
    return tuple(t.to(device) for t in out) if device is not None else out


def _device_of(head: nn.Module) -> torch.device:
    return next(head.parameters()).device


@torch.no_grad()
def head_scores(kind: str, head: nn.Module, feats: Features, idx: torch.Tensor | None = None,
                batch_size: int = 4096) -> torch.Tensor:
    """sigmoid(head(...)) in eval mode, float32: the number the serving code compares to its threshold."""
    idx = torch.arange(len(feats)) if idx is None else idx
    head.eval()
    dev = _device_of(head)
    out = [torch.sigmoid(head(*head_inputs(kind, feats, idx[i:i + batch_size], dev)).float()).cpu()
           for i in range(0, idx.numel(), batch_size)]
    return torch.cat(out) if out else torch.zeros(0)


def split_by_sequence(seq: torch.Tensor, held_out: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position indices of the training and held-out sequences: a seeded shuffle of the sequence ids,
    the first round(held_out * count) (at least one, at most count - 1) held out."""
    ids = torch.unique(seq)
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 sequences to hold some out, got {ids.numel()} "
                         "(more text, or a smaller --seq-len)")
    g = torch.Generator().manual_seed(seed)
    perm = ids[torch.randperm(ids.numel(), generator=g)]
    n_held = min(max(1, round(held_out * ids.numel())), ids.numel() - 1)
    held = torch.isin(seq, perm[:n_held])
    return (~held).nonzero().squeeze(1), held.nonzero().squeeze(1)


def _weighted_bce(z: torch.Tensor, target: torch.Tensor, positive: torch.Tensor, pos_weight: float) -> torch.Tensor:
    loss = F.binary_cross_entropy_with_logits(z, target, reduction="none")
    if pos_weight != 1.0:
        loss = loss * torch.where(positive > 0.5, pos_weight, 1.0)
    return loss.mean()


def mixture_nll(z: torch.Tensor, lp_small: torch.Tensor, lp_large: torch.Tensor) -> torch.Tensor:
    """Per-token -log[(1 - sigmoid(z)) p_small + sigmoid(z) p_large], computed in log space."""
    return -torch.logaddexp(F.logsigmoid(-z) + lp_small, F.logsigmoid(z) + lp_large)


LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _loss_fn(kind: str, feats: Features, objective: str, pos_weight: float) -> LossFn:
    """objective: 'bce' (the kind's labels), 'weak' (Co-LLM's weak labels) or 'mixture' (Co-LLM)."""
    def bce(head: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        dev = _device_of(head)
        z = head(*head_inputs(kind, feats, idx, dev))
        positive = feats.label[idx].to(dev)
        target = 1.0 - positive if kind == "citer" else positive  # CITER predicts "small token is fine"
        return _weighted_bce(z, target, positive, pos_weight)

    def weak(head: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        assert feats.differs is not None
        dev = _device_of(head)
        z = head(*head_inputs(kind, feats, idx, dev))
        weak_labels = feats.differs[idx].to(dev)
        return _weighted_bce(z, weak_labels, weak_labels, pos_weight)

    def mixture(head: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        if feats.lp_small is None or feats.lp_large is None:
            raise ValueError("co_llm features need lp_small and lp_large")
        dev = _device_of(head)
        z = head(*head_inputs(kind, feats, idx, dev))
        return mixture_nll(z, feats.lp_small[idx].to(dev), feats.lp_large[idx].to(dev)).mean()

    return {"bce": bce, "weak": weak, "mixture": mixture}[objective]


def _has_batchnorm(head: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in head.modules())


@torch.no_grad()
def _eval_loss(head: nn.Module, loss: LossFn, idx: torch.Tensor, batch_size: int) -> float:
    head.eval()
    total = 0.0
    for i in range(0, idx.numel(), batch_size):
        b = idx[i:i + batch_size]
        total += float(loss(head, b)) * b.numel()
    return total / max(1, idx.numel())


def fit(head: nn.Module, loss: LossFn, train_idx: torch.Tensor, held_idx: torch.Tensor, s: TrainSettings,
        gen: torch.Generator, epochs: int, early_stopping: bool = True, desc: str = "train") -> list[dict[str, Any]]:
    """AdamW over shuffled mini-batches; with early stopping, the state with the lowest held-out loss
    is restored at the end. Returns one record per epoch."""
    opt = torch.optim.AdamW(head.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    bn = _has_batchnorm(head)
    best, best_state, bad = math.inf, copy.deepcopy(head.state_dict()), 0
    history: list[dict[str, Any]] = []
    with tqdm(range(epochs), desc=desc, unit="epoch", disable=not s.progress) as bar:
        for epoch in bar:
            head.train()
            perm = train_idx[torch.randperm(train_idx.numel(), generator=gen)]
            tot, n = 0.0, 0
            for i in range(0, perm.numel(), s.batch_size):
                b = perm[i:i + s.batch_size]
                if bn and b.numel() < 2:  # batch norm needs two rows in training mode
                    continue
                value = loss(head, b)
                opt.zero_grad(set_to_none=True)
                value.backward()
                opt.step()
                tot += float(value.detach()) * b.numel()
                n += b.numel()
            held = _eval_loss(head, loss, held_idx, 4096)
            history.append({"epoch": epoch + 1, "train_loss": tot / max(1, n), "held_out_loss": held})
            bar.set_postfix(train=f"{tot / max(1, n):.4f}", held=f"{held:.4f}")
            if not early_stopping:
                continue
            if held < best - 1e-7:
                best, best_state, bad = held, copy.deepcopy(head.state_dict()), 0
            else:
                bad += 1
                if bad >= s.patience:
                    break
    if early_stopping:
        head.load_state_dict(best_state)
    head.eval()
    return history


@dataclass
class TrainedHead:
    head: nn.Module
    calibration: Calibration
    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    train_idx: torch.Tensor
    held_idx: torch.Tensor
    scores: torch.Tensor = field(repr=False, default_factory=lambda: torch.zeros(0))  # held-out scores

    @property
    def threshold(self) -> float:
        return self.calibration.threshold


def held_out_metrics(kind: str, scores: torch.Tensor, labels: torch.Tensor, cal: Calibration) -> dict[str, Any]:
    """AUC (rank formula; for CITER of 1 - confidence), and recall, precision, large share and
    accuracy at the calibrated threshold, against the majority-class baseline."""
    y = labels > 0.5
    base = float(y.float().mean()) if y.numel() else float("nan")
    m = evaluate(scores, labels, cal.threshold, cal.rule)
    return {
        "positions": int(y.numel()),
        "positive_share": base,
        "auc": auc(scores, labels, higher_is_positive=kind != "citer"),
        "threshold": cal.threshold,
        "rule": cal.rule,
        "recall": m["recall"],
        "precision": m["precision"],
        "large_share": m["large_share"],
        "accuracy": m["accuracy"],
        "majority_accuracy": max(base, 1 - base),
        "target_recall": cal.target_recall,
        "target_share": cal.target_share,
    }


def train_head(kind: str, feats: Features, settings: TrainSettings | None = None,
               split: tuple[torch.Tensor, torch.Tensor] | None = None, **kw: Any) -> TrainedHead:
    """Train a `kind` head on `feats` (labels: 1 = should go to the large model), calibrate its
    threshold on the held-out sequences and measure it there. Deterministic given settings.seed."""
    s = make_settings(settings, **kw)
    if kind not in KINDS:
        raise ValueError(f"unknown router kind {kind!r}: {', '.join(KINDS)}")
    train_idx, held_idx = split if split is not None else split_by_sequence(feats.seq, s.held_out, s.seed)
    if train_idx.numel() == 0 or held_idx.numel() == 0:
        raise ValueError("the training and held-out splits must both be non-empty")
    top_k = feats.top_logits.shape[1] if feats.top_logits is not None else s.top_k
    torch.manual_seed(s.seed)
    head = make_head(kind, feats.hidden.shape[1], top_k=top_k, width=s.width, blocks=s.blocks)
    head.to(resolve_device(s.device))
    gen = torch.Generator().manual_seed(s.seed + 1)
    history: list[dict[str, Any]] = []
    if kind == "co_llm":
        if s.init_epochs:
            if feats.differs is None:
                raise ValueError("co_llm features need the weak labels (differs)")
            weak = fit(head, _loss_fn(kind, feats, "weak", s.pos_weight), train_idx, held_idx, s, gen,
                       s.init_epochs, early_stopping=False, desc="weak-label init")
            history += [{**h, "phase": "weak"} for h in weak]
        main = fit(head, _loss_fn(kind, feats, "mixture", s.pos_weight), train_idx, held_idx, s, gen,
                   s.epochs, desc="mixture loss")
        history += [{**h, "phase": "mixture"} for h in main]
    else:
        main = fit(head, _loss_fn(kind, feats, "bce", s.pos_weight), train_idx, held_idx, s, gen,
                   s.epochs, desc=f"train {kind}")
        history = [{**h, "phase": "bce"} for h in main]
    return finish_head(kind, head.cpu(), feats, train_idx, held_idx, s, history)


def finish_head(kind: str, head: nn.Module, feats: Features, train_idx: torch.Tensor, held_idx: torch.Tensor,
                s: TrainSettings, history: list[dict[str, Any]]) -> TrainedHead:
    scores = head_scores(kind, head, feats, held_idx)
    labels = feats.label[held_idx]
    cal = calibrate(scores, labels, target_recall=s.target_recall, target_share=s.target_share,
                    rule=RULE_OF_KIND[kind])
    metrics = held_out_metrics(kind, scores, labels, cal)
    metrics["train_positions"] = int(train_idx.numel())
    metrics["epochs_run"] = sum(1 for h in history if h.get("epoch", 1) >= 1)
    if kind == "co_llm" and feats.lp_small is not None and feats.lp_large is not None:
        with torch.no_grad():
            z = head(*head_inputs(kind, feats, held_idx, _device_of(head))).cpu()
            metrics["nll_small"] = float(-feats.lp_small[held_idx].mean())
            metrics["nll_large"] = float(-feats.lp_large[held_idx].mean())
            metrics["nll_mixture"] = float(mixture_nll(z, feats.lp_small[held_idx], feats.lp_large[held_idx]).mean())
    return TrainedHead(head, cal, metrics, history, train_idx, held_idx, scores)


# ----------------------------------------------------------------------------------- Co-LLM fine-tuning
def _seq_slices(feats: Features, n_seqs: int) -> list[slice]:
    """Features are in sequence order (see teacher_force): sequence i's positions are one slice."""
    counts = torch.bincount(feats.seq, minlength=n_seqs).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return [slice(starts[i], starts[i + 1]) for i in range(n_seqs)]


def finetune_co_llm(small: nn.Module, head: nn.Module, seqs: Sequence[Sequence[int]], feats: Features,
                    train_idx: torch.Tensor, held_idx: torch.Tensor, s: TrainSettings,
                    device: torch.device) -> tuple[Features, list[dict[str, Any]]]:
    """Fine-tune the whole small model and the deferral head on the mixture likelihood (the large
    model's log-probabilities stay the precomputed ones), early-stopped on the held-out sequences.
    Returns features recomputed with the fine-tuned model (hidden states, greedy tokens, p_small, and
    the weak labels against the large model's greedy tokens) and the history."""
    from tokenrouter.training.labels import by_length, decoder

    assert feats.lp_large is not None
    where = _seq_slices(feats, len(seqs))
    lp_large = [feats.lp_large[w] for w in where]
    train_seqs = sorted(set(feats.seq[train_idx].tolist()))
    held_seqs = sorted(set(feats.seq[held_idx].tolist()))
    small.to(device).float()
    head.to(device)
    params = [{"params": small.parameters(), "lr": s.finetune_lr}, {"params": head.parameters(), "lr": s.lr}]
    opt = torch.optim.AdamW(params, weight_decay=s.weight_decay)
    gen = torch.Generator().manual_seed(s.seed + 2)

    def batch_loss(idx: list[int]) -> tuple[torch.Tensor, int]:
        ids = torch.tensor([list(seqs[i]) for i in idx], dtype=torch.long, device=device)
        hidden = decoder(small)(input_ids=ids).last_hidden_state[:, :-1]
        lsm = torch.log_softmax(small.lm_head(hidden).float(), -1)
        lp_s = lsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
        lp_l = torch.stack([lp_large[i] for i in idx]).to(device)
        return mixture_nll(head(hidden), lp_s, lp_l).mean(), lp_s.numel()

    def held_loss() -> float:
        small.eval()
        head.eval()
        tot, n = 0.0, 0
        with torch.no_grad():
            for b in by_length([seqs[i] for i in held_seqs], s.finetune_batch_size):
                value, count = batch_loss([held_seqs[j] for j in b])
                tot, n = tot + float(value.detach()) * count, n + count
        return tot / max(1, n)

    def snapshot() -> tuple[dict[str, Any], dict[str, Any]]:
        return copy.deepcopy(small.state_dict()), copy.deepcopy(head.state_dict())

    best, (best_small, best_head), bad = held_loss(), snapshot(), 0
    history: list[dict[str, Any]] = [{"epoch": 0, "held_out_loss": best, "phase": "finetune"}]
    batches = by_length([seqs[i] for i in train_seqs], s.finetune_batch_size)
    with tqdm(range(s.finetune_epochs), desc="fine-tune small model", unit="epoch", disable=not s.progress) as bar:
        for epoch in bar:
            small.train()
            head.train()
            tot, n = 0.0, 0
            for k in torch.randperm(len(batches), generator=gen).tolist():
                value, count = batch_loss([train_seqs[j] for j in batches[k]])
                opt.zero_grad(set_to_none=True)
                value.backward()
                opt.step()
                tot, n = tot + float(value.detach()) * count, n + count
            held = held_loss()
            history.append({"epoch": epoch + 1, "train_loss": tot / max(1, n), "held_out_loss": held,
                            "phase": "finetune"})
            bar.set_postfix(train=f"{tot / max(1, n):.4f}", held=f"{held:.4f}")
            if held < best - 1e-7:
                best, (best_small, best_head), bad = held, snapshot(), 0
            else:
                bad += 1
                if bad >= s.patience:
                    break
    small.load_state_dict(best_small)
    head.load_state_dict(best_head)
    small.eval()
    head.eval().cpu()
    # The router reads the fine-tuned model's hidden states now: recompute them.
    hidden = torch.zeros_like(feats.hidden)
    lp_small = torch.zeros(len(feats))
    token = torch.zeros(len(feats), dtype=torch.long)
    with torch.no_grad():
        for b in by_length(seqs, s.label_batch_size):
            ids = torch.tensor([list(seqs[i]) for i in b], dtype=torch.long, device=device)
            h = decoder(small)(input_ids=ids).last_hidden_state[:, :-1]
            logits = small.lm_head(h).float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            for row, i in enumerate(b):
                hidden[where[i]] = h[row].float().cpu()
                lp_small[where[i]] = lp[row].cpu()
                token[where[i]] = logits[row].argmax(-1).cpu()
    new = dataclasses.replace(feats, hidden=hidden, lp_small=lp_small, token=token)
    if feats.large_token is not None:
        new.differs = (token != feats.large_token).float()
        new.label = new.differs
        new.stats = {**feats.stats, "differs_share_after_finetune": float(new.differs.mean())}
    return new, history


# ---------------------------------------------------------------------------------------- end to end
def _json_safe(x: Any) -> Any:
    """NaN and infinities as null, so router.json stays standard JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _checkpoint_embedding(path: Path) -> torch.Tensor | None:
    """The input embedding as stored in the folder's safetensors (one file or an index), or None."""
    from safetensors import safe_open

    key = "model.embed_tokens.weight"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text()).get("weight_map", {}).get(key)
        file = path / shard if shard else None
    else:
        file = path / "model.safetensors"
    if file is None or not file.is_file():
        return None
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(key) if key in f.keys() else None


def pair_fingerprint(path: Path, model: nn.Module) -> str:
    """routers.model_fingerprint of a model folder, from the checkpoint's own embedding (the same in
    whatever dtype the engine serves it, as the fingerprint rounds through bfloat16)."""
    config = json.loads((path / "config.json").read_text())
    embed = _checkpoint_embedding(path)
    if embed is None:
        embed = model.get_input_embeddings().weight.detach().cpu()
    return model_fingerprint(config, embed)


def _load_model(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


def train_router(kind: str, small_path: str | Path, large_path: str | Path, texts: Iterable[str],
                 out: str | Path, *, exchanges: Sequence[Exchange] = (),
                 outcome: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 **settings: Any) -> Path:
    """Label `texts` (and `exchanges`: the large model's answers to prompts, labelled on their answer
    tokens only) by teacher-forcing both models, train a `kind` router head, calibrate it on held-out
    sequences, and save it (router.safetensors + router.json with the pair's fingerprints, the metrics
    and the settings) to `out`. `outcome` (R2R, exchanges only): outcome_labels.OutcomeLabeller.
    Settings: the fields of TrainSettings. Returns `out`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    s = make_settings(None, **settings)
    if kind not in KINDS:
        raise ValueError(f"unknown router kind {kind!r}: {', '.join(KINDS)}")
    if s.full_finetune and kind != "co_llm":
        raise ValueError("full_finetune is for co_llm only (CITER and R2R routers read a frozen small model)")
    small_path, large_path, out = Path(small_path), Path(large_path), Path(out)
    for p in (small_path, large_path):
        if not (p / "config.json").is_file():
            raise ValueError(f"{str(p)!r} is not a Hugging Face model folder (no config.json)")
    torch.manual_seed(s.seed)
    device = resolve_device(s.device)
    dtype = DTYPES[s.dtype]

    small_tok = AutoTokenizer.from_pretrained(str(small_path))
    large_tok = AutoTokenizer.from_pretrained(str(large_path))
    check_same_vocab(small_tok, large_tok)
    corpus = make_sequences(texts, small_tok, s.seq_len, s.max_tokens, s.max_sequences)
    if outcome is not None and corpus:
        raise ValueError("outcome labels read exchanges only: give no corpus texts with them")
    if exchanges and s.full_finetune:
        raise ValueError("full_finetune reads whole sequences: train it on corpus texts, not exchanges")
    # exchanges first: sequence i < len(exchanges) is exchanges[i] (the outcome labeller's index)
    seqs = [e.ids for e in exchanges] + corpus
    first_rows = [len(e.prompt) - 1 for e in exchanges] + [0] * len(corpus) if exchanges else None
    if len(seqs) < 2:
        raise ValueError(f"the corpus gave {len(seqs)} sequence(s) of at least 2 tokens; need 2 or more "
                         "(more text, or a smaller --seq-len)")

    small = _load_model(small_path, dtype, device)
    large = _load_model(large_path, dtype, device)
    longest = max(len(q) for q in seqs) + (s.continuation if kind == "r2r" else 0)
    for name, m in (("small", small), ("large", large)):
        limit = getattr(m.config, "max_position_embeddings", None)
        if limit is not None and longest > limit:
            raise ValueError(f"sequences of {longest} tokens (seq_len + continuation) exceed the {name} "
                             f"model's {limit} positions; lower --seq-len")
    fingerprints = {"small": pair_fingerprint(small_path, small),
                    "large": pair_fingerprint(large_path, large)}

    feats = build_features(kind, small, large, seqs, top_k=s.top_k, continuation=s.continuation,
                           batch_size=s.label_batch_size, continuation_batch=s.continuation_batch_size,
                           device=device, progress=s.progress, first_rows=first_rows, outcome=outcome)
    del large
    result = train_head(kind, feats, s)
    small_out = small_path
    if kind == "co_llm" and s.full_finetune:
        small_out = out / "small_model"
        feats, ft_history = finetune_co_llm(small, result.head, seqs, feats, result.train_idx,
                                            result.held_idx, s, device)
        result = finish_head(kind, result.head, feats, result.train_idx, result.held_idx, s,
                             result.history + ft_history)
        small_out.mkdir(parents=True, exist_ok=True)
        small.to(dtype).save_pretrained(str(small_out))
        small_tok.save_pretrained(str(small_out))
        fingerprints["small"] = pair_fingerprint(small_out, small)

    pair = {"small": {"fingerprint": fingerprints["small"], "path": str(small_out.resolve())},
            "large": {"fingerprint": fingerprints["large"], "path": str(large_path.resolve())}}
    training = {
        "settings": {**dataclasses.asdict(s), "progress": None},
        "data": feats.stats,
        "history": result.history,
        "labels": {
            "citer": "1 = small greedy token == large greedy token (acceptable); trained on that, "
                     "calibrated against its complement",
            "r2r": ("1 = greedy tokens differ and the final answer after the small model's token differs "
                    "from the large model's (outcome)" if outcome is not None else
                    f"1 = greedy tokens differ and the large model's {s.continuation}-token greedy "
                    "continuations from the two tokens differ (divergent)"),
            "co_llm": "mixture likelihood over the corpus tokens; weak labels (greedy tokens differ) for "
                      "the warm-up and for calibration",
        }[kind],
        "full_finetune": bool(s.full_finetune),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    save_router(out, result.head, result.threshold, pair,
                extra=_json_safe({"metrics": result.metrics, "calibration": result.calibration.to_dict(),
                                  "training": training}))
    return out
