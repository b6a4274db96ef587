"""Server helpers for tests: the subprocess helpers live in the package
(tokenrouter.bench.server_process); `pair_group_yaml` writes the routed group most server tests serve."""

from pathlib import Path

from tokenrouter.bench.server_process import ServerProcess, alive, children, free_port

__all__ = ["ServerProcess", "alive", "children", "free_port", "pair_group_yaml"]


def pair_group_yaml(folder: Path, pair_paths: dict, p: float = 0.5, name: str = "pair", extra: str = "") -> Path:
    """group.yaml in `folder`: the tiny random pair (conftest's `pair_paths`), each model with a
    4096-token KV cache in pages of 4, Bernoulli routing with probability `p`; `extra` is appended
    (more YAML fields, e.g. an executor)."""
    cfg = Path(folder) / "group.yaml"
    cfg.write_text(
        f"name: {name}\nmodels:\n"
        f"  - {{name: small, path: {pair_paths['small']}, kv_cache_tokens: 4096, page_size: 4}}\n"
        f"  - {{name: large, path: {pair_paths['large']}, kv_cache_tokens: 4096, page_size: 4}}\n"
        f"algorithm: {{name: bernoulli, p: {p}}}\n" + extra)
    return cfg
