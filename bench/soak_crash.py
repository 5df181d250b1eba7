"""Crash-restart soak: SIGKILL a serving process at random moments and check the L3 disk cache it leaves behind.

    python -m bench.soak_crash [--iterations 100] [--seed 0] [--tear-every 4] [--workdir DIR]

Each iteration starts ``tierserve serve`` (a subprocess) on one persistent L3
directory with a tiny local checkpoint, waits for ``/health/ready``, sends a
probe prompt on a long shared prefix, then a burst of concurrent requests on
the same prefix with fresh random suffixes, and SIGKILLs the process at a
seeded random moment (mid-burst or just after). Every completed output must
equal the reference of an in-process engine without any cache; the probe after
each restart should be served partly from L3.

Every ``--tear-every``-th restart (0: never) first truncates one stored value
file of the probe's prefix to half its length, the torn write a power loss
could leave (a SIGKILL alone cannot: diskcache writes the file before it
commits the row). It must be counted as corrupt and recomputed, never served.

Prints kills survived, L3 hits per restart and corrupt entries detected.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.servers import wait_ready
from tests.engine_helpers import build_checkpoint, make_engine
from tests.server_helpers import free_port
from tierserve.core.sampling_params import SamplingParams

PREFIX = (
    "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read. "
    "Every morning she walked to the old library at the edge of the town, where the librarian "
    "kept a shelf of books nobody else ever asked for."
)
PROBE = PREFIX + " The probe asks the same thing every time."
MAX_TOKENS = 8
BURST = 4
READY_TIMEOUT = 60.0
TORN_BLOCK = 2  # which stored block of the probe's prefix (oldest rows first) a tear truncates


@dataclass
class Restart:
    """What one server life saw, from the probe up to the kill."""

    probe_cached_tokens: int
    l3_hits: int  # blocks the probe promoted from L3
    corrupt: int  # corrupt L3 entries detected before the kill
    torn: bool  # a value file was truncated before this start
    completed: int  # burst requests answered before the kill
    killed_in_flight: int  # burst requests cut off by the kill


@dataclass
class SoakResult:
    restarts: list[Restart] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    @property
    def kills_survived(self) -> int:
        return len(self.restarts)

    @property
    def restarts_with_l3_hits(self) -> int:
        return sum(1 for r in self.restarts if r.l3_hits > 0 and r.probe_cached_tokens > 0)

    @property
    def corrupt_detected(self) -> int:
        return sum(r.corrupt for r in self.restarts)

    @property
    def torn_injected(self) -> int:
        return sum(r.torn for r in self.restarts)

    def summary(self) -> str:
        hits = " ".join(str(r.l3_hits) for r in self.restarts)
        return (
            f"kills survived: {self.kills_survived}\n"
            f"restarts with L3 hits: {self.restarts_with_l3_hits}/{self.kills_survived}\n"
            f"L3 hits (blocks) per restart: {hits}\n"
            f"torn files injected: {self.torn_injected}, corrupt entries detected: {self.corrupt_detected}\n"
            f"requests completed: {sum(r.completed for r in self.restarts)}, "
            f"cut off by a kill: {sum(r.killed_in_flight for r in self.restarts)}\n"
            f"output mismatches: {len(self.mismatches)}"
        )


class Reference:
    """Greedy outputs of an in-process engine with prefix caching off (no tier at all), memoised."""

    def __init__(self, checkpoint: Path) -> None:
        self.engine = make_engine(checkpoint, kv_cache__enable_prefix_caching=False)
        self.params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        self.texts: dict[str, str] = {}

    def __call__(self, prompt: str) -> str:
        if prompt not in self.texts:
            [result] = self.engine.generate([prompt], self.params)
            self.texts[prompt] = result.text
        return self.texts[prompt]


def serve_command(checkpoint: Path, disk_path: Path, port: int) -> list[str]:
    settings = {
        "model.path": f'"{checkpoint}"',
        "kv_cache.disk_path": f'"{disk_path}"',
        "kv_cache.persistence": "true",
        "kv_cache.block_size": "4",
        "kv_cache.l1_capacity": "64",
        "kv_cache.l2_capacity": "0",
    }
    command = [sys.executable, "-m", "tierserve.cli.main", "serve", "--port", str(port)]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    return command


def complete(client: httpx.Client, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def l3_stats(client: httpx.Client) -> tuple[int, int]:
    """(blocks promoted from L3, corrupt L3 entries detected) since this process started."""
    kv = client.get("/v1/cache/stats", timeout=10).json()["cache_manager"]["kv_cache"]
    return kv["promotions"]["l3"], kv["tiers"]["l3"]["corrupt"]


def tear_one_file(disk_path: Path) -> bool:
    """Truncate the value file of the ``TORN_BLOCK``-th oldest entry (a block of the probe's prefix) to half."""
    with sqlite3.connect(disk_path / "cache.db") as db:
        rows = db.execute("SELECT filename FROM Cache WHERE raw = 1 ORDER BY store_time LIMIT ?", (TORN_BLOCK + 1,))
        filenames = [row[0] for row in rows.fetchall()]
    if len(filenames) <= TORN_BLOCK:
        return False
    value_file = disk_path / filenames[TORN_BLOCK]
    data = value_file.read_bytes()
    value_file.write_bytes(data[: len(data) // 2])
    return True


def random_suffix(rng: random.Random) -> str:
    words = ("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(rng.randint(2, 6)))
    return " " + " ".join(words) + "."


def one_life(
    checkpoint: Path, disk_path: Path, reference: Reference, rng: random.Random, tear: bool, log_path: Path,
    result: SoakResult,
) -> None:
    torn = tear and tear_one_file(disk_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(serve_command(checkpoint, disk_path, port), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"{base}/health/ready", process, log_path, READY_TIMEOUT)
        with httpx.Client(base_url=base) as client:
            model = client.get("/v1/models", timeout=10).json()["data"][0]["id"]
            probe = complete(client, model, PROBE)
            l3_hits, corrupt = l3_stats(client)
            outputs: list[tuple[str, str]] = [(PROBE, probe["choices"][0]["text"])]
            prompts = [PREFIX + random_suffix(rng) for _ in range(BURST)]
            cut_off = []

            def send(prompt: str) -> None:
                try:
                    outputs.append((prompt, complete(client, model, prompt)["choices"][0]["text"]))
                except httpx.HTTPError:
                    cut_off.append(prompt)

            threads = [threading.Thread(target=send, args=(prompt,)) for prompt in prompts]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.0, 0.6))  # a burst takes ~0.1-0.6 s: kills land mid-burst or just after
            try:
                _, corrupt = l3_stats(client)
            except httpx.HTTPError:
                pass
            process.kill()
            process.wait(timeout=30)
            for thread in threads:
                thread.join(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    for prompt, text in outputs:
        expected = reference(prompt)
        if text != expected:
            result.mismatches.append(f"restart {len(result.restarts)}: {prompt!r} gave {text!r}, expected {expected!r}")
    result.restarts.append(
        Restart(
            probe_cached_tokens=probe["usage"]["prompt_tokens_details"]["cached_tokens"],
            l3_hits=l3_hits,
            corrupt=corrupt,
            torn=torn,
            completed=len(outputs) - 1,
            killed_in_flight=len(cut_off),
        )
    )


def soak(workdir: Path, iterations: int, seed: int = 0, tear_every: int = 4) -> SoakResult:
    """Start, load and SIGKILL a server ``iterations`` times on one persistent L3 directory under ``workdir``."""
    checkpoint = build_checkpoint(workdir, "llama", "llama")
    disk_path = workdir / "l3"
    reference = Reference(checkpoint)
    rng = random.Random(seed)
    result = SoakResult()
    for index in range(iterations):
        tear = bool(tear_every) and index > 0 and index % tear_every == 0
        one_life(checkpoint, disk_path, reference, rng, tear, workdir / "server.log", result)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tear-every", type=int, default=4, help="truncate a value file before every Nth restart (0: never)")
    parser.add_argument("--workdir", type=Path, help="kept after the run (default: a temporary directory)")
    args = parser.parse_args()
    start = time.monotonic()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = soak(args.workdir, args.iterations, args.seed, args.tear_every)
    else:
        with tempfile.TemporaryDirectory() as workdir:
            result = soak(Path(workdir), args.iterations, args.seed, args.tear_every)
    print(result.summary())
    print(f"wall: {time.monotonic() - start:.1f} s")
    for mismatch in result.mismatches[:10]:
        print("MISMATCH", mismatch)
    return 1 if result.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
