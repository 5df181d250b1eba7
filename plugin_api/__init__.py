"""Everything a tierserve plugin may import, in one place: ``from tierserve.plugin_api import ...``.

Stability: the names exported here (``__all__``), their documented methods,
the arguments tierserve calls a registered factory with, and the hooks in
``tierserve.core.hookspecs`` change only with a new major version of
tierserve (``API_VERSION`` says which contract this is). A name being
renamed keeps its old name as an alias for at least one minor release, with
the change in the changelog. Anything imported from elsewhere in
``tierserve`` (``tierserve.engine``, ``tierserve.cache.store``, private
``_names``) may change in any release.

The conformance suites in ``tierserve.testing`` (``check_eviction_policy``,
``check_cache_tier``, ``check_scheduler``, ``check_speculator``) state the
rules behind these classes as tests a plugin runs on itself.
"""

from __future__ import annotations

from tierserve.cache.eviction import EvictionPolicy, Key
from tierserve.cache.stats import TierStats
from tierserve.cache.tier import CacheEntry, CacheTier, TierCapacity, WriteTally
from tierserve.core.backend import ModelBackend
from tierserve.core.batch import RunnerOutput, ScheduledChunk, SchedulerOutput
from tierserve.core.errors import ConfigError, QueueFullError, RequestError
from tierserve.cache.figures import Counter, Figures, Gauge
from tierserve.core.hookspecs import Register, hookimpl
from tierserve.core.scheduler import ModelLimits, Scheduler
from tierserve.core.sections import SchedulerSettings, Settings
from tierserve.core.sequence import FinishReason, Sequence, SequenceStatus
from tierserve.core.speculation import DraftRequest, Proposal, Speculator
from tierserve.core.tier_settings import TierSettings
from tierserve.core.tool_calls import ToolCall, ToolParser
from tierserve.models.backend_choice import UnsupportedModel

API_VERSION = 1  # the plugin contract above; it changes only with tierserve's major version

__all__ = [
    "API_VERSION",
    "CacheEntry",
    "CacheTier",
    "ConfigError",
    "Counter",
    "DraftRequest",
    "EvictionPolicy",
    "Figures",
    "FinishReason",
    "Gauge",
    "Key",
    "ModelBackend",
    "ModelLimits",
    "Proposal",
    "QueueFullError",
    "Register",
    "RequestError",
    "RunnerOutput",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerSettings",
    "Sequence",
    "SequenceStatus",
    "Settings",
    "Speculator",
    "TierCapacity",
    "TierSettings",
    "TierStats",
    "ToolCall",
    "ToolParser",
    "UnsupportedModel",
    "WriteTally",
    "hookimpl",
]
