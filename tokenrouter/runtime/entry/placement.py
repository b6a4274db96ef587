"""Placement: several models on one device, and the split of its memory between their KV pools.

The paper co-locates the small and the large model on the same GPUs. Left alone, each engine sizes its
pool from what is free when it starts, so whichever starts first takes the lot. Here the entry plans
every shared device before any subserver starts: of `memory_fraction` of the device, it subtracts each
model's weights and a working reserve (activations of one prefill chunk, logits, the CUDA context), and
splits what is left between their KV pools. A model may claim a fraction of that with `kv_share`; the
others split the rest so that they hold the same number of tokens, since admission reserves the same
tokens on every model a request may visit (the smallest pool bounds them all). Under tensor
parallelism a CUDA model puts 1/tp of its weights and KV heads on each of its GPUs; on CPU its ranks
share host memory. On CPU co-location means sharing cores too, which is reported.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenrouter.engine.config import DTYPES
from tokenrouter.models.config import ModelConfig
from tokenrouter.models.kv_pool import KVPool, available_memory_bytes
from tokenrouter.runtime.group_config import GroupConfig, ModelSpec

CUDA_CONTEXT_BYTES = 512 << 20  # what each process's CUDA context and allocator take before any tensor
_GIB, _MIB = float(1 << 30), float(1 << 20)


def parameter_count(path: str | Path) -> int:
    """Parameters in a folder's *.safetensors, read from the file headers (no tensor is loaded)."""
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def device_memory(device: str) -> int:
    """Total memory of a GPU (the planned fraction is of the whole device, as in vLLM), or the host's
    available memory on CPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return available_memory_bytes(torch.device("cpu"))


@dataclass
class ModelNeeds:
    """One model's footprint on each device it uses."""

    spec: ModelSpec
    devices: list[str]
    weight_bytes: int  # per device
    reserve_bytes: int  # per device: activations, logits, CUDA context
    kv_bytes_per_token: int  # per device

    @classmethod
    def of(cls, spec: ModelSpec) -> ModelNeeds:
        eng = spec.engine
        mc = ModelConfig.from_folder(eng.model_path)
        cuda = eng.device.startswith("cuda")
        dtype = DTYPES[eng.dtype] if eng.dtype != "auto" else (torch.bfloat16 if cuda else torch.float32)
        size = torch.tensor([], dtype=dtype).element_size()
        split = eng.tp_size if cuda else 1  # CPU ranks share host memory: count the whole model once
        devices = ["cpu"]
        if cuda:  # rank r uses the GPU r places after the model's device
            first = torch.device(eng.device).index or 0
            devices = [f"cuda:{first + r}" for r in range(eng.tp_size)]
        activations = eng.chunked_prefill_size * (4 * mc.hidden_size + 2 * mc.intermediate_size // split) * size
        logits = eng.max_running_requests * mc.vocab_size * 4 * 2  # float32 logits and their softmax
        ranks = 1 if cuda else eng.tp_size
        return cls(spec, devices, parameter_count(eng.model_path) * size // split,
                   ranks * (activations + logits) + (CUDA_CONTEXT_BYTES if cuda else 0),
                   KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads // split, mc.head_dim, dtype))


@dataclass
class DevicePlan:
    device: str
    budget: int  # memory_fraction x the device's memory
    models: list[ModelNeeds] = field(default_factory=list)
    kv_bytes: int = 0  # what is left for KV after weights and reserves

    def line(self, fraction: float) -> str:
        used = sum(m.weight_bytes + m.reserve_bytes for m in self.models)
        return (f"placement {self.device}: {fraction:g} x {self.budget / fraction / _GIB:.2f} GiB = "
                f"{self.budget / _GIB:.2f} GiB for {', '.join(m.spec.name for m in self.models)}; weights and "
                f"reserves {used / _GIB:.2f} GiB, KV {self.kv_bytes / _GIB:.2f} GiB")


@dataclass
class Placement:
    fraction: float
    devices: dict[str, DevicePlan]
    tokens: dict[str, int]  # planned KV tokens per model (page multiples)
    shares: dict[str, float]  # each model's fraction of its (first) device's KV memory

    def lines(self) -> list[str]:
        out = []
        for plan in self.devices.values():
            out.append(plan.line(self.fraction))
            for m in plan.models:
                if m.devices[0] != plan.device:
                    continue  # a TP model is described once, on its first device
                tokens, page = self.tokens[m.spec.name], m.spec.engine.page_size
                gpus = f" on each of {len(m.devices)} GPUs" if len(m.devices) > 1 else ""
                out.append(f"  {m.spec.name}: weights {m.weight_bytes / _MIB:.1f} MiB{gpus}, reserve "
                           f"{m.reserve_bytes / _MIB:.1f} MiB, KV {tokens} tokens ({tokens // page} "
                           f"pages of {page}, {tokens * m.kv_bytes_per_token / _MIB:.1f} MiB), share "
                           f"{self.shares[m.spec.name]:.2f}")
        return out


def split_memory(models: list[ModelNeeds], fraction: float, memory: Callable[[str], int]) -> Placement:
    """The KV tokens of every model: explicit kv_cache_tokens kept, kv_share honoured, the rest equal."""
    devices: dict[str, DevicePlan] = {}
    for m in models:
        for d in m.devices:
            devices.setdefault(d, DevicePlan(d, int(memory(d) * fraction))).models.append(m)
    per_device: dict[str, dict[str, int]] = {}  # device -> model -> tokens that fit there
    for d, plan in devices.items():
        plan.kv_bytes = plan.budget - sum(m.weight_bytes + m.reserve_bytes for m in plan.models)
        if plan.kv_bytes <= 0:
            raise ValueError(f"{plan.line(fraction)}: the weights and working memory leave no room for KV; "
                             "raise memory_fraction or place a model elsewhere")
        fixed = {m.spec.name: m.spec.engine.kv_cache_tokens * m.kv_bytes_per_token
                 for m in plan.models if m.spec.engine.kv_cache_tokens is not None}
        claimed = {m.spec.name: m.spec.kv_share * plan.kv_bytes
                   for m in plan.models if m.spec.kv_share is not None and m.spec.name not in fixed}
        rest = plan.kv_bytes - sum(fixed.values()) - sum(claimed.values())
        if rest < 0:
            raise ValueError(f"{plan.line(fraction)}: kv_share and kv_cache_tokens of "
                             f"{', '.join([*fixed, *claimed])} ask for more than that")
        equal = [m for m in plan.models if m.spec.name not in fixed and m.spec.name not in claimed]
        per_token = sum(m.kv_bytes_per_token for m in equal)
        fit = {m.spec.name: int(claimed[m.spec.name] // m.kv_bytes_per_token) for m in plan.models
               if m.spec.name in claimed}
        fit.update({m.spec.name: int(rest // per_token) for m in equal})
        per_device[d] = fit
    tokens, shares = {}, {}
    for m in models:
        name, page = m.spec.name, m.spec.engine.page_size
        if m.spec.engine.kv_cache_tokens is not None:
            tokens[name] = m.spec.engine.kv_cache_tokens
        else:
            tokens[name] = min(per_device[d][name] for d in m.devices) // page * page
            if tokens[name] < page:
                raise ValueError(f"model {name!r}: its share of {', '.join(m.devices)} holds less than one KV "
                                 f"page of {page} tokens; raise memory_fraction or its kv_share")
        shares[name] = tokens[name] * m.kv_bytes_per_token / devices[m.devices[0]].kv_bytes
    return Placement(fraction, devices, tokens, shares)


def shared_cores(group: GroupConfig) -> list[str]:
    """Lines naming CPU models whose pinned cores overlap (their steps slow each other down)."""
    out = []
    cpu = [m for m in group.models if m.start == "spawn" and m.engine.device == "cpu" and m.cores]
    for i, a in enumerate(cpu):
        for b in cpu[i + 1:]:
            both = sorted(set(a.cores or []) & set(b.cores or []))
            if both:
                out.append(f"placement cpu: {a.name} and {b.name} share core(s) {', '.join(map(str, both))}; "
                           "their steps slow each other (say so in launch.alpha)")
    return out


def plan_placement(group: GroupConfig, memory: Callable[[str], int] | None = None) -> tuple[GroupConfig, list[str]]:
    """Plan the devices the entry's own subservers share: the group with their `kv_cache_tokens` fixed,
    and the lines to print. With `memory_fraction` every device is planned; without it only CUDA devices
    two or more models share (at 0.9), so that neither takes the other's memory. Models started
    elsewhere (join, Ray) size their pools on their own hosts."""
    if group.executor.latency:
        return group, shared_cores(group)  # no weights and no real KV: nothing to split
    local = [m for m in group.models if m.start == "spawn"]
    needs = [ModelNeeds.of(m) for m in local]
    fraction = group.memory_fraction
    if fraction is None:
        users: dict[str, int] = {}
        for n in needs:
            for d in n.devices:
                users[d] = users.get(d, 0) + 1
        needs = [n for n in needs if any(d.startswith("cuda") and users[d] > 1 for d in n.devices)]
        fraction = 0.9
    if not needs:
        return group, shared_cores(group)
    plan = split_memory(needs, fraction, memory or device_memory)
    models = [dataclasses.replace(m, engine=dataclasses.replace(m.engine, kv_cache_tokens=plan.tokens[m.name]))
              if m.name in plan.tokens else m for m in group.models]
    return dataclasses.replace(group, models=models), plan.lines() + shared_cores(group)
