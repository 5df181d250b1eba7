"""Several models in one server: routing by name, version switches under load, draining unloads, admin errors."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.effects_registry import models_toml
from tests.engine_helpers import build_checkpoint, hf_greedy
from tests.server_helpers import running_server
from tests.waiting import wait_until
from tierserve.settings.config import load_settings
from tierserve.core.errors import ConfigError

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time, in a kingdom by the sea, there lived a princess"
TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    return {
        "llama": build_checkpoint(root, "llama", "llama"),
        "qwen2": build_checkpoint(root, "qwen2", "qwen2"),
    }


@pytest.fixture(scope="module")
def expected(checkpoints):
    """Each checkpoint's own greedy continuation of PROMPT (transformers), as text."""
    from transformers import AutoTokenizer

    out = {}
    for name, path in checkpoints.items():
        out[name] = AutoTokenizer.from_pretrained(path).decode(hf_greedy(path, [PROMPT], TOKENS)[0])
    return out


def serve(tmp_path, entries, **values):
    config = tmp_path / "models.toml"
    config.write_text(models_toml(entries))
    overrides = {
        ("server", "engine_process"): False, ("logging", "level"): "warning", ("kv_cache", "l1_capacity"): 256,
        **{tuple(k.split("__")): v for k, v in values.items()},
    }  # fmt: skip
    loaded = load_settings(None, config, environ={}, overrides=overrides)
    return running_server(loaded.settings, plugins=loaded.plugins)


def ask(base: str, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def overall(base: str, model: str) -> dict:
    """The ``overall`` statistics ``/v1/cache/stats`` reports for ``model``."""
    return httpx.get(f"{base}/v1/cache/stats", params={"model": model}).json()["overall"]


def entry(name, path, **more):
    return {"name": name, "path": str(path), "device": "cpu", **more}


def test_two_models_are_listed_and_each_request_runs_on_the_model_it_names(tmp_path, checkpoints, expected):
    entries = [entry("small-llama", checkpoints["llama"]), entry("small-qwen", checkpoints["qwen2"], aliases=["qwen"])]
    with serve(tmp_path, entries) as base:
        listed = {m["id"]: m for m in httpx.get(f"{base}/v1/models").json()["data"]}
        assert {"small-llama@1", "small-qwen@1", "small-llama", "small-qwen", "qwen"} <= listed.keys()
        assert listed["qwen"]["root"] == "small-qwen@1" and listed["small-qwen@1"]["status"] == "ready"
        assert expected["llama"] != expected["qwen2"]
        for model, checkpoint in (("small-llama", "llama"), ("small-qwen@1", "qwen2"), ("qwen", "qwen2")):
            answer = ask(base, model).json()
            assert (answer["model"], answer["choices"][0]["text"]) == (model, expected[checkpoint])
        assert ask(base, None).json()["choices"][0]["text"] == expected["llama"]  # the first entry is the default
        missing = ask(base, "gpt-4")
        assert missing.status_code == 404
        assert "'small-llama'" in missing.json()["error"]["message"] and missing.json()["error"]["param"] == "model"
        # each model's prefix cache is its own: the same prompt never hits across models
        again = ask(base, "small-qwen").json()
        assert again["choices"][0]["text"] == expected["qwen2"]


def test_switching_an_alias_under_concurrent_streams_fails_no_request(tmp_path, checkpoints, expected):
    entries = [entry("chat", checkpoints["llama"]), entry("chat", checkpoints["qwen2"], version="2")]
    with serve(tmp_path, entries) as base:
        results: list[tuple[int, str]] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                body = {"model": "chat", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                text, status = [], 0
                with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
                    status = response.status_code
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            text += [c["text"] for c in json.loads(line[6:])["choices"]]
                results.append((status, "".join(text)))

        threads = [threading.Thread(target=client) for _ in range(6)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(results) >= len(threads), timeout=60, what="requests answered before the switch")
        switched = httpx.post(f"{base}/v1/models/aliases", json={"alias": "chat", "model": "chat@2"}, timeout=60)
        assert switched.status_code == 200 and switched.json()["previous"] == "chat@1"
        before = len(results)  # each client ends the stream it has open, then asks at least twice more
        wait_until(lambda: len(results) >= before + 3 * len(threads), timeout=60, what="requests after the switch")
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
        assert results and all(status == 200 for status, _ in results)
        texts = [text for _, text in results]
        assert set(texts) == {expected["llama"], expected["qwen2"]}  # both versions served, nothing else
        last = texts.index(expected["qwen2"])
        assert expected["llama"] not in texts[last + 6 :]  # once switched, new requests stay on version 2
        assert ask(base, "chat").json()["choices"][0]["text"] == expected["qwen2"]
        assert ask(base, "chat@1").json()["choices"][0]["text"] == expected["llama"]  # still loaded, by its id


def test_unloading_drains_running_requests_then_frees_the_model(tmp_path, checkpoints, expected):
    entries = [entry("a", checkpoints["llama"]), entry("b", checkpoints["qwen2"])]
    with serve(tmp_path, entries) as base:
        long_body = {"model": "b", "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True}
        finished: list[httpx.Response] = []
        runner = threading.Thread(target=lambda: finished.append(
            httpx.post(f"{base}/v1/completions", json=long_body, timeout=120)))  # fmt: skip
        runner.start()
        # unload while the request runs (a tiny model decodes it in ~1 s)
        wait_until(lambda: overall(base, "b")["requests_running"], timeout=60, interval=0.005, what="the long request")
        refused = httpx.delete(f"{base}/v1/models/b@1", timeout=60)  # the alias 'b' points at it, but only as its name
        assert refused.status_code == 200, refused.text
        assert refused.json()["drained_requests"] == 1
        runner.join(timeout=120)
        assert finished[0].status_code == 200
        assert finished[0].json()["usage"]["completion_tokens"] == 480  # it ran to its end, not aborted
        assert ask(base, "b").status_code == 404
        assert "b@1" not in {m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]}
        assert httpx.get(f"{base}/health").json()["components"]["models"] == {"a@1": "ready"}
        assert ask(base, "a").json()["choices"][0]["text"] == expected["llama"]
        assert httpx.delete(f"{base}/v1/models/b@1").status_code == 404
        assert httpx.delete(f"{base}/v1/models/a@1", timeout=60).status_code == 200  # the last one
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "no model is loaded" in health.json()["components"]["load_error"]
        assert httpx.get(f"{base}/health/ready").status_code == 503


def test_admin_errors_name_the_problem(tmp_path, checkpoints):
    entries = [entry("chat", checkpoints["llama"]), entry("chat", checkpoints["llama"], version="2")]
    with serve(tmp_path, entries, registry__max_loaded_models=2) as base:
        pointed = httpx.delete(f"{base}/v1/models/chat@1")
        assert pointed.status_code == 409 and "switch it to another version first" in pointed.json()["error"]["message"]
        unknown = httpx.post(f"{base}/v1/models/aliases", json={"alias": "chat", "model": "chat@9"})
        assert unknown.status_code == 404
        full = httpx.post(f"{base}/v1/models", json=entry("other", checkpoints["qwen2"]), timeout=60)
        assert full.status_code == 409 and full.json()["error"]["code"] == "model_budget_exceeded"
        bad = httpx.post(f"{base}/v1/models", json={"name": "x y", "path": str(checkpoints["qwen2"])})
        assert bad.status_code == 400 and "name" in bad.text
        duplicate = httpx.post(f"{base}/v1/models", json=entry("chat", checkpoints["llama"]), timeout=60)
        assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "model_exists"


def test_settings_refuse_repeated_versions_and_shared_aliases(tmp_path, checkpoints):
    config = tmp_path / "models.toml"
    config.write_text(models_toml([entry("a", checkpoints["llama"]), entry("a", checkpoints["llama"])]))
    with pytest.raises(ConfigError, match="repeated: a@1"):
        load_settings(None, config, environ={})
    config.write_text(models_toml([entry("a", checkpoints["llama"], aliases=["x"]), entry("b", checkpoints["llama"], aliases=["x"])]))
    with pytest.raises(ConfigError, match="alias 'x' points at both a@1 and b@1"):
        load_settings(None, config, environ={})


def printed_json(out: str):
    """The JSON object a command printed (the in-process server's log lines share stdout)."""
    lines = out.splitlines()
    start = lines.index("{")
    return json.loads("\n".join(lines[start : lines.index("}", start) + 1]))


def test_models_cli_lists_loads_aliases_and_unloads(tmp_path, checkpoints, expected, capsys):
    from tierserve.cli.main import main

    with serve(tmp_path, [entry("chat", checkpoints["llama"])]) as base:
        assert main(["models", "load", "chat", "--url", base, "--path", str(checkpoints["qwen2"]), "--version", "2",
                     "--device", "cpu"]) == 0  # fmt: skip
        assert printed_json(capsys.readouterr().out)["status"] == "ready"
        assert main(["models", "alias", "chat", "chat@2", "--url", base]) == 0
        assert printed_json(capsys.readouterr().out)["previous"] == "chat@1"
        assert ask(base, "chat").json()["choices"][0]["text"] == expected["qwen2"]
        assert main(["models", "unload", "chat@1", "--url", base]) == 0
        assert printed_json(capsys.readouterr().out)["deleted"] is True
        assert main(["models", "list", "--url", base]) == 0
        table = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("20")]  # not log lines
        assert table[0].split() == ["ID", "STATUS", "RUNS", "ON", "DETAILS"]
        rows = {line.split()[0]: line for line in table[1:]}
        assert "chat@1" not in rows and "ready" in rows["chat@2"] and "aliases: chat" in rows["chat@2"]
        assert main(["models", "unload", "chat@1", "--url", base]) == 2
        assert "HTTP 404" in capsys.readouterr().err


def test_cache_routes_manage_the_model_the_query_names(tmp_path, checkpoints):
    entries = [entry("a", checkpoints["llama"]), entry("b", checkpoints["qwen2"])]
    with serve(tmp_path, entries) as base:
        assert ask(base, "b", prompt=PROMPT * 3).status_code == 200
        wait_until(lambda: overall(base, "b")["prompt_tokens"], what="b's statistics")  # published between steps
        stats = {m: overall(base, m) for m in ("a", "b")}
        assert stats["a"]["prompt_tokens"] == 0 and stats["b"]["prompt_tokens"] > 0
        assert httpx.get(f"{base}/v1/cache/stats").json()["overall"]["prompt_tokens"] == 0  # the default model: a
        assert httpx.get(f"{base}/v1/cache/stats", params={"model": "zzz"}).status_code == 404
