"""The examples/ folder: every example that runs on the CPU runs on the tiny random pair; the GPU ones
(the paper's set-up, the same with the large model a Ray actor, the R2R pairs) load as GroupConfig both
as written and with the tiny pair's paths and a router folder put in, their algorithm built from the
parameters they give, and keep the set-up their comments describe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from routing_utils import untrained_routers

from tokenrouter import SamplingParams
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.routing import make_algorithm
from tokenrouter.runtime.group_config import GroupConfig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# Each runnable example, and where it runs.
CPU_EXAMPLES = {
    "bernoulli_pair.yaml": "test_bernoulli_pair_runs",
    "budgeted_pair.yaml": "tests/test_custom_algorithm.py",
    "budgeted_deferral.py": "tests/test_custom_algorithm.py",
    "routed_llm_dict.py": "test_routed_llm_dict_runs",
}
GPU_EXAMPLES = ["paper_qwen3_0.6b_32b.yaml", "paper_qwen3_0.6b_32b_ray.yaml", "r2r_deepseek_r1_qwen_1.5b_32b.yaml",
                "r2r_qwen3_0.6b_8b.yaml"]
SECRET = "an-example-secret-of-32-characters"


def test_every_example_is_covered():
    found = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".yaml", ".py")}
    assert found == set(CPU_EXAMPLES) | set(GPU_EXAMPLES)


@pytest.fixture(scope="module")
def r2r_router(pair_paths, tmp_path_factory) -> Path:
    return untrained_routers(pair_paths, tmp_path_factory.mktemp("routers"))["r2r"]


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_example_loads(name, pair_paths, r2r_router, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENROUTER_SECRET", SECRET)  # the Ray example's tcp transport takes it from there
    written = GroupConfig.from_yaml(EXAMPLES / name)
    raw = yaml.safe_load((EXAMPLES / name).read_text())
    for m in raw["models"]:
        m["path"] = str(pair_paths[m["name"]])
    raw["algorithm"]["router"] = str(r2r_router)
    (tmp_path / name).write_text(yaml.safe_dump(raw))
    cfg = GroupConfig.from_yaml(tmp_path / name)

    assert written.names == cfg.names == ["small", "large"]
    assert cfg.algorithm == "r2r" and make_algorithm(cfg.algorithm, cfg.names, cfg.algorithm_params).threshold == 0.5
    small, large = cfg.spec("small"), cfg.spec("large")
    assert small.engine.device.startswith("cuda") and large.engine.device.startswith("cuda")
    if name.startswith("paper_"):  # Qwen3-0.6B + Qwen3-32B in tensor parallel 2, the planner launching
        assert "Qwen3-0.6B" in written.spec("small").engine.model_path
        assert "Qwen3-32B" in written.spec("large").engine.model_path
        assert large.engine.tp_size == 2 and cfg.launch.policy == "planner"
    if name.endswith("_ray.yaml"):
        assert large.start == "ray" and small.start == "spawn" and cfg.transport == "tcp"
        assert small.host == cfg.entry_host != "127.0.0.1"  # reachable from the Ray node
    else:
        assert large.start == "spawn" and cfg.memory_fraction == 0.9  # co-located on the GPUs they share


def test_bernoulli_pair_runs(pair_paths):
    raw = yaml.safe_load((EXAMPLES / "bernoulli_pair.yaml").read_text())
    for m in raw["models"]:
        m["path"] = str(pair_paths[m["name"]])
    with RoutedLLM(raw) as llm:
        outs = llm.generate(["one", "two"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                            use_tqdm=False, timeout=120)
    for out in outs:
        models = out.outputs[0].token_models
        assert models is not None and len(models) == 8 and set(models) <= {"small", "large"}


def test_routed_llm_dict_runs(pair_paths, r2r_router):
    """The example as a user runs it, with an R2R router: RoutedLLM built from its dict serves."""
    cmd = [sys.executable, str(EXAMPLES / "routed_llm_dict.py"), str(pair_paths["small"]), str(pair_paths["large"]),
           "--router", str(r2r_router), "--max-tokens", "6"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "routed by r2r"
    assert sum(line.startswith("  tokens by model") for line in lines) == 2
    assert lines[-1].startswith("all prompts: tokens by model")
