"""The stored responses of ``/v1/responses``: bounded in bytes as well as count, fair between tenants, and a
damaged folder or record never stops the server."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest

from tierserve.server.response_store import ResponseStore, StoredResponse

pytestmark = pytest.mark.unit


def response(tenant: str, text: str = "hi", at: float | None = None) -> StoredResponse:
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    return StoredResponse({"id": "r", "output_text": text}, messages, tenant, time.time() if at is None else at)


def test_one_tenant_filling_the_store_pushes_out_its_own_responses():
    """20 stored responses at most: tenant A storing 20 after B's one pushes out A's oldest, never B's."""
    store = ResponseStore(20, None)
    store.put("b-1", response("b"))
    for index in range(20):
        store.put(f"a-{index}", response("a"))
    assert store.get("b-1", "b") is not None
    assert store.get("a-0", "a") is None and store.get("a-19", "a") is not None
    assert len(store) == 20


def test_the_store_is_bounded_in_bytes():
    """Responses of ~200 KB each (the text in the body and in the conversation) under a 1 MB bound: the store
    keeps at most 1 MB of them, the newest."""
    store = ResponseStore(1000, None, max_bytes=2**20)
    size = len(json.dumps(asdict(response("a", "x" * 100_000))))
    for index in range(30):
        store.put(f"r-{index}", response("a", "x" * 100_000))
    kept = 2**20 // size
    assert store.stored_bytes <= 2**20 and len(store) == kept == 5
    assert store.get("r-29", "a") is not None and store.get(f"r-{29 - kept}", "a") is None
    store.put("big", response("b", "y" * 3 * 2**20))  # larger than the whole bound: it cannot be kept
    assert store.get("big", "b") is None and store.stored_bytes <= 2**20


def test_a_damaged_database_is_moved_aside_and_the_store_starts_empty(tmp_path):
    folder = tmp_path / "responses"
    store = ResponseStore(10, None, folder)
    store.put("kept", response("a"))
    store.close()
    (folder / "cache.db").write_bytes(b"\x13\x37 not sqlite " * 500)
    store = ResponseStore(10, None, folder)
    assert len(store) == 0 and store.damaged_moved_to is not None and store.damaged_moved_to.is_dir()
    store.put("new", response("a"))  # and it stores again, on a fresh database
    store.close()
    assert ResponseStore(10, None, folder).get("new", "a") is not None


@pytest.mark.parametrize(
    "record",
    [
        {"body": {}, "messages": [], "tenant": "a", "stored_at": "x"},
        {"body": [], "messages": [], "tenant": "a", "stored_at": 1.0},
        {"body": {}, "messages": [{"content": "no role"}], "tenant": "a", "stored_at": 1.0},
        {"body": {}, "messages": "hi", "tenant": "a", "stored_at": 1.0},
        {"body": {}, "messages": [], "tenant": 7, "stored_at": 1.0},
        {"body": {}, "messages": []},
        "not json {",
        [1, 2],
    ],
)
def test_a_record_of_the_wrong_shape_is_dropped_at_start(tmp_path, record):
    import diskcache

    folder = tmp_path / "responses"
    store = ResponseStore(10, None, folder)
    store.put("good", response("a"))
    store.close()
    with diskcache.Cache(str(folder)) as raw:
        raw.set("bad", record if isinstance(record, str) else json.dumps(record))
    store = ResponseStore(10, None, folder)
    assert store.get("good", "a") is not None and store.get("bad", "a") is None and len(store) == 1
