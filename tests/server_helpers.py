"""A real uvicorn server on a loopback port, in a thread, around an app built by ``create_app``."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from tests.waiting import wait_until
from tierserve.server.app import create_app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base: str, timeout: float) -> None:
    """Poll ``/health/ready`` until it answers 200; the test fails after ``timeout`` seconds."""

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout=timeout, interval=0.05, what=f"the server on {base} to be ready")


@contextmanager
def running_server(settings, engine=None, plugins=None, ready_timeout: float = 120.0) -> Iterator[str]:
    """Serve ``create_app(settings, engine=...)`` on 127.0.0.1; yields the base URL once /health/ready is 200."""
    app = create_app(settings, engine=engine, plugins=plugins)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, ready_timeout)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def server_starter(checkpoint) -> Iterator[Callable[..., object]]:
    """Yields ``start(**values)``: a ``running_server`` on ``checkpoint`` with a fresh in-process engine and
    these ``section__key`` settings (``auth__api_keys=[...]``). Every engine started is closed on exit."""
    from tests.engine_helpers import make_engine
    from tierserve.settings.config import load_settings

    engines = []

    def start(**values):
        values = {"model__device": "cpu", **values}
        overrides = {tuple(dotted.split("__")): value for dotted, value in values.items()}
        overrides[("model", "path")] = str(checkpoint)
        overrides[("logging", "level")] = "warning"
        loaded = load_settings(None, environ={}, overrides=overrides)
        engine = make_engine(checkpoint, **{k: v for k, v in values.items() if not k.startswith("model__")})
        engines.append(engine)
        return running_server(loaded.settings, engine=engine, plugins=loaded.plugins)

    try:
        yield start
    finally:
        for engine in engines:
            engine.close()


@contextmanager
def openai_client(checkpoint, served_name: str = "tiny") -> Iterator[object]:
    """The official ``openai`` client against a server on ``checkpoint`` (engine on a thread), named ``served_name``."""
    import openai

    from tierserve.settings.config import load_settings

    overrides = {
        ("model", "path"): str(checkpoint), ("model", "device"): "cpu", ("model", "served_model_name"): served_name,
        ("server", "engine_process"): False, ("logging", "level"): "warning",
    }  # fmt: skip
    loaded = load_settings(None, environ={}, overrides=overrides)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
