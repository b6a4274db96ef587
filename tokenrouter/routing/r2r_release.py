"""R2R's published routers -> our router folder (router.safetensors + router.json).

What thu-nics/R2R publishes, as its own code writes and reads it:

- The checkpoint (r2r/models/router.py save_model, load_model): a torch.save of a dict {model_type,
  init_args, common_args: {threshold, input_type}, model_specific_args, state_dict}. save_model writes
  two files: NAME.pt, whose state_dict leaves out the token embedding, and NAME_all.pt, which keeps it
  as token_embeddings.weight. Every published pair's router is a `HiddenStatesTokenLMHeadLogitsClassifier`
  trained from resource/default_training_config*.json: init_args hidden_states_size (the small model's
  hidden size), logits_size 100 (the top-k logits it reads), hidden_dims [1024] * 6, expansion_factor 4,
  dropout_rate 0.1, use_position_embedding false, freeze_lm_head true, normalize_input false, and
  either pretrained_model_name (the small model; the Qwen3 releases) or, in the first release
  (DeepSeek-R1-Distill-Qwen-1.5B with -32B, before the field existed), dtype torch.float32 instead.
  common_args.threshold is the threshold its training calibrated; common_args.input_type is
  [hidden_states, token, logits].
- Where: a Hugging Face repository or folder holding the .pt file; their loader takes the first of
  RELEASE_FILES it finds there, else the first .pt file by name (find_release does the same here).
- The per-pair config (config/SMALL+LARGE.yaml, JSON text): the small ("quick") and large
  ("reference") models, and under `router` the router's path, override_init_args (which replace those
  init_args; each release's names its small model) and optionally a threshold, which their server
  takes before any other. A downloaded pair folder may hold it as config.yaml (what their
  launch_r2r_server.py reads from a folder) or model_configs.json (their load_config_from_folder).

The token embedding is the small model's own and is not converted: the served small model supplies it.
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
RELEASE_FILES = ("default_router.pt", "router.pt", "default_router_sampling.pt")
FOLDER_CONFIGS = ("config.yaml", "model_configs.json")
# Their class's default pretrained_model_name: the small model of a checkpoint whose init_args name none.
DEFAULT_SMALL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
EMBEDDING = "token_embeddings.weight"


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
    strategy = (cfg["router"] or {}).get("switching_strategy", "neural")
    if strategy != "neural":
        raise ValueError(f"{path}: router.switching_strategy is {strategy!r}; only 'neural' (a trained router "
                         "checkpoint) converts")
    return cfg


def find_release(folder: str | Path) -> tuple[Path, Path | None]:
    """The checkpoint a downloaded release folder holds, chosen as their loader chooses, and the pair
    config beside it (None if it has none)."""
    folder = Path(folder)
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    name = next((n for n in RELEASE_FILES if n in files), None) or next((n for n in files if n.endswith(".pt")), None)
    if name is None:
        # The collection repository holds one subfolder per pair.
        nested = sorted(str(p.relative_to(folder)) for p in folder.glob("*/*.pt"))
        hint = f"; give one of its pairs' files: {', '.join(nested)}" if nested else ""
        raise ValueError(f"{folder}: no router checkpoint (.pt) in this folder{hint}")
    return folder / name, next((folder / n for n in FOLDER_CONFIGS if n in files), None)


def merged_init_args(ckpt: dict[str, Any], override_init_args: dict[str, Any] | None) -> dict[str, Any]:
    """init_args as their loader builds the router: the pair config's override_init_args replace the
    checkpoint's own."""
    return {**ckpt.get("init_args", {}), **(override_init_args or {})}


def released_router(ckpt: dict[str, Any], init: dict[str, Any]) -> R2RReleasedRouter:
    """Our module with their weights, built from `init` (merged_init_args); ValueError naming what does
    not fit."""
    if ckpt["model_type"] != MODEL_TYPE:
        raise ValueError(f"R2R router type {ckpt['model_type']!r} is not supported; only {MODEL_TYPE} "
                         "(the routers R2R publishes for its model pairs)")
    inputs = (ckpt.get("common_args") or {}).get("input_type")
    if inputs is not None and list(inputs) != INPUTS:
        raise ValueError(f"R2R router inputs {inputs} are not supported; only {INPUTS}")
    if init.get("use_position_embedding"):
        raise ValueError("R2R routers with use_position_embedding are not supported")
    state = {k: v for k, v in ckpt["state_dict"].items() if k != EMBEDDING}
    if EMBEDDING in ckpt["state_dict"] and init.get("freeze_lm_head") is False:
        raise ValueError("this R2R router trained its token embedding (freeze_lm_head false); it reads the "
                         "small model's own embedding here, so it cannot be served as is")
    hidden = int(init.get("hidden_states_size", 1536))
    top_k = int(init.get("logits_size", 100))
    combined = state.get("combined_projection.weight")
    if combined is None:
        raise ValueError("the R2R checkpoint has no combined_projection.weight")
    # Built without weights (the checkpoint supplies every one: strict), in float32 as their server runs it.
    with torch.device("meta"):
        head = R2RReleasedRouter(hidden, top_k, int(combined.shape[1]) - 2 * hidden,
                                 [int(d) for d in init.get("hidden_dims", [256, 512, 256])],
                                 int(init.get("expansion_factor", 4)), bool(init.get("normalize_input", False)))
    try:
        head.load_state_dict({k: v.float() for k, v in state.items()}, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"the R2R checkpoint does not match its init_args: {e}") from None
    return head.eval()


def convert_r2r_router(checkpoint: str | Path, out: str | Path, pair_config: str | Path | None = None,
                       small: str | Path | None = None, large: str | Path | None = None,
                       threshold: float | None = None) -> Path:
    """Write our router folder for one of R2R's checkpoints. `checkpoint`: their .pt file, or a
    downloaded release folder (find_release; its pair config is used when `pair_config` is None).
    `pair_config`: their config/X.yaml for this pair (its override_init_args apply, its model names are
    recorded); `small`/`large`: the model folders it will be served with, whose fingerprints the router
    then checks at bind (else it checks only the small model's hidden size); `threshold`: instead of the
    pair config's router.threshold, else the checkpoint's common_args.threshold (their server, given
    neither, uses its --threshold default of 0.5)."""
    if Path(checkpoint).is_dir():
        checkpoint, found = find_release(checkpoint)
        pair_config = found if pair_config is None else pair_config
    ckpt = read_checkpoint(checkpoint)
    cfg = read_pair_config(pair_config) if pair_config is not None else {}
    init = merged_init_args(ckpt, (cfg.get("router") or {}).get("override_init_args"))
    head = released_router(ckpt, init)
    official = (ckpt.get("common_args") or {}).get("threshold")
    configured = (cfg.get("router") or {}).get("threshold")
    if threshold is not None:
        origin = "argument"
    elif configured is not None:
        threshold, origin = configured, "pair config router.threshold"
    elif official is not None:
        threshold, origin = official, "common_args.threshold"
    else:
        raise ValueError(f"{checkpoint} holds no threshold (common_args.threshold): give one")
    pair: dict[str, dict[str, Any]] = {}
    for role, folder, theirs in (("small", small, "quick"), ("large", large, "reference")):
        entry: dict[str, Any] = {}
        if (cfg.get(theirs) or {}).get("model_path"):
            entry["name"] = cfg[theirs]["model_path"]
        elif role == "small":
            entry["name"] = init.get("pretrained_model_name", DEFAULT_SMALL)
        if folder is not None:
            entry.update(path=str(folder), fingerprint=_fingerprint(folder))
        pair[role] = entry
    if small is not None:
        size = json.loads((Path(small) / "config.json").read_text())["hidden_size"]
        if size != head.hidden_size or size != head.embed_dim:
            raise ValueError(f"the R2R router reads hidden states of size {head.hidden_size} and embeddings of "
                             f"size {head.embed_dim}; small model {small} has hidden size {size}")
        _check_embedding(ckpt["state_dict"].get(EMBEDDING), small, checkpoint)
    source = {"layout": R2RReleasedRouter.layout, "checkpoint": str(checkpoint), "model_type": ckpt["model_type"],
              "official_threshold": official, "threshold_from": origin}
    if pair_config is not None:
        source["pair_config"] = str(pair_config)
    return save_router(out, head, float(threshold), pair, extra={"source": source})


def _check_embedding(stored: torch.Tensor | None, small: str | Path, checkpoint: str | Path) -> None:
    """A NAME_all.pt checkpoint keeps the embedding of the small model it was trained with: it must be
    the served small model's, which is what the router reads. Compared rounded through bfloat16, so a
    float32 copy of bfloat16 weights matches them."""
    if stored is None:
        return
    from tokenrouter.engine.model_loader import load_tensor

    own = load_tensor(small, "model.embed_tokens.weight")
    if tuple(stored.shape) != tuple(own.shape) or not torch.equal(stored.to(torch.bfloat16), own.to(torch.bfloat16)):
        raise ValueError(f"{EMBEDDING} in {checkpoint} (the embedding of the small model the router was trained "
                         f"with, shape {tuple(stored.shape)}) is not small model {small}'s (shape {tuple(own.shape)})")


def _fingerprint(folder: str | Path) -> str:
    from tokenrouter.engine.model_loader import load_tensor

    config = json.loads((Path(folder) / "config.json").read_text())
    return model_fingerprint(config, load_tensor(folder, "model.embed_tokens.weight"))
