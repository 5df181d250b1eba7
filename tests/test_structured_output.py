"""Constrained decoding: response_format and guided_* force valid output even from random weights."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, make_engine
from tests.server_helpers import openai_client
from tierserve.core.grammar import GrammarSpec
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict mode requires

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad", "calm"]
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


PERSON_SCHEMA = Person.model_json_schema()
EMAIL = r"[a-z]{3,8}@example\.(com|org)"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("structured"), "llama", "llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    with openai_client(checkpoint) as client:
        yield client


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_the_pydantic_object(server, temperature):
    for prompt in ("Who is this?", "Describe someone."):
        answer = server.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": prompt}], response_format=Person,
            max_tokens=120, temperature=temperature, seed=7,
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


def test_streamed_json_schema_output_parses(server):
    stream = server.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=120, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}},
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Person.model_validate_json(text)


def test_guided_regex_choice_and_gbnf_grammar(server):
    def complete(**extra):
        answer = server.completions.create(model="tiny", prompt="x", max_tokens=40, n=3, temperature=1.0, extra_body=extra)
        return [c.text for c in answer.choices]

    assert all(re.fullmatch(EMAIL, text) for text in complete(guided_regex=EMAIL))
    assert all(text in ("red", "green", "blue") for text in complete(guided_choice=["red", "green", "blue"]))
    gbnf = 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
    assert all(re.fullmatch(r"(yes|no) [0-9]", text) for text in complete(guided_grammar=gbnf))
    lark = 'start: "(" NUMBER ")"\nNUMBER: /[1-9][0-9]?/'
    assert all(re.fullmatch(r"\([1-9][0-9]?\)", text) for text in complete(guided_grammar=lark))
    objects = complete(guided_json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                    "additionalProperties": False})  # fmt: skip
    assert all(json.loads(text).keys() == {"ok"} for text in objects)


def test_json_object_mode_starts_an_object(server):
    answer = server.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=30, response_format={"type": "json_object"}
    )
    content = answer.choices[0].message.content
    assert content.startswith("{")
    if answer.choices[0].finish_reason == "stop":  # random weights may still be inside a string at max_tokens
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize(
    ("extra", "param", "phrase"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format", "nonsense"),
        ({"response_format": {"type": "xml"}}, "response_format", '"json_schema"'),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": 'root ::= "a" ('}, "guided_grammar", "not a Lark or GBNF grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint per request"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "ends where its grammar does"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(server, extra, param, phrase):
    with pytest.raises(openai.BadRequestError) as failure:
        server.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body=extra)
    error = failure.value.body
    assert error["param"] == param and phrase in error["message"]


HUGE_ANY_OF = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
                          "additionalProperties": False} for i in range(5000)]}  # fmt: skip


@pytest.mark.parametrize("schema", [HUGE_ANY_OF, {"$ref": "#"}], ids=["5000-alternatives", "self-reference"])
def test_a_schema_the_parser_gives_up_on_is_an_error_not_a_broken_200(server, schema):
    """Schemas llguidance accepts but cannot follow as the output grows (thousands of alternatives, a
    self-reference): the request fails naming the field (400; a stream ends with an error event), where it
    used to answer 200 with ``{"`` or nothing and finish_reason "stop"."""
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as failure:
        server.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=20,
                                       response_format=response_format)  # fmt: skip
    error = failure.value.body
    assert error["param"] == "response_format" and "could not follow this schema" in error["message"]
    stream = server.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=20,
                                            response_format=response_format, stream=True)  # fmt: skip
    with pytest.raises(openai.APIError, match="could not follow this schema"):
        list(stream)
    ok = server.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert ok.choices[0].message.content is not None


def test_speculative_drafts_and_preemption_keep_constrained_output_exact(checkpoint):
    """ngram drafts a refused token sometimes: it is rejected, and greedy output is unchanged; ngram_tree's trees
    are cut to their first branch for a constrained sequence, with the same result; a tiny KV pool preempts
    sequences mid-grammar: recomputed, they go on from the same grammar state."""
    plain = make_engine(checkpoint, backend="native")
    drafting = make_engine(checkpoint, backend="native", speculative__method="ngram", speculative__num_speculative_tokens=4)
    trees = make_engine(checkpoint, backend="native", speculative__method="ngram_tree")
    squeezed = make_engine(checkpoint, backend="native", kv_cache__block_size=4, kv_cache__l1_capacity=40,
                           scheduler__max_num_batched_tokens=16)  # fmt: skip
    specs = [
        GrammarSpec("regex", r"(abc ){2,40}"),
        GrammarSpec("json_schema", json.dumps(PERSON_SCHEMA)),
        GrammarSpec("grammar", 'start: ("ab" | "abc" | " ")+ "."'),
    ]
    prompts = ["abc abc abc abc abc abc", PROMPTS[1], PROMPTS[4]]
    try:
        for spec in specs:
            params = SamplingParams(max_tokens=60, temperature=0, grammar=spec)
            reference = [r.token_ids for r in plain.generate(prompts, params)]
            assert [r.token_ids for r in drafting.generate(prompts, params)] == reference
            assert [r.token_ids for r in trees.generate(prompts, params)] == reference
            assert [r.token_ids for r in squeezed.generate(prompts, params)] == reference
        assert drafting.stats().speculation.accepted > 0
        tree_stats = trees.stats().speculation
        assert tree_stats.accepted > 0 and tree_stats.tree_verifications == 0  # linear runs only
        assert squeezed.stats().counters.preemptions > 0
        for engine in (plain, drafting, trees, squeezed):
            assert_pool_released(engine)
    finally:
        for engine in (plain, drafting, trees, squeezed):
            engine.close()


def test_constrained_and_free_requests_share_a_batch(checkpoint):
    engine = make_engine(checkpoint, backend="native")
    try:
        email = GrammarSpec("regex", EMAIL)
        person = GrammarSpec("json_schema", json.dumps(PERSON_SCHEMA))
        params = [SamplingParams(max_tokens=80, temperature=1.0, seed=i, grammar=[email, person, None][i % 3])
                  for i in range(12)]  # fmt: skip
        results = engine.generate(["Hello"] * 12, params)
        for index, result in enumerate(results):
            if index % 3 == 0:
                assert re.fullmatch(EMAIL, result.text)
            elif index % 3 == 1:
                Person.model_validate_json(result.text)
            else:
                assert len(result.token_ids) == 80 or result.finish_reason == "stop"
    finally:
        engine.close()


def test_a_schema_is_compiled_once_for_all_its_choices(checkpoint):
    """``n = 16`` choices of one large schema (300 fields): the engine compiles it once and gives each sequence a
    copy (it compiled it 16 times on the step thread, seconds for a large schema, while every other request
    waited); the copies are independent, so every choice still follows the schema on its own draws."""
    fields = {f"field_{i}": {"type": "integer"} for i in range(300)}
    schema = {"type": "object", "properties": fields, "required": list(fields)[:2], "additionalProperties": False}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    engine = make_engine(checkpoint, backend="native")
    try:
        runtime = engine.driver.core.runner.grammar  # white-box: how often it compiled
        before = runtime.compiled
        params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, grammar=spec) for i in range(16)]
        results = engine.generate(["Hello"] * 16, params)
        assert runtime.compiled == before + 1
        texts = [result.text for result in results]
        assert len(set(texts)) > 1  # each copy advanced on its own tokens
        for result in results:
            assert result.text.startswith('{"field_')
            if result.finish_reason == "stop":
                assert set(json.loads(result.text)) <= set(fields)
        engine.generate(["Hello"], [SamplingParams(max_tokens=8, temperature=1.0, seed=99, grammar=spec)])
        assert runtime.compiled == before + 1  # and again from its template, for a later request
    finally:
        engine.close()
