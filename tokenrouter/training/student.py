"""Train the small model of a routed pair, distilled from the large model (the teacher) on
chat-formatted CHAMP solutions and on the teacher's own answers to training problems of the tasks the
pair is judged on (sequence-level distillation: large_answers.py); it shares the teacher's tokenizer.

By default the student is **carved** from the teacher: a few of its layers (the first two and the
last) at full width, with its embedding, final norm and tied LM head, then healed by distillation.
Carved untrained, such a model is useless (held-out CE 20-60); healed for a few minutes it is far
ahead of a narrow model trained from scratch on the same tokens, because everything it keeps (the
vocabulary geometry, the head that reads the teacher's last hidden space, the layers' own functions)
would cost the scratch model most of its budget to learn (docs/QUALITY.md, benchmarks/student_recipes.py).
With `layers=()` the student is the earlier recipe's narrow Llama trained from scratch, its own
embedding starting as the teacher's projected onto its top principal directions.

Training reads the teacher once: its top-k next-token log-probabilities at every training position
are computed first and kept (the teacher's forward costs more than the student's step), and the loss
is the cross-entropy to that renormalised top-k distribution mixed with the data's cross-entropy.
The embedding (and so the tied head) stays frozen. Where the CPU multiplies bfloat16 natively
(AVX512-BF16 or AMX) both passes run under bfloat16 autocast, about twice as fast; the weights and
the optimiser stay float32.
Deterministic given the seed on one machine (single-threaded CPU kernels are; multi-threaded
reductions and different CPUs may differ in the last bits).
"""

from __future__ import annotations

import copy
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
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tokenrouter.models.config import ModelConfig
from tokenrouter.models.gguf_weights import BLOCK_KINDS, GGUF_FILE, BlockWeight, read_gguf, write_gguf
from tokenrouter.training import champ
from tokenrouter.training.large_answers import Exchange

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


@dataclass
class StudentSettings:
    """The student's shape and its training run (prepare's flags map onto these)."""

    seed: int = 0
    # The teacher's layers the student is carved from, in order (3 of SmolLM2's 30: a decode step costs
    # a third to two-fifths of SmolLM2's Q4_1 step in our engine; docs/QUALITY.md). Empty: a narrow
    # Llama from scratch, shaped by the five fields below (which a carved student ignores).
    layers: tuple[int, ...] = (0, 1, 29)
    hidden_size: int = 256
    num_layers: int = 6
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 4  # sequences per step
    steps: int = 150
    train_sequences: int = 600  # distinct training sequences (the teacher reads each once); steps cycle over them
    lr: float = 3e-3
    warmup: int = 10
    kd_weight: float = 0.8  # share of the loss from the teacher's distribution (the rest: data CE)
    top_k: int = 32  # teacher log-probabilities kept per position (SmolLM2's top 32 hold ~96% of its mass)
    bf16: bool | None = None  # bfloat16 autocast; None: where the CPU multiplies bfloat16 natively
    held_out_sequences: int = 16  # from held-out problems, for the reported metrics
    # Sequence-level distillation: sequences of seq_len packed from the large model's own answers to
    # training problems of every eval task (large_answers.py), added to the corpus sequences above.
    task_sequences: int = 0
    # After training, the student is stored in blocks as SmolLM2's file is (models/gguf_weights.py):
    # its projections as these, its embedding and tied head as Q8_0, and model.safetensors holds their
    # dequantized values; the engine serves the blocks (--quantization auto). None: float only. Q8_0,
    # not SmolLM2's Q4_1: on the default pair Q4_1 cost 1.6 points of answer agreement with SmolLM2
    # (54.5% to 52.8%) for 5 MB less a step, beside the head's 28 MB (student.json records both).
    quantization: str | None = "Q8_0"

    def validate(self) -> None:
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads", "seq_len",
                     "batch_size", "steps", "train_sequences", "top_k", "held_out_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"student {name} must be at least 1, got {getattr(self, name)}")
        if self.task_sequences < 0:
            raise ValueError(f"student task_sequences must be at least 0, got {self.task_sequences}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"student hidden_size {self.hidden_size} must divide into num_heads {self.num_heads}, "
                             f"and num_heads into num_kv_heads {self.num_kv_heads}")
        if any(i < 0 for i in self.layers) or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"student layers must be distinct non-negative teacher layer indices in increasing "
                             f"order, got {list(self.layers)}")
        if self.train_sequences < self.batch_size:
            raise ValueError(f"student train_sequences ({self.train_sequences}) must be at least batch_size "
                             f"({self.batch_size})")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ValueError(f"kd_weight must be in [0, 1], got {self.kd_weight}")
        if self.quantization is not None and self.quantization not in BLOCK_KINDS:
            raise ValueError(f"student quantization must be one of {', '.join(BLOCK_KINDS)} or None, got "
                             f"{self.quantization!r}")

    def uses_bf16(self) -> bool:
        if self.bf16 is not None:
            return self.bf16
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())

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
    return pack_ids((tokenizer.encode(t, add_special_tokens=False) for t in texts), seq_len, count)


def pack_ids(pieces: Iterable[Sequence[int]], seq_len: int, count: int) -> torch.Tensor:
    """The first `count` sequences of seq_len tokens from the pieces' ids, concatenated (no padding)."""
    need = count * seq_len
    ids: list[int] = []
    for piece in pieces:
        ids.extend(piece)
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


class TeacherTargets(NamedTuple):
    """The teacher's top-k next-token log-probabilities at every position of the training sequences."""

    logprobs: torch.Tensor  # [sequences, seq_len, k] float32, descending
    tokens: torch.Tensor  # [sequences, seq_len, k] int32


@torch.no_grad()
def teacher_targets(teacher: Any, seqs: torch.Tensor, k: int, bf16: bool, progress: bool,
                    batch_size: int = 8) -> TeacherTargets:
    """One teacher pass over `seqs` ([n, seq_len + 1] token ids: inputs and next tokens)."""
    from tqdm import tqdm

    vals, toks = [], []
    with tqdm(total=len(seqs), desc="teacher top-k", unit="seq", disable=not progress) as bar:
        for rows in seqs.split(batch_size):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = teacher(rows[:, :-1]).logits
            v, i = F.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
            vals.append(v)
            toks.append(i.int())
            bar.update(len(rows))
    return TeacherTargets(torch.cat(vals), torch.cat(toks))


def carve(teacher: Any, layers: Sequence[int]) -> Any:
    """A model of the teacher's class made of the teacher's `layers` (in order), with its embedding,
    final norm and head: the carved student before healing."""
    n = teacher.config.num_hidden_layers
    if not layers or max(layers) >= n:
        raise ValueError(f"student layers {list(layers)} must be indices of the teacher's {n} layers")
    cfg = copy.deepcopy(teacher.config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    student = type(teacher)(cfg)
    new_index = {old: new for new, old in enumerate(layers)}
    state = {}
    for name, value in teacher.state_dict().items():
        if name.startswith("model.layers."):
            old, rest = name[len("model.layers."):].split(".", 1)
            if int(old) not in new_index:
                continue
            name = f"model.layers.{new_index[int(old)]}.{rest}"
        state[name] = value
    student.load_state_dict(state)
    return student


def distillation_loss(student: Any, batch: torch.Tensor, target: TeacherTargets, kd_weight: float,
          bf16: bool) -> tuple[torch.Tensor, float]:
    """(loss, data CE): kd_weight x cross-entropy to the teacher's renormalised top-k distribution +
    (1 - kd_weight) x the data's cross-entropy, over every next-token position of the batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = student(inputs).logits
    logp = F.log_softmax(logits.float(), dim=-1)
    ce = F.nll_loss(logp.flatten(0, 1), targets.reshape(-1))
    p_teacher = F.softmax(target.logprobs, dim=-1)  # renormalised over the top k
    kd = -(p_teacher * logp.gather(-1, target.tokens.long())).sum(-1).mean()
    return kd_weight * kd + (1 - kd_weight) * ce, float(ce.detach())


@torch.no_grad()
def answer_agreement(student: Any, exchanges: Sequence[Exchange]) -> dict[str, float]:
    """On the large model's own answers (held out from training): the student's per-token CE of the
    answer tokens and how often its top-1 token is the large model's (teacher-forced on the answer)."""
    ce = agree = 0.0
    n = 0
    for e in exchanges:
        ids = torch.tensor([e.ids])
        logp = F.log_softmax(student(ids[:, :-1]).logits.float()[0], -1)[len(e.prompt) - 1:]
        target = torch.tensor(e.answer)
        ce += float(F.nll_loss(logp, target, reduction="sum"))
        agree += float((logp.argmax(-1) == target).sum())
        n += len(e.answer)
    return {"answer_ce": ce / max(1, n), "answer_top1_agreement": agree / max(1, n), "answer_tokens": n}


@torch.no_grad()
def held_out_metrics(student: Any, teacher: Any, seqs: torch.Tensor) -> dict[str, float]:
    """Per-token CE of both models on held-out sequences and KL(teacher || student), float32."""
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


def initial_student(teacher: Any, s: StudentSettings) -> Any:
    """The student before training: carved from the teacher (s.layers), or a narrow Llama whose
    embedding is the teacher's projected (no layers)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(s.seed)
    if s.layers:
        student = carve(teacher, s.layers)
    else:
        student = LlamaForCausalLM(student_config(teacher.config, s))
        with torch.no_grad():
            student.get_input_embeddings().weight.copy_(
                projected_embedding(teacher.get_input_embeddings().weight, s.hidden_size))
    for p in student.parameters():
        p.requires_grad_(True)
    if s.layers:  # the teacher's vocabulary geometry (and, tied, its head) is kept as it is
        student.get_input_embeddings().weight.requires_grad_(False)
    return student


@torch.no_grad()
def quantize_student(student: Any, path: Path, kind: str) -> None:
    """Write the student's weights to `path` as a GGUF file (projections as `kind` blocks, the
    embedding and tied head as Q8_0) and put their dequantized values into the student in place, so
    its float weights are exactly what the blocks hold."""
    cfg = ModelConfig.from_dict(student.config.to_dict())
    state = student.state_dict()
    tied = cfg.tie_word_embeddings
    write_gguf(path, {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}, cfg, kind, "Q8_0")
    for name, weight in read_gguf(path, cfg).items():
        state[name].copy_(weight.dequantize() if isinstance(weight, BlockWeight) else weight)


def train_student(teacher_path: str | Path, out: str | Path, settings: StudentSettings | None = None,
                  progress: bool = True, exchanges: Sequence[Exchange] = (),
                  held_exchanges: Sequence[Exchange] = (),
                  targets_cache: dict[str, TeacherTargets] | None = None) -> Path:
    """Train the student for the teacher at `teacher_path` and write it, with the teacher's tokenizer
    files and a student.json of settings and metrics, atomically to `out`. `exchanges`: the teacher's
    answers to training problems, packed into settings.task_sequences sequences (in a seeded order);
    `held_exchanges`: answers it never trains on, for the answer metrics. `targets_cache`: students
    trained on the same sequences share the teacher's pass through it (keyed by the teacher, the
    sequences, k and the precision), as recipes compared in one run do. Returns `out`."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s = settings or StudentSettings()
    s.validate()
    teacher_path, out = Path(teacher_path), Path(out)
    if not (teacher_path / "config.json").is_file():
        raise ValueError(f"{str(teacher_path)!r} is not a Hugging Face model folder (no config.json)")
    tok = AutoTokenizer.from_pretrained(str(teacher_path))
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_path), dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    bf16 = s.uses_bf16()

    data = champ.split(seed=s.seed)
    train = pack(tok, chat_texts(tok, data.train, s.seed), s.seq_len + 1, s.train_sequences)
    if s.task_sequences:
        shuffled = list(exchanges)
        random.Random(s.seed).shuffle(shuffled)
        train = torch.cat([train, pack_ids((e.ids for e in shuffled), s.seq_len + 1, s.task_sequences)])
    held = pack(tok, chat_texts(tok, data.held_out, s.seed), s.seq_len + 1, s.held_out_sequences)

    start = time.monotonic()
    if targets_cache is None:
        targets = teacher_targets(teacher, train, s.top_k, bf16, progress)
    else:
        parts = [str(teacher_path.resolve()), str(tuple(train.shape)), str(s.top_k), str(bf16)]
        key = hashlib.sha256(b"\0".join([*(p.encode() for p in parts), train.numpy().tobytes()])).hexdigest()
        if key not in targets_cache:
            targets_cache[key] = teacher_targets(teacher, train, s.top_k, bf16, progress)
        targets = targets_cache[key]
    teacher_seconds = time.monotonic() - start
    student = initial_student(teacher, s)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.01, betas=(0.9, 0.95))

    history = []
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(s.seed))
    student.train()
    bar = tqdm(range(s.steps), desc="train small model", unit="step", disable=not progress)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(step, s)
        rows = order[torch.arange(step * s.batch_size, (step + 1) * s.batch_size) % len(train)]
        batch_targets = TeacherTargets(targets.logprobs[rows], targets.tokens[rows])
        loss, ce = distillation_loss(student, train[rows], batch_targets, s.kd_weight, bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(ce=f"{ce:.2f}")
        if step % 10 == 0 or step == s.steps - 1:
            history.append({"step": step, "ce": round(ce, 4), "loss": round(float(loss.detach()), 4)})
    seconds = time.monotonic() - start
    student.eval()

    def measured() -> dict[str, float]:
        metrics = held_out_metrics(student, teacher, held)
        if held_exchanges:
            metrics.update(answer_agreement(student, held_exchanges))
        return metrics

    metrics = measured()
    float_metrics = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".student-", dir=out.parent))
    try:
        if s.quantization is not None:
            quantize_student(student, tmp / GGUF_FILE, s.quantization)
            float_metrics, metrics = metrics, measured()
        student.save_pretrained(str(tmp))
        for name in TOKENIZER_FILES:
            if (teacher_path / name).is_file():
                shutil.copy2(teacher_path / name, tmp / name)
        meta = {"settings": dataclasses.asdict(s), "teacher": str(teacher_path.resolve()), "bf16": bf16,
                "parameters": sum(p.numel() for p in student.parameters()),
                "train_tokens": len(train) * s.seq_len, "steps_tokens": s.steps * s.batch_size * s.seq_len,
                "teacher_seconds": round(teacher_seconds, 1), "train_seconds": round(seconds, 1),
                "torch_threads": torch.get_num_threads(), "held_out": metrics, "history": history}
        if float_metrics is not None:  # before quantization: what storing it as blocks changed
            meta["held_out_float"] = float_metrics
        (tmp / "student.json").write_text(json.dumps(meta, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
