"""Probes of the keys the model registry and LoRA read: ``[registry]``, ``[[models]]``, ``model.*lora*``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from litestar.testing import TestClient

from tests.effects_lab import BASELINE, Lab, greedy, keyed
from tests.lora_helpers import make_adapter
from tests.waiting import wait_until
from tierserve.settings.config import load_settings
from tierserve.engine import RequestError
from tierserve.server.app import create_app

PROMPT = "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read books."


def adapter(lab: Lab, rank: int = 8):
    return lab.once(("lora", rank), lambda: make_adapter(lab.checkpoint, lab.tmp / f"lora{rank}", 1, ["q_proj", "v_proj"], rank, 16))


def toml_value(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def models_toml(entries: list[dict[str, Any]]) -> str:
    """``[[models]]`` tables of these entries."""
    return "".join("[[models]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in e.items()) for e in entries)


@contextmanager
def models_app(lab: Lab, entries: list[dict[str, Any]], values: dict[str, Any] | None = None) -> Iterator[TestClient]:
    """A test client of an app serving ``[[models]]`` (engines in this process), built as ``serve`` builds it."""
    config = lab.tmp / "models.toml"
    config.write_text(models_toml([{"device": "cpu", **e} for e in entries]))
    merged = {**BASELINE, "server.engine_process": False, **(values or {})}
    merged.pop("model.device", None)
    loaded = load_settings(None, config, environ={}, overrides=keyed(merged))
    app = create_app(loaded, load_in_background=False)
    with TestClient(app) as client:
        yield client


def listed(client: TestClient) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in client.get("/v1/models").json()["data"]}


def completion(client: TestClient, model: str, max_tokens: int = 6) -> Any:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return client.post("/v1/completions", json=body)


# ---- [model] LoRA keys -------------------------------------------------------------------------


def model_max_loras(lab: Lab) -> None:
    with lab.engine({"model.max_loras": 1}) as engine:
        assert engine.info.lora_slots == 1
        engine.load_lora("a", str(adapter(lab)))
        with pytest.raises(RequestError, match="all 1 adapter slots are in use"):
            engine.load_lora("b", str(adapter(lab)))
    with pytest.raises(RequestError, match="LoRA is off"):
        lab.shared.load_lora("a", str(adapter(lab)))


def model_max_lora_rank(lab: Lab) -> None:
    with lab.engine({"model.max_loras": 1, "model.max_lora_rank": 4}) as engine:
        with pytest.raises(RequestError, match=r"rank r = 8 is above model.max_lora_rank \(4\)"):
            engine.load_lora("a", str(adapter(lab)))
        assert engine.load_lora("a", str(adapter(lab, rank=4)))["rank"] == 4


def model_lora_adapters(lab: Lab) -> None:
    with lab.engine({"model.max_loras": 1, "model.lora_adapters": {"tuned": str(adapter(lab))}}) as engine:
        assert set(engine.loras) == {"tuned"}
        tuned, base = engine.generate([PROMPT, PROMPT], greedy(8), lora_names=["tuned", None])
        assert tuned.token_ids != base.token_ids


# ---- [[models]] ----------------------------------------------------------------------------------


def models_name(lab: Lab) -> None:
    with models_app(lab, [{"name": "alpha", "path": str(lab.checkpoint)}]) as client:
        assert {"alpha@1", "alpha"} <= listed(client).keys()
        assert completion(client, "alpha").json()["model"] == "alpha"
        missing = completion(client, "beta")
        assert missing.status_code == 404 and "'alpha'" in missing.json()["error"]["message"]


def models_version(lab: Lab) -> None:
    with models_app(lab, [{"name": "alpha", "version": "7", "path": str(lab.checkpoint)}]) as client:
        assert listed(client)["alpha@7"]["version"] == "7"
        assert completion(client, "alpha@7").status_code == 200


def models_aliases(lab: Lab) -> None:
    with models_app(lab, [{"name": "alpha", "aliases": ["latest"], "path": str(lab.checkpoint)}]) as client:
        assert listed(client)["latest"]["root"] == "alpha@1"
        assert completion(client, "latest").json()["model"] == "latest"


def models_kv_share(lab: Lab) -> None:
    entries = [{"name": "a", "path": str(lab.checkpoint), "kv_share": 0.25}, {"name": "b", "path": str(lab.checkpoint)}]
    with models_app(lab, entries) as client:
        models = client.app.state.tierserve.registry.models
        assert models["a@1"].engine.info.kv_blocks == 16  # a quarter of l1_capacity = 64
        assert models["b@1"].engine.info.kv_blocks == 32  # unset: an equal share of two
        l2 = lab.settings().settings.kv_cache.tiers[0].options.max_bytes
        assert [models[m].settings.kv_cache.tiers[0].options.max_bytes for m in ("a@1", "b@1")] == [l2 // 4, l2 // 2]


def models_scheduler(lab: Lab) -> None:
    entries = [{"name": "a", "path": str(lab.checkpoint), "scheduler": {"max_waiting_requests": 1}}]
    with models_app(lab, entries) as client:
        assert client.app.state.tierserve.registry.models["a@1"].engine.settings.scheduler.max_waiting_requests == 1


# ---- [registry] ----------------------------------------------------------------------------------


def load_body(lab: Lab, name: str) -> dict[str, Any]:
    return {"name": name, "path": str(lab.checkpoint), "device": "cpu"}


def registry_max_loaded_models(lab: Lab) -> None:
    entries = [{"name": "a", "path": str(lab.checkpoint)}]
    with models_app(lab, entries, {"registry.max_loaded_models": 1}) as client:
        refused = client.post("/v1/models", json=load_body(lab, "b"))
        assert refused.status_code == 409 and "registry.max_loaded_models is 1" in refused.json()["error"]["message"]
        assert {"b", "b@1"}.isdisjoint(listed(client))  # a refused version leaves no name behind
        assert completion(client, "a").status_code == 200
    with models_app(lab, entries, {"registry.max_loaded_models": 2}) as client:
        assert client.post("/v1/models", json=load_body(lab, "b")).status_code == 201


def registry_memory_budget_bytes(lab: Lab) -> None:
    entries = [{"name": "a", "path": str(lab.checkpoint)}]
    with models_app(lab, entries) as client:
        one = listed(client)["a@1"]["memory_bytes"]
    with models_app(lab, entries, {"registry.memory_budget_bytes": int(one * 1.5)}) as client:
        refused = client.post("/v1/models", json=load_body(lab, "b"))
        assert refused.status_code == 409
        assert "registry.memory_budget_bytes" in refused.json()["error"]["message"]
        assert "b@1" not in listed(client) or listed(client)["b@1"]["status"] != "ready"


def registry_unload_idle(lab: Lab) -> None:
    entries = [{"name": "a", "path": str(lab.checkpoint)}]
    with models_app(lab, entries, {"registry.max_loaded_models": 1, "registry.unload_idle": True}) as client:
        assert client.post("/v1/models", json=load_body(lab, "b")).status_code == 201
        assert listed(client)["a@1"]["status"] == "unloaded"
        assert completion(client, "a").status_code == 200  # loaded again on demand, b unloaded for it
        models = listed(client)
        assert (models["a@1"]["status"], models["b@1"]["status"]) == ("ready", "unloaded")


def registry_warm_prompts_on_switch(lab: Lab) -> None:
    entries = [{"name": "a", "path": str(lab.checkpoint)}, {"name": "a", "version": "2", "path": str(lab.checkpoint)}]
    for limit, expected in ((16, 1), (0, 0)):
        with models_app(lab, entries, {"registry.warm_prompts_on_switch": limit}) as client:
            assert completion(client, "a").status_code == 200
            switched = client.post("/v1/models/aliases", json={"alias": "a", "model": "a@2", "warm": True}).json()
            assert switched["warmed_prompts"] == expected
            cached = completion(client, "a").json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            assert (cached > 0) == (expected > 0)


# ---- [server] responses_* (the Responses API's store) ----------------------------------------------


def stored_response(client: TestClient) -> str:
    """The id of a response ``POST /v1/responses`` creates (and stores)."""
    return client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()["id"]


def stored_responses(lab: Lab, values: dict[str, Any], count: int) -> list[int]:
    """Statuses of ``GET /v1/responses/{id}`` for ``count`` responses created in turn."""
    with lab.http(values) as client:
        ids = [stored_response(client) for _ in range(count)]
        return [client.get(f"/v1/responses/{i}").status_code for i in ids]


def server_responses_max_stored(lab: Lab) -> None:
    assert stored_responses(lab, {"server.responses_max_stored": 1}, 2) == [404, 200]
    assert stored_responses(lab, {}, 2) == [200, 200]


def server_responses_max_bytes(lab: Lab) -> None:
    """Responses of about 1.4 kB as stored under a bound of 2 kB: only the newest is kept; under the default, both."""
    assert stored_responses(lab, {"server.responses_max_bytes": 2000}, 2) == [404, 200]
    assert stored_responses(lab, {}, 2) == [200, 200]


def server_responses_ttl_seconds(lab: Lab) -> None:
    with lab.http({"server.responses_ttl_seconds": 0.2}) as brief, lab.http({}) as kept:
        brief_id, kept_id = stored_response(brief), stored_response(kept)
        wait_until(lambda: brief.get(f"/v1/responses/{brief_id}").status_code == 404, what="the response to expire")
        assert kept.get(f"/v1/responses/{kept_id}").status_code == 200  # stored as long ago, without a TTL


PROBES = {
    "server.responses_max_stored": server_responses_max_stored,
    "server.responses_ttl_seconds": server_responses_ttl_seconds,
    "server.responses_max_bytes": server_responses_max_bytes,
    "model.max_loras": model_max_loras,
    "model.max_lora_rank": model_max_lora_rank,
    "model.lora_adapters": model_lora_adapters,
    "models[].name": models_name,
    "models[].version": models_version,
    "models[].aliases": models_aliases,
    "models[].kv_share": models_kv_share,
    "models[].scheduler": models_scheduler,
    "registry.max_loaded_models": registry_max_loaded_models,
    "registry.memory_budget_bytes": registry_memory_budget_bytes,
    "registry.unload_idle": registry_unload_idle,
    "registry.warm_prompts_on_switch": registry_warm_prompts_on_switch,
}
