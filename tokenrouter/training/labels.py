"""Router training data: a corpus, cut into sequences, teacher-forced through both models.

At every position t of a sequence x_0 .. x_{n-1} (t < n-1, so that x_{t+1} exists) we record what the
serving code sees when the small model has just read x_0 .. x_t:

- the small model's final normalised hidden state h_t (HF `model.model(ids).last_hidden_state`);
- the small model's greedy token s_t = argmax of its logits, and its top-k logits (descending);
- the large model's greedy token l_t on the same prefix;
- log p_small(x_{t+1}) and log p_large(x_{t+1}) (for Co-LLM's mixture likelihood).

Labels (1 = this position should go to the large model):

- `differs`: s_t != l_t. CITER's "not acceptable" and Co-LLM's weak labels.
- `divergent` (R2R): s_t != l_t and the large model's greedy continuations of k tokens from
  prefix + s_t and from prefix + l_t differ. The paper asks a verifier model whether the two
  continuations mean the same; comparing tokens is a cheap, stricter stand-in (any difference in the
  next k tokens counts as divergent).
"""

from __future__ import annotations

import inspect
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


# ---------------------------------------------------------------------------------------------- corpus
def read_corpus(path: str | Path) -> list[str]:
    """Texts from a .txt file (the whole file is one text), a .jsonl file (one JSON object per line
    with a "text" field), or a directory of such files (sorted by name; .txt and .jsonl)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".txt", ".jsonl"))
        if not files:
            raise ValueError(f"corpus directory {str(path)!r} holds no .txt or .jsonl files")
        return [t for f in files for t in read_corpus(f)]
    if not path.is_file():
        raise ValueError(f"corpus {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{path}:{i}: expected an object with a string \"text\" field")
            texts.append(obj["text"])
        return texts
    return [path.read_text(encoding="utf-8", errors="replace")]


def check_same_vocab(small_tok: Any, large_tok: Any) -> None:
    """Token-level routing swaps token ids between the models, so their vocabularies must be one."""
    a, b = small_tok.get_vocab(), large_tok.get_vocab()
    if a == b:
        return
    only_a = sorted(set(a) - set(b))[:3]
    only_b = sorted(set(b) - set(a))[:3]
    moved = [t for t in a if t in b and a[t] != b[t]][:3]
    detail = []
    if only_a:
        detail.append(f"only the small model has {only_a}")
    if only_b:
        detail.append(f"only the large model has {only_b}")
    if moved:
        detail.append(f"different ids for {moved}")
    raise ValueError(
        f"the small and large models' tokenizers differ ({len(a)} vs {len(b)} entries; {'; '.join(detail)}); "
        "token-level routing needs both models to share one vocabulary")


def make_sequences(texts: Iterable[str], tokenizer: Any, seq_len: int, max_tokens: int | None = None,
                   max_sequences: int | None = None) -> list[list[int]]:
    """Tokenise each text (the tokenizer's default special tokens) and cut it into pieces of at most
    seq_len tokens; pieces under 2 tokens are dropped. Stops at max_sequences pieces or max_tokens
    tokens in all (the last piece cut short)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    seqs: list[list[int]] = []
    total = 0
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        for start in range(0, len(ids), seq_len):
            piece = ids[start:start + seq_len]
            if max_tokens is not None:
                piece = piece[:max_tokens - total]
            if len(piece) < 2:
                continue
            seqs.append(list(piece))
            total += len(piece)
            if (max_sequences is not None and len(seqs) >= max_sequences) or \
                    (max_tokens is not None and total >= max_tokens):
                return seqs
    return seqs


# ------------------------------------------------------------------------------------------- features
@dataclass
class Features:
    """Per-position router inputs and labels, all on CPU. N positions, hidden H, top-k K.

    `label` is the positive class of the kind being trained (1 = send to the large model). `seq` is the
    position's sequence index (the held-out split is by sequence); `pos` its index in the sequence.
    `embed` is the small model's input embedding [V, H] (R2R looks up the sampled token's row)."""

    hidden: torch.Tensor  # [N, H] float32
    label: torch.Tensor  # [N] float32
    seq: torch.Tensor  # [N] long
    token: torch.Tensor | None = None  # [N] long: the small model's greedy token
    large_token: torch.Tensor | None = None  # [N] long: the large model's greedy token
    top_logits: torch.Tensor | None = None  # [N, K] float32, descending
    embed: torch.Tensor | None = None  # [V, H]
    lp_small: torch.Tensor | None = None  # [N] log p_small(x_{t+1})
    lp_large: torch.Tensor | None = None  # [N] log p_large(x_{t+1})
    differs: torch.Tensor | None = None  # [N] float32: s_t != l_t (Co-LLM's weak labels)
    pos: torch.Tensor | None = None  # [N] long
    stats: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.hidden.shape[0])


def by_length(seqs: Sequence[Sequence[int]], batch: int) -> list[list[int]]:
    """Batches of sequence indices of equal length (no padding, so no attention masks anywhere)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(seqs):
        groups[len(s)].append(i)
    return [idx[j:j + batch] for n in sorted(groups) for idx in [groups[n]] for j in range(0, len(idx), batch)]


def decoder(model: Any) -> Any:
    """The transformer body of a causal LM (its hidden states, without the lm_head)."""
    body = getattr(model, "model", None)
    if body is None:
        raise ValueError(f"{type(model).__name__}: expected a causal LM with a .model body and an .lm_head")
    return body


@torch.no_grad()
def teacher_force(small: Any, large: Any, seqs: Sequence[Sequence[int]], top_k: int, batch_size: int = 8,
                  device: str | torch.device = "cpu", progress: bool = True) -> dict[str, torch.Tensor]:
    """Both models over every sequence; per position t < n-1 of each: hidden, greedy tokens, top-k
    logits and the next token's log-probabilities (see the module docstring). Rows in sequence order."""
    per_seq: list[dict[str, torch.Tensor] | None] = [None] * len(seqs)
    batches = by_length(seqs, batch_size)
    n_tok = sum(len(s) for s in seqs)
    with tqdm(total=n_tok, desc="teacher forcing", unit="tok", disable=not progress) as bar:
        for idx in batches:
            ids = torch.tensor([list(seqs[i]) for i in idx], dtype=torch.long, device=device)
            hidden = decoder(small)(input_ids=ids).last_hidden_state
            ls = small.lm_head(hidden).float()
            ll = large(input_ids=ids).logits.float()
            target = ids[:, 1:]
            lsm_s = torch.log_softmax(ls[:, :-1], -1)
            lsm_l = torch.log_softmax(ll[:, :-1], -1)
            out = {
                "hidden": hidden[:, :-1].float(),
                "small_tok": ls[:, :-1].argmax(-1),
                "large_tok": ll[:, :-1].argmax(-1),
                "top_logits": ls[:, :-1].topk(top_k, dim=-1).values,
                "lp_small": lsm_s.gather(-1, target[..., None]).squeeze(-1),
                "lp_large": lsm_l.gather(-1, target[..., None]).squeeze(-1),
            }
            for row, i in enumerate(idx):
                per_seq[i] = {k: v[row].cpu() for k, v in out.items()}
            bar.update(ids.numel())
    assert all(p is not None for p in per_seq)
    cat = {k: torch.cat([p[k] for p in per_seq]) for k in per_seq[0]} if per_seq else {}  # type: ignore[index]
    cat["seq"] = torch.cat([torch.full((len(s) - 1,), i, dtype=torch.long) for i, s in enumerate(seqs)])
    cat["pos"] = torch.cat([torch.arange(len(s) - 1) for s in seqs])
    return cat


def _cache_kw(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache` (5.x); use whichever this version takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def branch_continuations(model: Any, seq: Sequence[int], pos: torch.Tensor, first: torch.Tensor, steps: int,
                         device: str | torch.device = "cpu") -> torch.Tensor:
    """[rows, steps]: for each row r, the model's greedy continuation (EOS ignored) of
    seq[:pos[r] + 1] + [first[r]], all rows branching off one pass over `seq`.

    The sequence runs through the model once; each row copies its KV cache and masks out the cached
    positions after its own branch point, so a row costs `steps` one-token decodes instead of a
    prefill of its whole prefix. Position ids follow the branch, not the cache slot."""
    kw = _cache_kw(model)
    n = len(seq)
    rows = first.numel()
    base = getattr(model(input_ids=torch.tensor([list(seq)], device=device), use_cache=True), kw)
    base.batch_repeat_interleave(rows)
    pos = pos.to(device)
    mask = (torch.arange(n + steps, device=device)[None, :] <= pos[:, None]).long()
    mask[:, n:] = 1
    tok = first.to(device)
    out = []
    for s in range(steps):
        step = model(input_ids=tok[:, None], attention_mask=mask[:, :n + s + 1], position_ids=(pos + 1 + s)[:, None],
                     use_cache=True, **{kw: base})
        base = getattr(step, kw)
        tok = step.logits[:, -1].argmax(-1)
        out.append(tok)
    return torch.stack(out, 1).cpu()


@torch.no_grad()
def divergence_labels(large: Any, seqs: Sequence[Sequence[int]], seq_idx: torch.Tensor, pos: torch.Tensor,
                      small_tok: torch.Tensor, large_tok: torch.Tensor, continuation: int = 8,
                      batch_size: int = 64, device: str | torch.device = "cpu",
                      progress: bool = True) -> torch.Tensor:
    """R2R labels for the positions where the models' greedy tokens differ (given as parallel tensors
    seq_idx, pos, small_tok, large_tok): 1 where the large model's greedy continuations of
    `continuation` tokens from prefix + small token and from prefix + large token differ.

    Batched by sequence: every candidate of a sequence branches off one pass over it (two rows per
    candidate, at most batch_size rows per batch)."""
    out = torch.zeros(seq_idx.numel(), dtype=torch.float32)
    if seq_idx.numel() == 0:
        return out
    by_seq: dict[int, list[int]] = defaultdict(list)
    for j, i in enumerate(seq_idx.tolist()):
        by_seq[i].append(j)
    pairs = max(1, batch_size // 2)
    with tqdm(total=seq_idx.numel(), desc="continuations", unit="pos", disable=not progress) as bar:
        for i, js_all in by_seq.items():
            for k in range(0, len(js_all), pairs):
                js = torch.tensor(js_all[k:k + pairs])
                first = torch.stack([small_tok[js], large_tok[js]], 1).reshape(-1)
                cont = branch_continuations(large, seqs[i], pos[js].repeat_interleave(2), first, continuation,
                                            device)
                out[js] = (cont[0::2] != cont[1::2]).any(-1).float()
                bar.update(len(js))
    return out


def build_features(kind: str, small: Any, large: Any, seqs: Sequence[Sequence[int]], top_k: int = 100,
                   continuation: int = 8, batch_size: int = 8, continuation_batch: int = 64,
                   device: str | torch.device = "cpu", progress: bool = True,
                   first_rows: Sequence[int] | None = None,
                   outcome: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                   ) -> Features:
    """Teacher-force both models over `seqs` and label every position for `kind`.

    first_rows: per sequence, the first position kept (an exchange's answer starts at its prompt
    length - 1: the router never decides inside a prompt); default all. outcome (R2R only): labels the
    differing positions instead of the k-token continuations, given (sequence, position, small token)
    rows (outcome_labels.py)."""
    if kind not in ("citer", "r2r", "co_llm"):
        raise ValueError(f"unknown router kind {kind!r}: citer, r2r or co_llm")
    if not seqs:
        raise ValueError("no training sequences (is the corpus empty?)")
    if outcome is not None and kind != "r2r":
        raise ValueError(f"outcome labels are R2R's; {kind} is labelled by the greedy tokens")
    if first_rows is not None and len(first_rows) != len(seqs):
        raise ValueError(f"first_rows has {len(first_rows)} entries for {len(seqs)} sequences")
    vocab = small.lm_head.out_features if hasattr(small.lm_head, "out_features") else small.config.vocab_size
    k = max(1, min(top_k, int(vocab)))
    tf = teacher_force(small, large, seqs, k, batch_size, device, progress)
    if first_rows is not None:
        keep = tf["pos"] >= torch.tensor(list(first_rows), dtype=torch.long)[tf["seq"]]
        tf = {name: v[keep] for name, v in tf.items()}
    differs = (tf["small_tok"] != tf["large_tok"]).float()
    stats: dict[str, Any] = {"sequences": len(seqs), "positions": int(differs.numel()),
                             "differs_share": float(differs.mean()) if differs.numel() else float("nan")}
    label = differs
    if kind == "r2r":
        cand = differs.bool()
        if outcome is not None:
            div = outcome(tf["seq"][cand], tf["pos"][cand], tf["small_tok"][cand])
            stats["labels"] = "outcome"
        else:
            div = divergence_labels(large, seqs, tf["seq"][cand], tf["pos"][cand], tf["small_tok"][cand],
                                    tf["large_tok"][cand], continuation, continuation_batch, device, progress)
            stats["continuation"] = continuation
        label = torch.zeros_like(differs)
        label[cand] = div
        stats["divergent_share"] = float(label.mean())
    embed = small.get_input_embeddings().weight.detach().float().cpu() if kind == "r2r" else None
    return Features(hidden=tf["hidden"], label=label, seq=tf["seq"], token=tf["small_tok"],
                    large_token=tf["large_tok"],
                    top_logits=tf["top_logits"] if kind == "r2r" else None, embed=embed,
                    lp_small=tf["lp_small"], lp_large=tf["lp_large"], differs=differs, pos=tf["pos"],
                    stats=stats)
