"""Probes of the keys the HTTP routes give meaning to: the cached routes' defaults, model names, the timeout,
the bounds on max_tokens and prompt text."""

from __future__ import annotations

import pytest

from tests.effects_lab import Lab, greedy, run
from tierserve.core.sections import ModelEntry

PROMPT = "The lighthouse keeper counted the ships that passed"


def cached(client, **body) -> dict:
    response = client.post("/v1/cached/completions", json={"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def greedy_text(lab: Lab) -> str:
    return lab.once("greedy-text", lambda: run(lab.shared, PROMPT, greedy(6)).text)


def speculative_temperature(lab: Lab) -> None:
    # a cached request that omits temperature samples at [speculative] temperature: 0 is greedy
    with lab.http({"speculative.temperature": 0}) as client:
        assert cached(client, seed=3)["choices"][0]["text"] == greedy_text(lab)


def speculative_top_k(lab: Lab) -> None:
    # hot sampling, but only the best token may be drawn: the greedy text
    with lab.http({"speculative.temperature": 2.0, "speculative.top_k": 1}) as client:
        assert cached(client, seed=3)["choices"][0]["text"] == greedy_text(lab)


def speculative_top_p(lab: Lab) -> None:
    with lab.http({"speculative.temperature": 2.0, "speculative.top_k": 0, "speculative.top_p": 1e-9}) as client:
        assert cached(client, seed=3)["choices"][0]["text"] == greedy_text(lab)


def speculative_beam_width(lab: Lab) -> None:
    # beam search asked for without a width gets [speculative] beam_width beams: n may not exceed it
    with lab.http({"speculative.beam_width": 2}) as client:
        assert len(cached(client, use_beam_search=True, n=2)["choices"]) == 2
        refused = client.post("/v1/cached/completions", json={"prompt": PROMPT, "use_beam_search": True, "n": 3})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "num_return_sequences"


def model_served_model_name(lab: Lab) -> None:
    with lab.http({"model.served_model_name": ["house-model", "spare-name"]}) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["house-model", "spare-name"]
        assert cached(client, model="spare-name", temperature=0)["model"] == "spare-name"


def model_accepted_names(lab: Lab) -> None:
    with lab.http({"model.accepted_names": ["spec-example"]}) as client:
        assert "spec-example" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
        cached(client, model="spec-example", temperature=0)  # 200, answered by the one model
    with pytest.raises(ValueError, match="accepted_names: a \\[\\[models\\]\\] entry names itself"):
        ModelEntry(name="m", path="builtin:tiny", accepted_names=["x"])  # never silently ignored
    with lab.http({"model.accepted_names": []}) as client:
        assert client.post("/v1/completions", json={"model": "spec-example", "prompt": PROMPT}).status_code == 404


def server_timeout_seconds(lab: Lab) -> None:
    # 20 ms: the fused decode makes the tiny test model fast enough to finish the whole context in 0.2 s
    with lab.http({"server.timeout_seconds": 0.02}) as client:
        room = client.get("/v1/models").json()["data"][0]["max_model_len"] - 64  # the context, less the prompt
        late = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": room, "ignore_eos": True})
        assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"


def server_max_tokens_limit(lab: Lab) -> None:
    with lab.http({"server.max_tokens_limit": 4}) as client:
        over = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
        chat = {"messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True}  # names no max_tokens
        assert client.post("/v1/chat/completions", json=chat).json()["usage"]["completion_tokens"] == 4
    with lab.http({}) as client:
        assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}).status_code == 200


def server_max_prompt_bytes(lab: Lab) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1}
    with lab.http({"server.max_prompt_bytes": len(PROMPT) - 1}) as client:
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
        assert "max_prompt_bytes" in refused.json()["error"]["message"]
    with lab.http({"server.max_prompt_bytes": len(PROMPT)}) as client:
        assert client.post("/v1/completions", json=body).status_code == 200


PROBES = {
    "speculative.temperature": speculative_temperature,
    "speculative.top_k": speculative_top_k,
    "speculative.top_p": speculative_top_p,
    "speculative.beam_width": speculative_beam_width,
    "model.served_model_name": model_served_model_name,
    "model.accepted_names": model_accepted_names,
    "server.timeout_seconds": server_timeout_seconds,
    "server.max_tokens_limit": server_max_tokens_limit,
    "server.max_prompt_bytes": server_max_prompt_bytes,
}
