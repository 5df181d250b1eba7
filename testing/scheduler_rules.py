"""``check_scheduler``: the rules every scheduler keeps, run over a scheduler class in a real engine.

The rules are those ``tierserve.core.scheduler`` states. The scheduler is
registered under the name ``under_test`` through ``register_schedulers``, as
its plugin would register it, and drives an engine on ``builtin:tiny``; its
outputs are compared with the built-in ``fcfs`` scheduler's on the same
prompts (greedy decoding: a scheduler changes when tokens are computed,
never which).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tierserve.core.batch import SchedulerOutput
from tierserve.core.errors import QueueFullError
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.scheduler import Scheduler
from tierserve.core.sequence import Sequence, SequenceStatus
from tierserve.testing.harness import component_plugin, plugin_manager, tiny_engine
from tierserve.testing.rules import RuleBroken, rule

if TYPE_CHECKING:
    from pydantic import BaseModel

    from tierserve.engine import EngineClient

NAME = "under_test"
PROMPTS = [
    "a much longer prompt than the others, so that it needs several blocks and several prefill chunks " * 3,
    "a mid-sized prompt",
    "hi",
    "a much longer prompt than the others, so that it shares its first blocks with the first one",
    "one two three four five six seven eight nine ten",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def check_scheduler(
    scheduler: type[Scheduler], *, settings_model: type[BaseModel] | None = None, options: Mapping[str, Any] | None = None
) -> list[str]:
    """Run every scheduler rule over ``scheduler`` (the class, or the factory registered for it).

    Args:
        scheduler: called as the engine calls it: ``scheduler(scheduler_settings, kv, model=limits)`` (and
            ``options=`` when it has a settings model).
        settings_model: the pydantic model it registers as ``settings=``, if any.
        options: its ``[plugins.under_test]`` table.

    Returns:
        The names of the rules checked (all passed).

    Raises:
        RuleBroken: (an ``AssertionError``) the first rule broken, with what happened.
    """
    metadata = {"settings": settings_model} if settings_model is not None else {}
    plugins = plugin_manager(component_plugin("schedulers", NAME, scheduler, **metadata))
    table = {f"plugins.{NAME}.{key}": value for key, value in (options or {}).items()}
    checked = []
    with rule(_outputs_match_first_come_first_served, scheduler):
        reference = _outputs_match_first_come_first_served(plugins, table)
    checked.append("outputs_match_first_come_first_served")
    for check in (_keeps_the_step_budgets, _preempts_when_blocks_run_out, _bounds_its_queue, _finish_frees_everything):
        with rule(check, scheduler):
            check(plugins, table, reference)
        checked.append(check.__name__.strip("_"))
    return checked


@contextmanager
def engine_with(plugins: Any, table: Mapping[str, Any], **settings: Any) -> Iterator[EngineClient]:
    values = {"scheduler.name": NAME, "kv_cache.block_size": 4, **table}
    values.update({key.replace("__", "."): value for key, value in settings.items()})
    with tiny_engine(values, plugins) as engine:
        yield engine


def run(engine: EngineClient, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [result.token_ids for result in engine.generate(prompts, GREEDY)]


def released(engine: EngineClient, when: str) -> None:
    engine.check_integrity()
    stats = engine.stats()
    if stats.kv_blocks_free != stats.kv_blocks_total:
        raise RuleBroken(f"{when}: {stats.kv_blocks_total - stats.kv_blocks_free} KV blocks still held")
    if stats.requests_running or stats.requests_waiting:
        raise RuleBroken(f"{when}: num_running {stats.requests_running}, num_waiting {stats.requests_waiting}, not 0")


def _outputs_match_first_come_first_served(plugins: Any, table: Mapping[str, Any]) -> list[list[int]]:
    """Greedy outputs equal the built-in ``fcfs`` scheduler's, and every block is free when all requests ended."""
    with engine_with(plugins, table) as engine:
        outputs = run(engine)
        released(engine, "after every request finished")
    with engine_with(plugins, {}, scheduler__name="fcfs") as engine:
        reference = run(engine)
    for index, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        if got != want:
            raise RuleBroken(f"prompt {index}: tokens {got}, fcfs gives {want}")
    return reference


def _keeps_the_step_budgets(plugins: Any, table: Mapping[str, Any], reference: list[list[int]]) -> None:
    """Each step: at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences, each sequence once,
    running, from its ``num_computed_tokens``, with its slots allocated in ``block_table`` before the chunk is returned."""
    budget, seqs = 16, 2
    with engine_with(plugins, table, scheduler__max_num_batched_tokens=budget, scheduler__max_num_seqs=seqs) as engine:
        core = engine.driver.core
        scheduler, block_size = core.scheduler, core.kv.block_size
        schedule = scheduler.schedule
        steps: list[SchedulerOutput] = []

        def checked_schedule() -> SchedulerOutput:
            output = schedule()
            step = len(steps)
            steps.append(output)
            chunks = output.chunks
            if sum(chunk.num_tokens for chunk in chunks) > budget:
                raise RuleBroken(f"step {step} schedules {sum(c.num_tokens for c in chunks)} tokens, budget {budget}")
            if len(chunks) > seqs:
                raise RuleBroken(f"step {step} schedules {len(chunks)} sequences, max_num_seqs {seqs}")
            if len({id(chunk.seq) for chunk in chunks}) != len(chunks):
                raise RuleBroken(f"step {step} schedules a sequence twice")
            for chunk in chunks:
                seq = chunk.seq
                if seq.status is not SequenceStatus.RUNNING or chunk.num_tokens < 1:
                    raise RuleBroken(f"step {step} schedules {seq.request_id} with status {seq.status.name}, "
                                     f"{chunk.num_tokens} tokens")  # fmt: skip
                if chunk.start != seq.num_computed_tokens:
                    raise RuleBroken(f"step {step}: a chunk starts at {chunk.start}, the sequence has "
                                     f"{seq.num_computed_tokens} tokens computed")  # fmt: skip
                if len(seq.block_table) * block_size < chunk.start + chunk.num_tokens:
                    raise RuleBroken(f"step {step}: {seq.request_id} runs to position {chunk.start + chunk.num_tokens} "
                                     f"with {len(seq.block_table)} blocks of {block_size} allocated")  # fmt: skip
            return output

        scheduler.schedule = checked_schedule
        outputs = run(engine)
        released(engine, "after every request finished")
    if outputs != reference:
        raise RuleBroken("under tight budgets the outputs differ from fcfs's")


def _preempts_when_blocks_run_out(plugins: Any, table: Mapping[str, Any], reference: list[list[int]]) -> None:
    """With too few KV blocks for every request at once, the scheduler preempts (``self.preempt``) and later
    resumes, so every request finishes with fcfs's tokens and every block comes back."""
    with engine_with(plugins, table, kv_cache__l1_capacity=30, scheduler__max_num_batched_tokens=16) as engine:
        outputs = run(engine)
        released(engine, "after every request finished")
    if outputs != reference:
        raise RuleBroken("with a small KV pool the outputs differ from fcfs's")


def _bounds_its_queue(plugins: Any, table: Mapping[str, Any], reference: list[list[int]]) -> None:
    """``add`` beyond ``max_waiting_requests`` raises ``QueueFullError``; ``num_waiting`` counts what was added."""
    with engine_with(plugins, table, scheduler__max_waiting_requests=3) as engine:
        scheduler = engine.driver.core.scheduler
        seqs = [Sequence(900 + n, f"queued-{n}", [1, 2, 3], 3, GREEDY) for n in range(4)]
        for seq in seqs[:3]:
            scheduler.add(seq)
        if scheduler.num_waiting != 3:
            raise RuleBroken(f"3 sequences added, num_waiting {scheduler.num_waiting}")
        try:
            scheduler.add(seqs[3])
        except QueueFullError:
            pass
        else:
            raise RuleBroken("a 4th sequence with max_waiting_requests = 3 did not raise QueueFullError")
        for seq in seqs[:3]:
            scheduler.finish(seq)
        if scheduler.num_waiting != 0:
            raise RuleBroken(f"after finish() of every waiting sequence, num_waiting {scheduler.num_waiting}")


def _finish_frees_everything(plugins: Any, table: Mapping[str, Any], reference: list[list[int]]) -> None:
    """Requests aborted while running or waiting leave no blocks held and no sequence queued."""
    with engine_with(plugins, table, scheduler__max_num_seqs=1) as engine:
        streams = [engine.submit(engine.encode_prompt(p), GREEDY)[0] for p in PROMPTS]
        engine.step()
        engine.step()
        for request_id in streams:
            engine.abort(request_id)
        while engine.has_work():
            engine.step()
        released(engine, "after aborting every request")
