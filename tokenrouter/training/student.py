"""Train the small model of a routed pair: a narrow, shallow Llama that shares the large model's
tokenizer, distilled from the large model on chat-formatted CHAMP solutions.

A decode step of a 135M-parameter model on CPU is dominated by reading its weights, so the student
is sized by parameter count: its own narrow embedding (tied to its LM head, as in the teacher) and a
few layers. Two things make minutes of CPU enough to get real text out of it:
- the embedding starts as the teacher's, projected onto the teacher embedding's top principal
  directions, so tokens begin with the teacher's geometry instead of noise;
- the loss is the teacher's full next-token distribution (KL) mixed with the data's cross-entropy:
  every position teaches ~49k numbers, not one.
Deterministic given the seed (single-threaded CPU kernels are; multi-threaded reductions may differ
in the last bits).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenrouter.training import champ

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


@dataclass
class StudentSettings:
    """The student's shape and its training run (prepare's flags map onto these)."""

    seed: int = 0
    hidden_size: int = 256
    num_layers: int = 6
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 4  # sequences per step
    steps: int = 200
    lr: float = 3e-3
    warmup: int = 10
    kd_weight: float = 0.5  # share of the loss from the teacher's distribution (the rest: data CE)
    held_out_sequences: int = 16  # from held-out problems, for the reported metrics

    def validate(self) -> None:
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads", "seq_len",
                     "batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"student {name} must be at least 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"student hidden_size {self.hidden_size} must divide into num_heads {self.num_heads}, "
                             f"and num_heads into num_kv_heads {self.num_kv_heads}")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ValueError(f"kd_weight must be in [0, 1], got {self.kd_weight}")

    def key(self) -> str:
        """A short stable name for the cache (changes whenever any setting does)."""
        return settings_key(dataclasses.asdict(self))


def settings_key(obj: Any) -> str:
    """A short stable hash of JSON-able settings: cache folder names."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


def chat_texts(tokenizer: Any, problems: Sequence[champ.Problem], seed: int, reverse: bool = False) -> Iterator[str]:
    """Every (problem, model-written solution) pair as a chat exchange in the tokenizer's template, in a
    seeded order (rendered lazily: consumers stop early). The student reads from the front; with
    reverse=True the routers read the same order from the back, so they label text the student never
    trained on."""
    pairs = [(p.prompt, sol) for p in problems for sol in p.solutions]
    random.Random(seed).shuffle(pairs)
    for prompt, sol in reversed(pairs) if reverse else pairs:
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": sol}]
        yield tokenizer.apply_chat_template(msgs, tokenize=False)


def pack(tokenizer: Any, texts: Iterable[str], seq_len: int, count: int) -> torch.Tensor:
    """The first `count` sequences of seq_len tokens from the texts, concatenated (no padding)."""
    need = count * seq_len
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer.encode(t, add_special_tokens=False))
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(f"the corpus gave {len(ids)} tokens; {need} needed ({count} x {seq_len})")
    return torch.tensor(ids[:need]).view(count, seq_len)


def student_config(teacher_config: Any, s: StudentSettings) -> Any:
    from transformers import LlamaConfig

    t = teacher_config
    return LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        head_dim=s.hidden_size // s.num_heads, max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps, rope_parameters=dict(t.rope_parameters), tie_word_embeddings=True,
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id,
        hidden_act="silu", dtype="float32",
    )


def projected_embedding(teacher_embed: torch.Tensor, width: int) -> torch.Tensor:
    """The teacher's token embeddings on their top-`width` principal directions, rescaled so a row has
    the usual init norm: the student's starting vocabulary geometry."""
    e = teacher_embed.float()
    cov = e.T @ e
    _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    proj = e @ vecs[:, -width:].flip(-1)
    return proj * (0.02 * math.sqrt(width) / proj.norm(dim=-1).mean())


def _lr(step: int, s: StudentSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _loss(student: Any, teacher: Any, batch: torch.Tensor, kd_weight: float) -> tuple[torch.Tensor, float, float]:
    """(loss, data CE, KL to the teacher) over every next-token position of the batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = student(inputs).logits.float()
    logp = F.log_softmax(logits, dim=-1).flatten(0, 1)
    ce = F.nll_loss(logp, targets.reshape(-1))
    if kd_weight == 0.0:  # plain language modelling: skip the teacher's forward, most of a step's cost
        return ce, float(ce.detach()), float("nan")
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(inputs).logits.float(), dim=-1).flatten(0, 1)
    kl = F.kl_div(logp, t_logp, log_target=True, reduction="batchmean")
    return kd_weight * kl + (1 - kd_weight) * ce, float(ce.detach()), float(kl.detach())


@torch.no_grad()
def _held_out(student: Any, teacher: Any, seqs: torch.Tensor) -> dict[str, float]:
    ce_s = ce_t = kl = 0.0
    for row in seqs.split(4):
        inputs, targets = row[:, :-1], row[:, 1:].reshape(-1)
        ls = F.log_softmax(student(inputs).logits.float(), -1).flatten(0, 1)
        lt = F.log_softmax(teacher(inputs).logits.float(), -1).flatten(0, 1)
        ce_s += float(F.nll_loss(ls, targets, reduction="sum"))
        ce_t += float(F.nll_loss(lt, targets, reduction="sum"))
        kl += float(F.kl_div(ls, lt, log_target=True, reduction="sum"))
    n = seqs.numel() - seqs.shape[0]
    return {"student_ce": ce_s / n, "teacher_ce": ce_t / n, "kl_to_teacher": kl / n, "positions": n}


def train_student(teacher_path: str | Path, out: str | Path, settings: StudentSettings | None = None,
                  progress: bool = True) -> Path:
    """Train the student for the teacher at `teacher_path` and write it, with the teacher's tokenizer
    files and a student.json of settings and metrics, atomically to `out`. Returns `out`."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    s = settings or StudentSettings()
    s.validate()
    teacher_path, out = Path(teacher_path), Path(out)
    if not (teacher_path / "config.json").is_file():
        raise ValueError(f"{str(teacher_path)!r} is not a Hugging Face model folder (no config.json)")
    tok = AutoTokenizer.from_pretrained(str(teacher_path))
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_path), dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    data = champ.split(seed=s.seed)
    train = pack(tok, chat_texts(tok, data.train, s.seed), s.seq_len + 1, s.steps * s.batch_size)
    held = pack(tok, chat_texts(tok, data.held_out, s.seed), s.seq_len + 1, s.held_out_sequences)

    torch.manual_seed(s.seed)
    student = LlamaForCausalLM(student_config(teacher.config, s))
    with torch.no_grad():
        student.get_input_embeddings().weight.copy_(
            projected_embedding(teacher.get_input_embeddings().weight, s.hidden_size))
    opt = torch.optim.AdamW(student.parameters(), lr=s.lr, weight_decay=0.01, betas=(0.9, 0.95))

    start = time.monotonic()
    history = []
    bar = tqdm(range(s.steps), desc="train small model", unit="step", disable=not progress)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(step, s)
        batch = train[step * s.batch_size:(step + 1) * s.batch_size]
        loss, ce, kl = _loss(student, teacher, batch, s.kd_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        bar.set_postfix(ce=f"{ce:.2f}", kl=f"{kl:.2f}")
        if step % 10 == 0 or step == s.steps - 1:
            history.append({"step": step, "ce": round(ce, 4), "kl": round(kl, 4)})
    seconds = time.monotonic() - start
    student.eval()
    metrics = _held_out(student, teacher, held)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".student-", dir=out.parent))
    try:
        student.save_pretrained(str(tmp))
        for name in TOKENIZER_FILES:
            if (teacher_path / name).is_file():
                shutil.copy2(teacher_path / name, tmp / name)
        meta = {"settings": dataclasses.asdict(s), "teacher": str(teacher_path.resolve()),
                "parameters": sum(p.numel() for p in student.parameters()),
                "train_tokens": s.steps * s.batch_size * s.seq_len, "train_seconds": round(seconds, 1),
                "torch_threads": torch.get_num_threads(), "held_out": metrics, "history": history}
        (tmp / "student.json").write_text(json.dumps(meta, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
