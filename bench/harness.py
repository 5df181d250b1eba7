"""What every scenario shares: the checkpoint on disk, its tokenizer, the results folder, a progress bar."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.servers import Server


@dataclass
class BenchContext:
    model: str  # what was asked for, e.g. builtin:bench
    checkpoint: Path  # the directory every system loads
    results_dir: Path
    tokenizer: object

    @classmethod
    def create(cls, model: str, results_dir: Path) -> BenchContext:
        from tierserve.models.checkpoints import resolve_model_path

        from tierserve.models.checkpoints import load_tokenizer

        checkpoint = Path(resolve_model_path(model))
        results_dir.mkdir(parents=True, exist_ok=True)
        return cls(model, checkpoint, results_dir, load_tokenizer(checkpoint))  # a GGUF file's too

    def progress(self, total: int, description: str) -> tqdm:
        return tqdm(total=total, desc=description, unit="req", dynamic_ncols=True, file=sys.stderr)

    def save(self, scenario: str, payload: dict) -> Path:
        """Write ``<scenario>.json`` with the machine description and the command line."""
        payload = {"scenario": scenario, "machine": machine(), "command": command_line(), **payload}
        path = self.results_dir / f"{scenario}.json"
        path.write_text(json.dumps(payload, indent=2) + "\n")
        return path


def warm_up(server: Server, tokenizer) -> None:
    """Two short requests, so first-call costs (lazy loading, worker start) stay out of the timings."""
    from bench.client import drive
    from bench.workloads import throughput_requests

    requests = throughput_requests(tokenizer, 2, 16, 8, seed=999_999)
    result = drive(server, [[server.completion_body(r.prompt, r.max_tokens)] for r in requests])
    if result.errors:
        raise RuntimeError(f"{server.name} failed its warm-up request: {result.summary()['first_error']}")


def command_line() -> str:
    return "python -m bench " + " ".join(sys.argv[1:])


def machine() -> dict:
    """The machine the figures belong to."""
    cpu = platform.processor() or platform.machine()
    features: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                # which of the CPU kernels' builds can run here: a host's name ("AMD EPYC") does not say
                flags = set(line.split(":", 1)[1].split())
                features = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
                break
    except OSError:
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError):
        memory = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cpu_features": features,
        "cores": os.cpu_count(),
        "memory_gib": round(memory, 1) if memory else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
