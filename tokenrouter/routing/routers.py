"""Router heads (small PyTorch modules over a model's step outputs) and their folders.

A router folder holds `router.safetensors` and `router.json`: the kind, its architecture, the inputs
it reads (which model, which layer), the calibrated threshold, and the model pair it was trained
for. Routers read raw hidden states, which mean nothing for another model, so binding checks the
fingerprints of both models of the pair and refuses a mismatch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from tokenrouter.routing import r2r_kernel

ROUTER_FORMAT = 1


class CiterRouter(nn.Module):
    """CITER: MLP over the small model's last hidden state -> one logit; sigmoid = confidence that the
    small model's token is fine (hidden -> 2 hidden -> hidden, batch norm, ReLU, dropout 0.1)."""

    kind = "citer"

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        h = hidden_size
        self.net = nn.Sequential(
            nn.Linear(h, 2 * h), nn.BatchNorm1d(2 * h), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(2 * h, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(h, 1),
        )

    def arch(self) -> dict[str, Any]:
        return {"hidden_size": self.net[0].in_features}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net(hidden.float()).squeeze(-1)


class _ResidualBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class R2RRouter(nn.Module):
    """R2R: [last hidden state, embedding of the sampled token, projected top-k logits] -> project ->
    residual MLP blocks (LayerNorm, 4x, GELU, dropout) -> LayerNorm -> one logit (route when
    sigmoid >= threshold). The token embedding is the small model's own (frozen, not stored here).

    The blocks' width defaults to a quarter of the hidden size: at full width (13M parameters for a
    512-wide model) the router cost a third of a 30M model's decode step; a quarter costs a few percent
    (benchmarks/bench_router_cost.py, in git history)."""

    kind = "r2r"

    def __init__(self, hidden_size: int, top_k: int = 100, width: int | None = None, blocks: int = 6) -> None:
        super().__init__()
        w = width or max(64, hidden_size // 4)
        self.top_k, self.hidden_size, self.width, self.blocks = top_k, hidden_size, w, blocks
        self.logit_proj = nn.Linear(top_k, hidden_size)
        self.inp = nn.Linear(3 * hidden_size, w)
        self.body = nn.Sequential(*(_ResidualBlock(w) for _ in range(blocks)))
        self.norm = nn.LayerNorm(w)
        self.out = nn.Linear(w, 1)

    def arch(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "top_k": self.top_k, "width": self.width, "blocks": self.blocks}

    def forward(self, hidden: torch.Tensor, token_emb: torch.Tensor, top_logits: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden.float(), token_emb.float(), self.logit_proj(top_logits.float())], dim=-1)
        return self.out(self.norm(self.body(self.inp(x)))).squeeze(-1)

    @torch.no_grad()
    def scorer(self, embed: torch.Tensor) -> RouterScorer:
        return FoldedR2R(self, embed)


RouterScorer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class FoldedR2R:
    """R2RRouter's forward for serving, one call per step: (last hidden states, sampled token ids, top-k
    logits) -> one logit per row. The input projection is folded with what feeds it: its token
    columns times the frozen embedding become a table of one projected row per token (a row read
    instead of a product), and its logit columns times `logit_proj` one small map. The whole forward is
    one C call on the CPU (r2r_kernel.c), tensor calls on pre-transposed weights elsewhere. Equal to the
    module's forward up to float rounding (tests/test_algorithms.py). The table holds vocabulary x width
    float32 values (28 MB for SmolLM2)."""

    def __init__(self, head: R2RRouter, embed: torch.Tensor) -> None:
        h = head.hidden_size
        w_in = head.inp.weight.float()
        w_hidden, w_token, w_logits = w_in[:, :h], w_in[:, h:2 * h], w_in[:, 2 * h:]
        self.width = head.width
        self.token_rows = embed.float() @ w_token.t()  # vocabulary x width
        self.hidden_map = w_hidden.t().contiguous()
        self.logit_map = (w_logits @ head.logit_proj.weight.float()).t().contiguous()
        self.bias = head.inp.bias.float() + w_logits @ head.logit_proj.bias.float()
        self.blocks = [(b.norm.weight, b.norm.bias, b.norm.eps, b.up.weight.t().contiguous(), b.up.bias,
                        b.down.weight.t().contiguous(), b.down.bias) for b in head.body]
        self.norm = (head.norm.weight, head.norm.bias, head.norm.eps)
        self.out_map, self.out_bias = head.out.weight.t().contiguous(), head.out.bias
        lib = r2r_kernel.load_library_once() if embed.device.type == "cpu" else None
        self.kernel = None if lib is None else r2r_kernel.RouterKernel(
            lib, self.token_rows, self.hidden_map, self.logit_map, self.bias, self.blocks, self.norm, self.out_map,
            self.out_bias)

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor, top_logits: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(hidden, tokens, top_logits)
        return self.forward_torch(hidden, tokens, top_logits)

    @torch.inference_mode()
    def forward_torch(self, hidden: torch.Tensor, tokens: torch.Tensor, top_logits: torch.Tensor) -> torch.Tensor:
        """The same forward as torch calls: where the kernel cannot be built, and off the CPU."""
        x = torch.addmm(self.bias + self.token_rows[tokens], hidden.float(), self.hidden_map)
        x = torch.addmm(x, top_logits.float(), self.logit_map)
        for norm_w, norm_b, eps, up_w, up_b, down_w, down_b in self.blocks:
            y = F.gelu(torch.addmm(up_b, F.layer_norm(x, (self.width,), norm_w, norm_b, eps), up_w))
            x = torch.addmm(x + down_b, y, down_w)
        norm_w, norm_b, eps = self.norm
        return torch.addmm(self.out_bias, F.layer_norm(x, (self.width,), norm_w, norm_b, eps), self.out_map).squeeze(-1)


class _ReleasedBlock(nn.Module):
    """One block of R2R's released routers: x -> proj(x) + MLP(LayerNorm(x)), where proj is a linear
    map when the width changes and the identity otherwise (parameter names as in their checkpoints)."""

    def __init__(self, dim_in: int, dim_out: int, expansion: int) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(dim_in)
        # Their dropouts are Identity here (inference only); they keep the checkpoints' indices mlp.0, mlp.3.
        self.mlp = nn.Sequential(nn.Linear(dim_in, dim_in * expansion), nn.GELU(), nn.Identity(),
                                 nn.Linear(dim_in * expansion, dim_out), nn.Identity())
        self.dim_change = nn.Linear(dim_in, dim_out) if dim_in != dim_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dim_change(x) + self.mlp(self.layer_norm(x))


class _ReleasedBackbone(nn.Module):
    def __init__(self, hidden_dims: list[int], expansion: int) -> None:
        super().__init__()
        dims = [*hidden_dims, hidden_dims[-1]]
        self.input_projection = nn.Linear(dims[0], dims[0])
        self.blocks = nn.ModuleList(_ReleasedBlock(dims[i], dims[i + 1], expansion) for i in range(len(hidden_dims)))
        self.output_layer = nn.Sequential(nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_projection(x)
        for block in self.blocks:
            x = block(x)
        return self.output_layer(x)


class R2RReleasedRouter(nn.Module):
    """The routers R2R's authors publish (thu-nics/R2R, r2r/models/router.py,
    HiddenStatesTokenLMHeadLogitsClassifier): [last hidden state, embedding of the sampled token,
    projected top-k logits] -> linear -> linear -> blocks of widths `hidden_dims` -> LayerNorm -> one
    logit. Same inputs and decision (sigmoid >= threshold) as R2RRouter, their layout; the token
    embedding is the small model's own, as in their inference (it is not stored in their checkpoints).
    Converted with `tokenrouter convert-router` (routing/r2r_release.py)."""

    kind = "r2r"
    layout = "thu-nics/R2R"

    def __init__(self, hidden_size: int, top_k: int, embed_dim: int, hidden_dims: list[int],
                 expansion_factor: int = 4, normalize_input: bool = False) -> None:
        super().__init__()
        self.hidden_size, self.top_k, self.embed_dim = hidden_size, top_k, embed_dim
        self.hidden_dims, self.expansion_factor = list(hidden_dims), expansion_factor
        self.normalize_input = normalize_input
        if normalize_input:
            self.layer_norm_hidden_states = nn.LayerNorm(hidden_size)
            self.layer_norm_token = nn.LayerNorm(embed_dim)
        self.logits_projection = nn.Linear(top_k, hidden_size)
        self.combined_projection = nn.Linear(2 * hidden_size + embed_dim, self.hidden_dims[0])
        self.backbone = _ReleasedBackbone(self.hidden_dims, expansion_factor)

    def arch(self) -> dict[str, Any]:
        return {"layout": self.layout, "hidden_size": self.hidden_size, "top_k": self.top_k,
                "embed_dim": self.embed_dim, "hidden_dims": self.hidden_dims,
                "expansion_factor": self.expansion_factor, "normalize_input": self.normalize_input}

    def forward(self, hidden: torch.Tensor, token_emb: torch.Tensor, top_logits: torch.Tensor) -> torch.Tensor:
        hidden, token_emb, top_logits = hidden.float(), token_emb.float(), top_logits.float()
        if self.normalize_input:
            hidden = self.layer_norm_hidden_states(hidden)
            token_emb = self.layer_norm_token(token_emb)
            top_logits = torch.softmax(top_logits, dim=-1)
        x = torch.cat([hidden, token_emb, self.logits_projection(top_logits)], dim=-1)
        return self.backbone(self.combined_projection(x)).squeeze(-1)

    def scorer(self, embed: torch.Tensor) -> RouterScorer:
        return lambda hidden, tokens, top_logits: self(hidden, embed[tokens], top_logits)


class DeferralHead(nn.Module):
    """Co-LLM: one extra 'defer' logit from the small model's last hidden state."""

    kind = "co_llm"

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)

    def arch(self) -> dict[str, Any]:
        return {"hidden_size": self.proj.in_features}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.float()).squeeze(-1)


ROUTER_KINDS: dict[str, type[nn.Module]] = {c.kind: c for c in (CiterRouter, R2RRouter, DeferralHead)}
# Routers of a kind saved in another project's layout (router.json's arch.layout names it).
ROUTER_LAYOUTS: dict[str, type[nn.Module]] = {R2RReleasedRouter.layout: R2RReleasedRouter}


def model_fingerprint(config: dict[str, Any], embed: torch.Tensor) -> str:
    """Identifies a model's weights cheaply: its shape facts and a sample of its embedding."""
    facts = {k: config.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size")}
    h = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    # Rounded through bfloat16, so the same weights served in float32 or bfloat16 agree.
    sample = embed.detach().cpu().flatten()[:4096].to(torch.bfloat16).float()
    h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def save_router(folder: str | Path, head: nn.Module, threshold: float, pair: dict[str, dict[str, Any]],
                extra: dict[str, Any] | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
              str(folder / "router.safetensors"))
    meta = {"format": ROUTER_FORMAT, "kind": head.kind, "arch": head.arch(), "threshold": float(threshold),
            "inputs": {"model": "small", "layer": "last"}, "pair": pair, **(extra or {})}
    (folder / "router.json").write_text(json.dumps(meta, indent=2))
    return folder


class LoadedRouter:
    def __init__(self, head: nn.Module, meta: dict[str, Any], folder: str | Path | None = None) -> None:
        self.head = head.eval()
        self.meta = meta
        self.folder = folder
        self.threshold = float(meta["threshold"])

    @property
    def kind(self) -> str:
        return str(self.meta["kind"])

    def check_pair(self, role: str, fingerprint: str, model: str | None = None) -> None:
        """Refuse to run on a model this router was not trained for."""
        check_pair(self.meta, role, fingerprint, model, self.folder)


def check_pair(meta: dict[str, Any], role: str, fingerprint: str, model: str | None = None,
               folder: str | Path | None = None) -> None:
    """Refuse a `role` ("small" or "large") model whose fingerprint is not the one the router of
    `meta` was trained for; `model` (its path) and `folder` (the router's) make the message clear."""
    trained = meta.get("pair", {}).get(role, {})
    want = trained.get("fingerprint")
    if want is None or want == fingerprint:
        return
    router = f"{meta.get('kind')} router" + (f" {folder}" if folder is not None else "")
    was = f"{trained['path']} (fingerprint {want})" if trained.get("path") else f"fingerprint {want}"
    now = f"{model} (fingerprint {fingerprint})" if model else f"fingerprint {fingerprint}"
    raise ValueError(f"this {router} was trained for another {role} model: it was trained for {role} model "
                     f"{was}, this group's {role} model is {now}; train one for this pair")


def router_meta(folder: str | Path, kind: str | None = None) -> dict[str, Any]:
    """A router folder's router.json, checked (cheap: the entry calls it to fail fast)."""
    folder = Path(folder)
    meta_file = folder / "router.json"
    if not meta_file.is_file():
        raise ValueError(f"{str(folder)!r} is not a router folder: it has no router.json")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != ROUTER_FORMAT:
        raise ValueError(f"{meta_file}: unsupported router format {meta.get('format')!r}")
    if kind is not None and meta.get("kind") != kind:
        raise ValueError(f"{folder} holds a {meta.get('kind')!r} router, not a {kind!r} one")
    return meta


def engine_fingerprint(engine: Any) -> str:
    """The fingerprint of the model an engine serves (see model_fingerprint). Under tensor parallelism
    the embedding is read from the checkpoint for this and not kept (a large model's would be big)."""
    config = json.loads((Path(engine.cfg.model_path) / "config.json").read_text())
    if getattr(engine, "tp", None) is not None and getattr(engine, "_full_embedding", None) is None:
        from tokenrouter.engine.model_loader import load_tensor

        return model_fingerprint(config, load_tensor(engine.cfg.model_path, "model.embed_tokens.weight"))
    return model_fingerprint(config, engine.embedding_weight())


def load_router(folder: str | Path, kind: str | None = None) -> LoadedRouter:
    folder = Path(folder)
    meta = router_meta(folder, kind)
    arch = dict(meta["arch"])
    layout = arch.pop("layout", None)
    cls = ROUTER_LAYOUTS.get(layout) if layout is not None else ROUTER_KINDS.get(meta.get("kind", ""))
    if cls is None:
        what = f"router layout {layout!r}" if layout is not None else f"router kind {meta.get('kind')!r}"
        raise ValueError(f"{folder}: unknown {what}")
    head = cls(**arch)
    head.load_state_dict(load_file(str(folder / "router.safetensors")))
    return LoadedRouter(head, meta, folder)
