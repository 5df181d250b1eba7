"""llama.cpp's ``llama-server`` as a peer: built from source, fed the bench checkpoint converted by llama.cpp's own tool.

    pip download --no-binary :all: --no-deps llama-cpp-python   the sdist vendors llama.cpp's source
    cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-server
    bench/gguf_convert.py CHECKPOINT --outtype f32|bf16|q8_0       llama.cpp's convert_hf_to_gguf.py

Everything is cached under ``~/.cache/tierserve/peers`` (``TIERSERVE_PEERS_DIR``),
outside the repository; a later run reuses the build and the GGUF files. cmake
and a C++ compiler come from the OS packages (``apt-get install cmake g++``).
Not part of the tests: only ``python -m bench`` starts it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

PEERS_DIR = Path(os.environ.get("TIERSERVE_PEERS_DIR", Path.home() / ".cache" / "tierserve" / "peers"))
PRECISIONS = {"llama-server": "f32", "llama-server-bf16": "bf16", "llama-server-q8_0": "q8_0"}


def _run(command: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    if done.returncode:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(command[:3])} ... failed ({done.returncode}); see {log}:\n{tail}")


def llama_cpp_source(peers: Path = PEERS_DIR) -> Path:
    """llama.cpp's source tree, from the newest ``llama-cpp-python`` sdist (downloaded once)."""
    existing = sorted(peers.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if existing:
        return existing[-1]
    peers.mkdir(parents=True, exist_ok=True)
    log = peers / "download.log"
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "llama-cpp-python", "-d",
          str(peers)], log)  # fmt: skip
    [sdist] = sorted(peers.glob("llama_cpp_python-*.tar.gz"))[-1:]
    with tarfile.open(sdist) as archive:
        archive.extractall(peers, filter="data")
    return sorted(peers.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def llama_server_binary(peers: Path = PEERS_DIR) -> Path:
    """``llama-server`` built for this CPU (``GGML_NATIVE``), building it the first time (minutes)."""
    source = llama_cpp_source(peers)
    binary = source / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    log = peers / "build.log"
    _run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], log, cwd=source)  # fmt: skip
    _run(["cmake", "--build", "build", "--target", "llama-server", "-j", str(os.cpu_count() or 2)], log, cwd=source)
    return binary


def gguf_file(checkpoint: Path, outtype: str, peers: Path = PEERS_DIR) -> Path:
    """``checkpoint`` converted to GGUF at ``outtype`` (``f32``, ``bf16``, ``q8_0``) by llama.cpp's converter (once)."""
    source = llama_cpp_source(peers)
    target = peers / "gguf" / f"{checkpoint.name}-{outtype}.gguf"
    if target.is_file() and target.stat().st_mtime >= max(p.stat().st_mtime for p in checkpoint.iterdir()):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    convert = Path(__file__).with_name("gguf_convert.py")
    command = [sys.executable, str(convert), str(source), str(checkpoint), "--outfile", str(target), "--outtype", outtype]
    _run(command, peers / "convert.log")
    return target


def server_command(binary: Path, model: Path, port: int, slots: int, context_per_slot: int, threads: int) -> list[str]:
    """``llama-server`` with ``slots`` parallel sequences (continuous batching) of ``context_per_slot`` tokens each."""
    return [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * context_per_slot),
        "--no-webui",
    ]  # fmt: skip
