"""Start and stop the servers under test: each a subprocess on a loopback port, all on one checkpoint directory.

- ``tierserve``: ``tierserve serve --preset production`` with the checkpoint
  and an L3 folder of the run's own (so a restart finds its cache, and no
  earlier run's does); ``tierserve-inproc`` and ``tierserve-process`` are the
  same with the engine core pinned on a thread of the server process, or in a
  child process (``server.engine_process``), whatever the preset's default.
- ``tierserve-bf16`` / ``tierserve-int8``: the same with ``model.dtype = "bfloat16"``
  or ``model.quantization = "int8"`` (the peers of llama-server's BF16 and Q8_0).
- ``tierserve-kvbf16`` / ``tierserve-int8-kvbf16``: float32 or int8 weights with
  ``kv_cache.dtype = "bfloat16"``, the KV precision llama-server runs by default
  (its F16 cache, whatever the weights), so the pair differs in weights only.
- ``tierserve-transformers`` / ``tierserve-unpaged``: the same with ``model.backend``
  set to the paged ``transformers`` backend or to ``transformers-unpaged`` (one
  ``DynamicCache`` per sequence), whatever ``auto`` would pick.
- ``tierserve-bf16-no-l3-writes``: ``tierserve-bf16`` with ``kv_cache.persistence =
  false``, so L3 is not written through (what the disk writer costs a busy step loop).
- ``tierserve-prompts-every-step`` / ``tierserve-kvbf16-prompts-every-step``: ``tierserve`` /
  ``tierserve-kvbf16`` with ``scheduler.decode_steps_between_prefills = 0`` (new prompts may start in the
  step right after one that started prompts: what the production preset's decode step between prefills gives).
- ``tierserve-kvbf16-whole-blocks``: ``tierserve-kvbf16`` with ``kv_cache.reuse_partial_blocks =
  false`` (prefix reuse in whole blocks only: what partial-block reuse gives the prefix scenario).
- ``transformers-serve`` / ``transformers-serve-cb``: ``transformers serve``
  on the same directory, on CPU, without and with ``--continuous-batching``.
- ``llama-server`` / ``llama-server-bf16`` / ``llama-server-q8_0``: llama.cpp's
  server (``bench.llama_cpp``) on the same checkpoint converted to GGUF at F32,
  BF16 or Q8_0, with as many slots as the run has clients. It is sent the token
  ids tierserve's tokenizer makes of each prompt, so both systems read the same
  ids.

Each server's output goes to a log file in the results folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.llama_cpp import PRECISIONS, gguf_file, llama_server_binary, server_command
from tests.server_helpers import free_port  # the tests' own helper; bench runs from a checkout

TIERSERVE_MODES = {"tierserve": None, "tierserve-inproc": False, "tierserve-process": True}
TIERSERVE_PRECISIONS = {
    "tierserve-bf16": ["model.dtype=bfloat16"],
    "tierserve-int8": ["model.quantization=int8"],
    "tierserve-gguf": ['model.quantization="gguf"'],  # a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks as stored
    "tierserve-kvbf16": ["kv_cache.dtype=bfloat16"],
    "tierserve-int8-kvbf16": ["model.quantization=int8", "kv_cache.dtype=bfloat16"],
}
TIERSERVE_BACKENDS = {
    "tierserve-transformers": ['model.backend="transformers"'],
    "tierserve-unpaged": ['model.backend="transformers-unpaged"'],
}
# the production preset's prefill grouping A/B: prompts together up to max_num_batched_tokens, or 256 a group
TIERSERVE_POLICIES = {"tierserve-ungrouped": ["scheduler.prefill_group_tokens=0"],
                      "tierserve-grouped": ["scheduler.prefill_group_tokens=256"],
                      "tierserve-prompts-every-step": ["scheduler.decode_steps_between_prefills=0"],
                      "tierserve-kvbf16-prompts-every-step": ["kv_cache.dtype=bfloat16",
                                                              "scheduler.decode_steps_between_prefills=0"],
                      "tierserve-bf16-no-l3-writes": ["model.dtype=bfloat16", "kv_cache.persistence=false"],
                      "tierserve-kvbf16-whole-blocks": ["kv_cache.dtype=bfloat16", "kv_cache.reuse_partial_blocks=false"]}
TIERSERVE_VARIANTS = {**TIERSERVE_PRECISIONS, **TIERSERVE_BACKENDS, **TIERSERVE_POLICIES}
TIERSERVES = (*TIERSERVE_MODES, *TIERSERVE_VARIANTS)
SERVERS = (*TIERSERVES, "transformers-serve-cb", "transformers-serve", *PRECISIONS)


@dataclass
class Server:
    """A running server: where to send requests and what to put in their ``model`` field."""

    name: str
    base_url: str
    model: str
    process: subprocess.Popen
    log_path: Path
    encode: Callable[[str], list[int]] | None = None  # llama-server: prompts go as tierserve's token ids

    def completion_body(self, prompt: str, max_tokens: int, **extra) -> dict:
        """A streaming, greedy ``/v1/completions`` body producing exactly ``max_tokens`` tokens (eos ignored)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.name in TIERSERVES:
            body["ignore_eos"] = True
        elif self.name in PRECISIONS:
            body["prompt"] = self.encode(prompt) if self.encode is not None else prompt
            body["ignore_eos"] = True
        else:
            # transformers serve has no ignore_eos; min_new_tokens = max_new_tokens does the same
            config = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False}
            body["generation_config"] = json.dumps(config)
        return {**body, **extra}

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process under it (tierserve's engine core runs in a child)."""
        return tree_rss_bytes(self.process.pid)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGINT (a graceful shutdown: tierserve flushes its L3 writes), then SIGKILL if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def tree_rss_bytes(root: int) -> int:
    """VmRSS of ``root`` plus all its descendants, from ``/proc`` (0 where unreadable)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        pending.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def wait_ready(url: str, process: subprocess.Popen, log_path: Path, timeout: float) -> None:
    """Poll ``url`` until it answers 200. RuntimeError if the server exits first, TimeoutError after
    ``timeout`` seconds; both carry the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with code {process.returncode} before it was ready:\n{tail}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise TimeoutError(f"server not ready at {url} after {timeout:.0f} s:\n{tail}")


def _ready_or_killed(url: str, process: subprocess.Popen, log_path: Path, timeout: float) -> None:
    try:
        wait_ready(url, process, log_path, timeout)
    except BaseException:
        process.kill()
        process.wait()
        raise


def _launch(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_tierserve(
    checkpoint: Path, log_dir: Path, l3_dir: Path, timeout: float = 300.0, name: str = "tierserve",
    settings: Sequence[str] = (),
) -> Server:
    """``tierserve serve --preset production`` on ``checkpoint``; L3 lives in ``l3_dir``; ``settings`` are more
    ``--set`` assignments, after the variant's."""
    port = free_port()
    command = [
        sys.executable, "-c", "from tierserve.cli.main import main; raise SystemExit(main())",
        "serve", "--preset", "production", "--model", str(checkpoint), "--port", str(port),
        "--set", f"kv_cache.disk_path={l3_dir}",
    ]  # fmt: skip
    process_mode = TIERSERVE_MODES.get(name)
    if process_mode is not None:
        command += ["--set", f"server.engine_process={str(process_mode).lower()}"]
    for setting in [*TIERSERVE_VARIANTS.get(name, []), *settings]:
        command += ["--set", setting]
    log_path = log_dir / f"{name}.log"
    process = _launch(command, log_path, dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    _ready_or_killed(f"{base}/health/ready", process, log_path, timeout)
    return Server(name, base, str(checkpoint), process, log_path)


def start_transformers_serve(
    checkpoint: Path, log_dir: Path, continuous_batching: bool, timeout: float = 300.0
) -> Server:
    """``transformers serve`` on ``checkpoint`` (CPU), with or without continuous batching."""
    executable = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if executable is None:
        raise RuntimeError("the `transformers` command is missing; install the bench extra: pip install -e '.[bench]'")
    port = free_port()
    name = "transformers-serve-cb" if continuous_batching else "transformers-serve"
    command = [executable, "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    if continuous_batching:
        command.append("--continuous-batching")
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = _launch(command, log_path, env)
    base = f"http://127.0.0.1:{port}"
    _ready_or_killed(f"{base}/health", process, log_path, timeout)
    return Server(name, base, str(checkpoint), process, log_path)


# GGUF files whose llama-server crashed loading with the repacked (AMX) weights in this run.
_MODELS_WITHOUT_REPACK: set[Path] = set()


def start_llama_server(
    name: str, checkpoint: Path, log_dir: Path, slots: int, context_per_slot: int, timeout: float = 600.0
) -> Server:
    """llama.cpp's ``llama-server`` on ``checkpoint`` converted to GGUF (built and converted on first use)."""
    from tierserve.models.checkpoints import load_tokenizer
    from tierserve.models.gguf import is_gguf

    # a GGUF model (--model smollm2) is served as the file stores it; a directory is converted at the precision
    model = checkpoint if is_gguf(checkpoint) else gguf_file(checkpoint, PRECISIONS[name])
    port = free_port()
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    command = server_command(llama_server_binary(), model, port, slots, context_per_slot, threads)
    if model in _MODELS_WITHOUT_REPACK:
        command.append("--no-repack")
    log_path = log_dir / f"{name}.log"
    process = _launch(command, log_path, dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        _ready_or_killed(f"{base}/health", process, log_path, timeout)
    except RuntimeError:
        if process.returncode not in (-signal.SIGSEGV, -signal.SIGILL) or "--no-repack" in command:
            raise
        # llama.cpp 0.3.36's AMX buffer (Q8_0 and other quantized types, on CPUs reporting amx_int8)
        # crashes in its load-time warm-up on some hosts (SIGSEGV, at times SIGILL); without the extra
        # buffer types it runs its ordinary AVX-512 kernels. Said on stderr and in the log, so a run's
        # figures say which it was, and remembered, so every repeat of the run uses the same kernels.
        note = (
            f"{name}: llama-server crashed ({signal.Signals(-process.returncode).name}) while loading;"
            " starting it again with --no-repack, as every later start of this model in this run"
        )
        print(note, file=sys.stderr)
        with log_path.open("a") as log:
            log.write(f"\n[bench] {note}\n")
        _MODELS_WITHOUT_REPACK.add(model)
        process = _launch([*command, "--no-repack"], log_path, dict(os.environ))
        _ready_or_killed(f"{base}/health", process, log_path, timeout)
    tokenizer = load_tokenizer(checkpoint)
    return Server(name, base, name, process, log_path, encode=lambda text: tokenizer(text)["input_ids"])


def start(
    name: str, checkpoint: Path, log_dir: Path, l3_dir: Path, slots: int = 64, context_per_slot: int = 1024
) -> Server:
    """Start server ``name``; ``slots`` and ``context_per_slot`` size llama-server (the most clients a run has,
    and the longest prompt + output it asks for)."""
    if name in TIERSERVES:
        return start_tierserve(checkpoint, log_dir, l3_dir, name=name)
    if name in PRECISIONS:
        return start_llama_server(name, checkpoint, log_dir, slots, context_per_slot)
    if name in ("transformers-serve", "transformers-serve-cb"):
        return start_transformers_serve(checkpoint, log_dir, continuous_batching=name.endswith("-cb"))
    raise ValueError(f"server: got {name!r}, allowed: {', '.join(SERVERS)}")
