"""Figures from bench JSONL files: throughput against concurrency, and latency distributions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_rows(paths: list[str]) -> list[dict[str, Any]]:
    rows = []
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def plot(paths: list[str], out_dir: str) -> list[Path]:
    rows = load_rows(paths)
    if not rows:
        raise ValueError("no benchmark rows to plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(str(r.get("label") or r.get("model")), []).append(r)
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rs in series.items():
        rs = sorted((r for r in rs if r.get("concurrency")), key=lambda r: r["concurrency"])
        if rs:
            ax.plot([r["concurrency"] for r in rs], [r["output_throughput"] for r in rs], marker="o", label=label)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("Throughput against concurrency")
    fig.tight_layout()
    written.append(out / "throughput.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, rs in series.items():
        for ax, key in zip(axes, ("e2e", "ttft")):
            vals = sorted(x[key] for r in rs for x in r.get("requests", []) if x.get(key) is not None)
            if vals:
                ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=label)
    for ax, title in zip(axes, ("end-to-end latency (s)", "time to first token (s)")):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    written.append(out / "latency_cdf.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written
