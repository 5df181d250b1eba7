"""The Responses API through the official client: turns chained by previous_response_id hit the prefix cache."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.engine_helpers import build_checkpoint
from tests.server_helpers import openai_client

pytestmark = pytest.mark.integration

ADD = {"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
    "additionalProperties": False}}  # fmt: skip


class Digit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("responses"), "llama", "llama", max_position_embeddings=2048)
    with openai_client(checkpoint) as client:
        yield client


def test_follow_up_turns_reuse_the_earlier_turns_kv(client):
    first = client.responses.create(model="tiny", input="Tell me a story about a dragon by the sea.", max_output_tokens=24)
    assert first.object == "response" and first.output_text and first.usage.output_tokens == 24
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    previous, cached = first, []
    for turn in range(4):
        answer = client.responses.create(model="tiny", input=f"What happened next, part {turn}?",
                                         previous_response_id=previous.id, max_output_tokens=24)  # fmt: skip
        assert answer.previous_response_id == previous.id
        assert answer.usage.input_tokens > previous.usage.input_tokens + previous.usage.output_tokens
        cached.append(answer.usage.input_tokens_details.cached_tokens)
        previous = answer
    # every earlier turn's full blocks come from the cache: the cached part grows with the conversation
    assert all(c > 0 for c in cached) and cached == sorted(cached) and cached[-1] > cached[0]
    assert client.responses.retrieve(previous.id).output_text == previous.output_text


def test_store_false_keeps_nothing_and_delete_forgets(client):
    kept = client.responses.create(model="tiny", input="Hi", max_output_tokens=4)
    transient = client.responses.create(model="tiny", input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(transient.id)
    with pytest.raises(openai.BadRequestError) as failure:
        client.responses.create(model="tiny", input="x", previous_response_id=transient.id, max_output_tokens=4)
    assert failure.value.body["param"] == "previous_response_id"
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_streamed_events_in_order(client):
    events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=12, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text and text


def test_function_calls_and_their_outputs(client):
    answer = client.responses.create(model="tiny", input="Add it", tools=[ADD], tool_choice="required", max_output_tokens=100)
    (call,) = [item for item in answer.output if item.type == "function_call"]
    assert call.name == "add" and 0 <= int(__import__("json").loads(call.arguments)["a"]) <= 9
    follow = client.responses.create(
        model="tiny", previous_response_id=answer.id, tools=[ADD], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "7"}],
    )  # fmt: skip
    assert follow.usage.input_tokens_details.cached_tokens > 0
    streamed = list(client.responses.create(model="tiny", input="Add", tools=[ADD], tool_choice="required",
                                            max_output_tokens=100, stream=True))  # fmt: skip
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    (sent,) = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    stored = client.responses.retrieve(streamed[-1].response.id)
    assert [item.call_id for item in stored.output if item.type == "function_call"] == [sent.call_id]
    answered = client.responses.create(
        model="tiny", previous_response_id=stored.id, max_output_tokens=4, tools=[ADD],
        input=[{"type": "function_call_output", "call_id": sent.call_id, "output": "3"}],
    )  # fmt: skip
    assert answered.usage.input_tokens_details.cached_tokens > 0  # the same tools: the same prefix
    without_tools = client.responses.create(
        model="tiny", previous_response_id=stored.id, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": sent.call_id, "output": "3"}],
    )  # fmt: skip
    assert without_tools.output_text is not None


def test_text_format_parses(client):
    answer = client.responses.parse(model="tiny", input="A digit?", text_format=Digit, max_output_tokens=40)
    assert isinstance(answer.output_parsed, Digit)


@pytest.mark.parametrize(
    ("extra", "param", "status"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning", 501),
        ({"background": True}, "background", 501),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", 501),
        ({"input": [{"type": "reasoning"}]}, "input[0].type", 501),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
         400),
        ({"text": {"format": {"type": "xml"}}}, "text.format", 400),
    ],
)  # fmt: skip
def test_what_is_not_built_is_a_501_and_what_the_model_cannot_read_a_400(client, extra, param, status):
    with pytest.raises(openai.APIStatusError) as failure:
        client.responses.create(**{"model": "tiny", "input": "Hi", "max_output_tokens": 4, **extra})
    assert failure.value.status_code == status
    assert failure.value.body["param"] == param or failure.value.body["param"].startswith(param)


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 keys"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "keys too long"),
        ({"metadata": {"note": "x" * 513}}, "metadata", "values too long for ['note']"),
        ({"text": {"format": "json"}}, "text.format", "an object with a type"),
    ],
)  # fmt: skip
def test_bad_metadata_and_formats_are_a_400(client, extra, param, says):
    """OpenAI's bounds on metadata (16 keys of up to 64 characters, values up to 512): a stored response cannot
    carry megabytes of it; a text.format that is no object is named, not a 500."""
    with pytest.raises(openai.BadRequestError) as failure:
        client.responses.create(**{"model": "tiny", "input": "Hi", "max_output_tokens": 4, **extra})
    assert failure.value.body["param"].startswith(param) and says in failure.value.body["message"]


def test_stored_conversations_survive_a_restart_with_their_kv_in_l3(tmp_path):
    """With a persistent disk tier, stored responses live in its folder too: after a restart a follow-up
    finds its conversation and the KV of its earlier turns (from L3)."""
    import openai as client_library

    from tests.server_helpers import running_server
    from tierserve.settings.config import load_settings

    checkpoint = build_checkpoint(tmp_path, "llama", "llama", max_position_embeddings=2048)
    overrides = {
        ("model", "path"): str(checkpoint), ("model", "device"): "cpu", ("model", "served_model_name"): "tiny",
        ("server", "engine_process"): False, ("logging", "level"): "warning",
        ("kv_cache", "tiers"): [{"name": "l3", "plugin": "disk", "path": str(tmp_path / "l3"), "persistent": True,
                                "write_through": True}],
    }  # fmt: skip
    loaded = load_settings(None, environ={}, overrides=overrides)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        first = client_library.OpenAI(base_url=f"{base}/v1", api_key="unused").responses.create(
            model="tiny", input="Tell me a long story about a dragon who lived by the sea. " * 4, max_output_tokens=16
        )
        streamed = list(client_library.OpenAI(base_url=f"{base}/v1", api_key="unused").responses.create(
            model="tiny", input="Hi", max_output_tokens=4, stream=True))[-1].response  # fmt: skip
    assert (tmp_path / "l3" / "responses").is_dir()
    loaded = load_settings(None, environ={}, overrides=overrides)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        client = client_library.OpenAI(base_url=f"{base}/v1", api_key="unused")
        assert client.responses.retrieve(first.id).output_text == first.output_text
        assert [item.id for item in client.responses.retrieve(streamed.id).output] == [item.id for item in streamed.output]
        follow = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id, max_output_tokens=4)
        assert follow.usage.input_tokens_details.cached_tokens >= 64  # the first turn's blocks, read back from L3


def test_a_stored_response_is_its_tenants_only(tmp_path):
    import openai as client_library

    from tests.server_helpers import running_server
    from tierserve.settings.config import load_settings

    checkpoint = build_checkpoint(tmp_path, "llama", "llama")
    overrides = {
        ("model", "path"): str(checkpoint), ("model", "device"): "cpu", ("model", "served_model_name"): "tiny",
        ("server", "engine_process"): False, ("logging", "level"): "warning",
        ("auth", "tenants"): {"acme": ["key-acme"], "globex": ["key-globex"]},
    }  # fmt: skip
    loaded = load_settings(None, environ={}, overrides=overrides)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        acme = client_library.OpenAI(base_url=f"{base}/v1", api_key="key-acme")
        globex = client_library.OpenAI(base_url=f"{base}/v1", api_key="key-globex")
        kept = acme.responses.create(model="tiny", input="A secret plan", max_output_tokens=4)
        with pytest.raises(client_library.NotFoundError):
            globex.responses.retrieve(kept.id)
        with pytest.raises(client_library.BadRequestError):
            globex.responses.create(model="tiny", input="x", previous_response_id=kept.id, max_output_tokens=2)
        with pytest.raises(client_library.NotFoundError):
            globex.responses.delete(kept.id)
        assert acme.responses.retrieve(kept.id).id == kept.id
