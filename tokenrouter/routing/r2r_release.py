"""R2R's published routers -> our router folder (router.safetensors + router.json).

The layout, as thu-nics/R2R writes it (r2r/models/router.py: save_model / load_model): a torch.save
of a dict {model_type, init_args, common_args: {threshold, input_type}, model_specific_args,
state_dict}; the routers for their model pairs are `HiddenStatesTokenLMHeadLogitsClassifier` with
init_args hidden_states_size, logits_size (the top-k logits it reads), hidden_dims, expansion_factor,
normalize_input, use_position_embedding, freeze_lm_head, pretrained_model_name (the small model).
The token embedding is the small model's own and is left out of the checkpoint; common_args.threshold
is the threshold their server uses when none is given (the "official" one). A per-pair config
(config/SMALL+LARGE.yaml, JSON text) names the small ("quick") and large ("reference") models and,
under router, the router's path and override_init_args.

The checkpoint is read with torch.load(weights_only=True) only: tensors and plain values, never
arbitrary pickled objects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tokenrouter.routing.routers import R2RReleasedRouter, model_fingerprint, save_router

MODEL_TYPE = "HiddenStatesTokenLMHeadLogitsClassifier"
INPUTS = ["hidden_states", "token", "logits"]


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Their checkpoint dict, loaded without unpickling anything but tensors and plain values."""
    try:
        ckpt = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - refused globals, or not a torch file
        raise ValueError(f"{path}: not a checkpoint torch.load(weights_only=True) can read: {e}") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "model_type" not in ckpt:
        raise ValueError(f"{path}: not an R2R router checkpoint (a dict with model_type and state_dict)")
    return ckpt


def read_pair_config(path: str | Path) -> dict[str, Any]:
    """One of their per-pair configs (JSON text, whatever the file's extension)."""
    text = Path(path).read_text()
    try:
        cfg = json.loads(text)
    except ValueError:
        import yaml

        cfg = yaml.safe_load(text)
    if not isinstance(cfg, dict) or "router" not in cfg:
        raise ValueError(f"{path}: not an R2R pair config (no `router` section)")
    return cfg


def released_router(ckpt: dict[str, Any], override_init_args: dict[str, Any] | None = None) -> R2RReleasedRouter:
    """Our module with their weights; ValueError naming what does not fit."""
    if ckpt["model_type"] != MODEL_TYPE:
        raise ValueError(f"R2R router type {ckpt['model_type']!r} is not supported; only {MODEL_TYPE} "
                         "(the routers R2R publishes for its model pairs)")
    init = {**ckpt.get("init_args", {}), **(override_init_args or {})}
    inputs = (ckpt.get("common_args") or {}).get("input_type")
    if inputs is not None and list(inputs) != INPUTS:
        raise ValueError(f"R2R router inputs {inputs} are not supported; only {INPUTS}")
    if init.get("use_position_embedding"):
        raise ValueError("R2R routers with use_position_embedding are not supported")
    state = {k: v for k, v in ckpt["state_dict"].items() if k != "token_embeddings.weight"}
    if "token_embeddings.weight" in ckpt["state_dict"] and init.get("freeze_lm_head") is False:
        raise ValueError("this R2R router trained its token embedding (freeze_lm_head false); it reads the "
                         "small model's own embedding here, so it cannot be served as is")
    hidden = int(init.get("hidden_states_size", 1536))
    top_k = int(init.get("logits_size", 100))
    combined = state.get("combined_projection.weight")
    if combined is None:
        raise ValueError("the R2R checkpoint has no combined_projection.weight")
    head = R2RReleasedRouter(hidden, top_k, int(combined.shape[1]) - 2 * hidden,
                             [int(d) for d in init.get("hidden_dims", [256, 512, 256])],
                             int(init.get("expansion_factor", 4)), bool(init.get("normalize_input", False)))
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"the R2R checkpoint does not match its init_args: {e}") from None
    return head.eval()


def convert_r2r_router(checkpoint: str | Path, out: str | Path, pair_config: str | Path | None = None,
                       small: str | Path | None = None, large: str | Path | None = None,
                       threshold: float | None = None) -> Path:
    """Write our router folder for one of R2R's checkpoints. `pair_config`: their config/X.yaml for
    this pair (its override_init_args apply, its model names are recorded); `small`/`large`: the model
    folders it will be served with, whose fingerprints the router then checks at bind (else it checks
    only the small model's hidden size); `threshold`: instead of the checkpoint's official one."""
    ckpt = read_checkpoint(checkpoint)
    cfg = read_pair_config(pair_config) if pair_config is not None else {}
    head = released_router(ckpt, (cfg.get("router") or {}).get("override_init_args"))
    if threshold is None:
        threshold = (ckpt.get("common_args") or {}).get("threshold")
        if threshold is None:
            raise ValueError(f"{checkpoint} holds no threshold (common_args.threshold): give one")
    pair: dict[str, dict[str, Any]] = {}
    for role, folder, theirs in (("small", small, "quick"), ("large", large, "reference")):
        entry: dict[str, Any] = {}
        if (cfg.get(theirs) or {}).get("model_path"):
            entry["name"] = cfg[theirs]["model_path"]
        if folder is not None:
            entry.update(path=str(folder), fingerprint=_fingerprint(folder))
        pair[role] = entry
    if small is not None:
        size = json.loads((Path(small) / "config.json").read_text())["hidden_size"]
        if size != head.hidden_size or size != head.embed_dim:
            raise ValueError(f"the R2R router reads hidden states of size {head.hidden_size} and embeddings of "
                             f"size {head.embed_dim}; small model {small} has hidden size {size}")
    source = {"layout": R2RReleasedRouter.layout, "checkpoint": str(checkpoint), "model_type": ckpt["model_type"],
              "official_threshold": (ckpt.get("common_args") or {}).get("threshold")}
    if pair_config is not None:
        source["pair_config"] = str(pair_config)
    return save_router(out, head, float(threshold), pair, extra={"source": source})


def _fingerprint(folder: str | Path) -> str:
    from tokenrouter.engine.model_loader import load_tensor

    config = json.loads((Path(folder) / "config.json").read_text())
    return model_fingerprint(config, load_tensor(folder, "model.embed_tokens.weight"))
