"""Log output: JSON in production with request ids, readable lines in development."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from tierserve.settings.config import load_settings
from tierserve.settings.logs import configure_logging, request_context

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def restore_root_logger(restore_logging):
    yield


def test_production_logs_are_json_with_request_id():
    stream = io.StringIO()
    configure_logging(load_settings("production", environ={}).settings.logging, stream=stream)
    with request_context("req-123", tenant="acme") as request_id:
        structlog.get_logger("tierserve.test").info("cache_hit", blocks=4)
        logging.getLogger("uvicorn.error").warning("from stdlib")
    structlog.get_logger("tierserve.test").info("after")
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert request_id == "req-123"
    assert records[0]["event"] == "cache_hit" and records[0]["blocks"] == 4
    assert records[0]["request_id"] == "req-123" and records[0]["tenant"] == "acme"
    assert records[0]["level"] == "info" and "timestamp" in records[0]
    assert records[1]["event"] == "from stdlib" and records[1]["request_id"] == "req-123"
    assert "request_id" not in records[2]


def test_development_logs_are_console_lines():
    stream = io.StringIO()
    configure_logging(load_settings("development", environ={}).settings.logging, stream=stream)
    with request_context() as request_id:
        structlog.get_logger("tierserve.test").debug("step", batch=3)
    line = stream.getvalue().strip()
    assert "step" in line and "batch=3" in line and f"request_id={request_id}" in line
    assert not line.startswith("{")
