"""Attaching a client to a new engine core, in this process or in a child process.

Apart from ``builder`` (which imports torch and the model code): the server
process connects to a core in a child process without loading either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from tierserve.engine.requests import read_warm_prompts

if TYPE_CHECKING:
    from tierserve.settings.config import Settings
    from tierserve.engine.client import EngineClient
    from tierserve.core.plugins import PluginManager

log = structlog.get_logger(__name__)


def warm_prompts(settings: Settings) -> list[str]:
    """The prompts ``[kv_cache] warm_prompts`` and ``warm_prompts_file`` ask to warm at start."""
    kv = settings.kv_cache
    prompts = list(kv.warm_prompts)
    if kv.warm_prompts_file:
        prompts += read_warm_prompts(kv.warm_prompts_file)
    return prompts


def connect(settings: Settings, plugins: PluginManager | None, *, process: bool) -> EngineClient:
    """A client attached to a new core: in this process (stepped by hand until ``start``), or in a child process."""
    from tierserve.engine.client import EngineClient

    if process:
        from tierserve.engine.process import spawn_core

        client = spawn_core(settings, plugins)
    else:
        from tierserve.engine.builder import build_core, model_info
        from tierserve.engine.drivers import InProcessDriver

        core = build_core(settings, plugins)
        client = EngineClient(settings, model_info(core), core.backend.tokenizer)
        client.driver = InProcessDriver(core, client.receive)
    prompts = warm_prompts(settings)
    if prompts:
        warmed = client.warm(prompts)
        log.info("warm_prompts_cached", prompts=len(prompts), tokens=warmed.tokens, writes=warmed.writes)
    return client
