"""The built-in schedulers driven by a fake engine loop, no model needed.

``FakeEngine`` runs the engine core's step with a fake model runner: the
scheduler's own ``schedule()`` and ``update_from_output()``, with one dummy
token sampled for every chunk that samples, so a sequence finishes after
``max_tokens`` outputs. Every step it checks what a user of the scheduler
relies on:

* the token budget and the sequence cap hold;
* every scheduled token has a KV slot, and only running sequences hold blocks
  (their tables account for every used block of the pool);
* a sequence that is decoding and stays running gets its token (decodes come
  before prefills), whenever the budget can cover all decodes;
* admission follows the scheduler's ``order_key`` (head of line), and a
  preempted sequence ranks after every sequence left running;
* a preempted sequence is reset for recompute and keeps its outputs;
* a step with unfinished work schedules something, and every workload ends
  within a bounded number of steps (no deadlock, no livelock).

Schedulers and eviction policies come through the plugin registry, as the
engine gets them.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.cache.block_pool import BlockPool
from tierserve.cache.kv_manager import KVCacheManager
from tierserve.core.batch import RunnerOutput, SchedulerOutput
from tierserve.settings.config import SchedulerSettings
from tierserve.core.plugins import load_plugins
from tierserve.core.sampler import SampledToken
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.scheduler import PROMPT_LOGITS_PER_STEP, QueueFullError, Scheduler
from tierserve.core.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.unit

_PLUGINS = load_plugins(allowlist=[])
_SCHEDULERS = _PLUGINS.registry("schedulers")
_POLICIES = _PLUGINS.registry("eviction_policies")
SCHEDULER_NAMES = ("fcfs", "priority")
FIRST_OUTPUT_TOKEN = 1000


def output_tokens(n: int) -> list[int]:
    """The dummy tokens the fake model samples, in order."""
    return list(range(FIRST_OUTPUT_TOKEN, FIRST_OUTPUT_TOKEN + n))


def make_seq(
    seq_id: int, prompt_len: int, max_tokens: int, *, priority: int = 0, arrival: float | None = None
) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"req-{seq_id}",
        token_ids=list(range(prompt_len)),
        num_prompt_tokens=prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_time=float(seq_id) if arrival is None else arrival,
    )


class FakeEngine:
    """A scheduler, its pool, and the engine's bookkeeping around ``schedule()``."""

    def __init__(
        self,
        name: str = "fcfs",
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        max_waiting_requests: int = 512,
        prefill_group_tokens: int = 0,
        decode_steps_between_prefills: int = 0,
    ) -> None:
        self.settings = SchedulerSettings(
            name=name,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_waiting_requests=max_waiting_requests,
            prefill_group_tokens=prefill_group_tokens,
            decode_steps_between_prefills=decode_steps_between_prefills,
        )
        self.pool = BlockPool(num_blocks, block_size, _POLICIES.get("lru").factory(num_blocks))
        self.scheduler: Scheduler = _SCHEDULERS.get(name).factory(self.settings, KVCacheManager(self.pool))
        self.live: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.outputs: list[SchedulerOutput] = []
        self.admissions: list[Sequence] = []  # each time a waiting sequence starts running
        self.preemptions: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self.live.append(seq)

    def step(self) -> SchedulerOutput:
        waiting_before = {s for s in self.live if s.status is SequenceStatus.WAITING}
        decoding_before = [s for s in self.live if s.status is SequenceStatus.RUNNING and s.num_uncomputed_tokens == 1]
        outputs_before = {s: s.output_token_ids for s in self.live}

        had_work = self.scheduler.has_unfinished
        out = self.scheduler.schedule()
        assert out.chunks or not had_work, "a step with unfinished sequences scheduled nothing"
        self.check_step(out, waiting_before, decoding_before, outputs_before)
        self.outputs.append(out)
        self.preemptions += out.preempted

        result = RunnerOutput()
        for chunk in out.chunks:
            if chunk.samples:
                token = FIRST_OUTPUT_TOKEN + chunk.seq.num_output_tokens
                result.sampled[chunk.seq.seq_id] = [SampledToken(token, None, None)]
        by_request = {seq.request_id: seq for seq in self.live}
        for output in self.scheduler.update_from_output(out, result):
            if output.finish_reason is not None:
                seq = by_request[output.request_id]
                assert seq.status is SequenceStatus.FINISHED and output.finish_reason == "length"
                self.live.remove(seq)
                self.finished.append(seq)
        self.check_blocks()
        return out

    def run(self, max_steps: int = 10_000) -> int:
        """Step until every sequence finishes; fail if that takes more than ``max_steps``."""
        for steps in itertools.count():
            if not self.scheduler.has_unfinished:
                assert not self.live
                return steps
            assert steps < max_steps, f"no termination after {max_steps} steps: {self.live}"
            self.step()

    def check_step(self, out, waiting_before, decoding_before, outputs_before) -> None:
        s = self.settings
        assert out.num_tokens <= s.max_num_batched_tokens
        assert len(out.chunks) <= s.max_num_seqs
        assert self.scheduler.num_running <= s.max_num_seqs
        scheduled = [c.seq for c in out.chunks]
        assert len(set(scheduled)) == len(scheduled), "a sequence got two chunks in one step"
        for chunk in out.chunks:
            seq = chunk.seq
            assert seq.status is SequenceStatus.RUNNING
            assert 1 <= chunk.num_real_tokens <= seq.num_uncomputed_tokens
            assert len(seq.block_table) * self.pool.block_size >= seq.num_computed_tokens + chunk.num_tokens

        running_after = [q for q in self.live if q.status is SequenceStatus.RUNNING]
        key = self.scheduler.order_key
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq not in scheduled
            assert seq.output_token_ids == outputs_before[seq], "preemption lost generated tokens"
            assert all(key(r) < key(seq) for r in running_after), "preempted a sequence that ranks before one kept"

        admitted = [q for q in running_after if q in waiting_before]
        assert not (admitted and out.preempted), "admitted new work in a step that had to preempt"
        waiting_after = [q for q in self.live if q.status is SequenceStatus.WAITING]
        for seq in admitted:
            assert seq in scheduled
            assert all(key(seq) < key(w) for w in waiting_after), "admitted out of order"
        self.admissions += sorted(admitted, key=key)

        if len(decoding_before) <= s.max_num_batched_tokens:
            for seq in decoding_before:
                if seq.status is SequenceStatus.RUNNING:
                    assert seq in scheduled, f"decoding sequence {seq.seq_id} starved"

    def check_blocks(self) -> None:
        self.pool.check_integrity()
        held = []
        for seq in self.live:
            assert seq.num_computed_tokens <= seq.num_tokens
            if seq.status is SequenceStatus.WAITING:
                assert seq.block_table == []
            held += seq.block_table
        assert len(held) == len(set(held)), "two sequences hold the same block"
        assert len(held) == self.pool.num_used_blocks, "blocks leaked or held by no sequence"

    def check_all_done(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            assert seq.is_finished
            assert seq.output_token_ids == output_tokens(seq.params.max_tokens)
            assert seq.block_table == []
        assert self.pool.num_free_blocks == self.pool.num_blocks
        self.pool.check_integrity()
        assert self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0

    def chunks_of(self, seq: Sequence) -> list[int]:
        return [c.num_tokens for out in self.outputs for c in out.chunks if c.seq is seq]


# ---------------------------------------------------------------------------
# Behaviour, case by case
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_prompt_longer_than_budget_is_prefilled_in_chunks(name):
    engine = FakeEngine(name, max_num_batched_tokens=16)
    seq = make_seq(0, prompt_len=50, max_tokens=3)
    engine.add(seq)
    engine.run()
    assert engine.chunks_of(seq) == [16, 16, 16, 2, 1, 1]
    engine.check_all_done([seq])


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_prompts_scored_for_their_logprobs_share_a_bounded_number_of_positions_a_step(name):
    # every scored position returns a vocabulary-wide logits row: a step takes at most PROMPT_LOGITS_PER_STEP of them,
    # however big its token budget (this fake runner computes no logprobs, so every prompt position counts)
    engine = FakeEngine(name, num_blocks=512, max_num_batched_tokens=2048)
    scored = make_seq(0, prompt_len=600, max_tokens=2)
    plain = make_seq(1, prompt_len=600, max_tokens=2)
    later = make_seq(2, prompt_len=300, max_tokens=2)
    for seq in (scored, later):
        seq.params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    for seq in (scored, plain, later):
        engine.add(seq)
    engine.run()
    bound = PROMPT_LOGITS_PER_STEP
    assert engine.chunks_of(scored) == [bound, 600 - bound, 1]
    assert engine.chunks_of(plain) == [600, 1]  # the same step, whole
    assert engine.chunks_of(later) == [300, 1]  # the first step's rows were taken: admitted at the second
    assert all(sum(c.num_prompt_logits for c in out.chunks) <= bound for out in engine.outputs)
    engine.check_all_done([scored, plain, later])


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_a_burst_of_prompts_is_prefilled_one_group_a_step(name):
    """prefill_group_tokens = 24: 10-token prompts arriving together start two a step (the first's 10
    tokens, then a second whole prompt, stay within 24; a third would not), each group's first token a
    step earlier than the next; without the limit all six start in the first step."""
    grouped = FakeEngine(name, max_num_batched_tokens=64, num_blocks=128, prefill_group_tokens=24)
    together = FakeEngine(name, max_num_batched_tokens=64, num_blocks=128)
    for engine in (grouped, together):
        seqs = [make_seq(i, prompt_len=10, max_tokens=3) for i in range(6)]
        for seq in seqs:
            engine.add(seq)
        first_token_step = {}
        while engine.scheduler.has_unfinished:
            engine.step()
            for seq in seqs:
                if seq.num_output_tokens and seq not in first_token_step:
                    first_token_step[seq] = len(engine.outputs)
        engine.check_all_done(seqs)
        if engine is grouped:
            assert [first_token_step[s] for s in seqs] == [1, 1, 2, 2, 3, 3]
            assert [c.num_tokens for c in engine.outputs[1].chunks] == [1, 1, 10, 10]  # two decodes, two prompts
        else:
            assert [first_token_step[s] for s in seqs] == [1] * 6


def closed_loop_prefill_waits(engine: FakeEngine, clients: int, turns: int, prompt_len: int, max_tokens: int):
    """Chat clients that each send their next prompt as their last one finishes: the reply reaches the
    client while the next step already runs, so the prompt arrives during that step and can start in the one
    after. Per prompt (in arrival order after the first turns), the prompt tokens of other sequences that the
    step it arrived during computed: on a compute-bound device, how long it waited before its own step."""
    ids = itertools.count()
    arrivals: dict[int, list[int]] = {1: [turns] * clients}  # step before which prompts are queued -> turns left
    waited, running = [], {}
    for step in itertools.count(1):
        for left in arrivals.pop(step, []):
            seq = make_seq(next(ids), prompt_len, max_tokens)
            engine.add(seq)
            running[seq] = left
        if not running and not arrivals:
            return waited
        assert step < 10_000
        out = engine.step()
        prompt_tokens = sum(c.num_tokens for c in out.chunks if c.seq.num_output_tokens == 0 or c.start < prompt_len)
        for seq, left in list(running.items()):
            if seq.is_finished:
                del running[seq]
                if left > 1:
                    arrivals.setdefault(step + 2, []).append(left - 1)
                    waited.append(("arrives during", step + 1))
        waited = [prompt_tokens if w == ("arrives during", step) else w for w in waited]


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_after_a_step_that_started_prompts_the_next_one_runs_the_decodes_alone(name):
    """decode_steps_between_prefills = 1: a prompt that arrives right after one was started waits one step,
    in which the decoding sequences get their token; with nothing decoding it starts at once."""
    engine = FakeEngine(name, max_num_batched_tokens=64, num_blocks=128, decode_steps_between_prefills=1)
    first, second, third = (make_seq(i, prompt_len=10, max_tokens=6) for i in range(3))
    engine.add(first)
    assert [c.seq for c in engine.step().chunks] == [first]
    engine.add(second)
    assert [c.seq for c in engine.step().chunks] == [first]  # first decodes alone; second waits
    assert [(c.seq, c.num_tokens) for c in engine.step().chunks] == [(first, 1), (second, 10)]
    engine.add(third)
    assert [c.seq for c in engine.step().chunks] == [first, second]
    assert [c.seq for c in engine.step().chunks] == [first, second, third]
    engine.run()
    engine.check_all_done([first, second, third])
    idle = FakeEngine(name, max_num_batched_tokens=64, num_blocks=128, decode_steps_between_prefills=1)
    alone, after = make_seq(0, prompt_len=10, max_tokens=1), make_seq(1, prompt_len=10, max_tokens=1)
    idle.add(alone)
    idle.step()  # alone finishes in its prefill step: nothing decodes, so the next prompt need not wait
    idle.add(after)
    assert [c.seq for c in idle.step().chunks] == [after]


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_a_decode_step_between_prefills_spreads_closed_loop_chat_turns(name):
    """Four clients whose turns end one step apart: with prompts allowed in every step each new prompt
    arrives while the previous client's prompt is being prefilled and waits that whole step, turn after turn;
    with one decode step between prefills their first turns start two steps apart, and every later prompt
    arrives during a step of decodes only."""
    every_step = FakeEngine(name, max_num_batched_tokens=64, num_blocks=256, prefill_group_tokens=1)
    spaced = FakeEngine(name, max_num_batched_tokens=64, num_blocks=256, prefill_group_tokens=1,
                        decode_steps_between_prefills=1)  # fmt: skip
    waited = {}
    for label, engine in (("every step", every_step), ("spaced", spaced)):
        waited[label] = closed_loop_prefill_waits(engine, clients=4, turns=6, prompt_len=12, max_tokens=16)
        assert len(waited[label]) == 4 * 5  # every turn after the first
        engine.check_blocks()
    # the first client of each round arrives during decodes; each of the others during the previous one's prefill
    assert waited["every step"] == [0, 12, 12, 12] * 5
    assert waited["spaced"] == [0] * 20


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_a_long_prompt_in_a_group_of_its_own_still_fills_the_budget(name):
    """A prompt longer than the group size runs when it heads the queue (the first always does), chunked
    by the token budget as before; the prompt after it waits for the next step's group."""
    engine = FakeEngine(name, max_num_batched_tokens=32, num_blocks=128, prefill_group_tokens=8)
    long, short = make_seq(0, prompt_len=40, max_tokens=2), make_seq(1, prompt_len=4, max_tokens=2)
    engine.add(long)
    engine.add(short)
    first = engine.step()
    assert [(c.seq, c.num_tokens) for c in first.chunks] == [(long, 32)]
    engine.run()
    engine.check_all_done([long, short])


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_decode_gets_a_token_every_step_during_a_long_prefill(name):
    engine = FakeEngine(name, max_num_batched_tokens=16, num_blocks=128)
    decoder = make_seq(0, prompt_len=4, max_tokens=40)
    engine.add(decoder)
    engine.step()  # the decoder's prompt; it now decodes
    long = make_seq(1, prompt_len=200, max_tokens=2)
    engine.add(long)
    prefill_steps = 0
    while long.num_output_tokens == 0:
        remaining = long.num_uncomputed_tokens
        out = engine.step()
        by_seq = {c.seq: c.num_tokens for c in out.chunks}
        assert by_seq == {decoder: 1, long: min(15, remaining)}  # the prefill takes the rest of the budget
        prefill_steps += 1
    assert prefill_steps == 14  # ceil(200 / 15)
    assert not decoder.is_finished, "the decode should outlast the prefill"
    engine.run()
    engine.check_all_done([decoder, long])


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_drafts_run_as_lookahead_slots_of_a_decode(name):
    """Speculative drafts live apart from the tokens: a speculating decode is still a decode, first in line."""
    engine = FakeEngine(name, max_num_batched_tokens=16, block_size=4)
    decoder = make_seq(0, prompt_len=6, max_tokens=20)
    engine.add(decoder)
    engine.step()  # the prompt; it now decodes
    last = decoder.token_ids[-1]
    decoder.spec_token_ids = [7, 8, 9]
    long = make_seq(1, prompt_len=40, max_tokens=2)
    engine.add(long)
    out = engine.scheduler.schedule()
    by_seq = {c.seq: c for c in out.chunks}
    chunk = by_seq[decoder]
    assert (chunk.num_tokens, chunk.num_draft, chunk.samples) == (4, 3, True)
    assert chunk.token_ids == [last, 7, 8, 9] and decoder.num_uncomputed_tokens == 1
    assert len(decoder.block_table) * 4 >= decoder.num_computed_tokens + 4  # lookahead slots allocated
    assert by_seq[long].num_tokens == 12  # the prefill takes the rest of the budget

    # two drafts accepted, then the model's own token; the third draft's slot is given back
    accepted = [SampledToken(t, None, None) for t in (7, 8, 50)]
    outputs = engine.scheduler.update_from_output(out, RunnerOutput(sampled={decoder.seq_id: accepted}))
    assert [o.new_token_ids for o in outputs] == [[7, 8, 50]]
    assert decoder.output_token_ids[-3:] == [7, 8, 50] and decoder.spec_token_ids == []
    assert decoder.num_computed_tokens == decoder.num_tokens - 1
    assert len(decoder.block_table) == -(-(decoder.num_computed_tokens + 1) // 4)

    decoder.spec_token_ids = [1, 2, 3]  # more drafts than the budget covers: the excess is dropped
    engine.scheduler.settings.max_num_batched_tokens = 2
    out = engine.scheduler.schedule()
    [chunk] = [c for c in out.chunks if c.seq is decoder]
    assert (chunk.num_tokens, chunk.num_draft, decoder.spec_token_ids) == (2, 1, [1])


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_preempted_sequence_is_recomputed_and_completes(name):
    # each sequence needs up to 5 blocks of 4; together they need 10 of the 6
    engine = FakeEngine(name, num_blocks=6, block_size=4, max_num_batched_tokens=32)
    first, second = make_seq(0, 8, 12), make_seq(1, 8, 12)
    engine.add(first)
    engine.add(second)
    engine.run()
    assert engine.preemptions and set(engine.preemptions) == {second}
    assert first.num_preemptions == 0 and second.num_preemptions >= 1
    # once readmitted, the recompute chunk covers the prompt and the outputs kept so far
    restarts = [n for n in engine.chunks_of(second) if n > 1]
    assert len(restarts) == 1 + second.num_preemptions
    assert restarts[-1] > second.num_prompt_tokens
    engine.check_all_done([first, second])


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_sequence_cap_and_token_budget_hold_under_load(name):
    engine = FakeEngine(name, max_num_seqs=3, max_num_batched_tokens=10, num_blocks=40)
    seqs = [make_seq(i, prompt_len=3 + 5 * i, max_tokens=4 + i) for i in range(8)]
    for seq in seqs:
        engine.add(seq)
    engine.run()
    assert max(len(out.chunks) for out in engine.outputs) == 3
    assert max(out.num_tokens for out in engine.outputs) == 10
    engine.check_all_done(seqs)


def test_fcfs_admits_in_arrival_order():
    engine = FakeEngine("fcfs", max_num_seqs=1)
    arrivals = {0: 3.0, 1: 1.0, 2: 2.0, 3: 0.5}
    seqs = [make_seq(i, 5, 2, priority=-i, arrival=t) for i, t in arrivals.items()]
    for seq in seqs:  # added out of arrival order; priority is ignored
        engine.add(seq)
    engine.run()
    assert [s.seq_id for s in engine.admissions] == [3, 1, 2, 0]
    assert [s.seq_id for s in engine.finished] == [3, 1, 2, 0]
    engine.check_all_done(seqs)


def test_priority_admits_lower_values_first_then_by_arrival():
    engine = FakeEngine("priority", max_num_seqs=1)
    priorities = [5, 1, 3, 1, 0]
    seqs = [make_seq(i, 5, 2, priority=p) for i, p in enumerate(priorities)]
    for seq in seqs:
        engine.add(seq)
    engine.run()
    assert [s.seq_id for s in engine.admissions] == [4, 1, 3, 2, 0]
    engine.check_all_done(seqs)


@pytest.mark.parametrize("name, victim", [("priority", 0), ("fcfs", 2)])
def test_preemption_takes_the_highest_order_key(name, victim):
    # three one-block prompts fill 3 of 4 blocks; the first decode of each needs a
    # second block, so the third one to ask must take the block of a victim
    engine = FakeEngine(name, num_blocks=4, block_size=4)
    seqs = [
        make_seq(0, 4, 8, priority=9, arrival=0.0),
        make_seq(1, 4, 8, priority=0, arrival=1.0),
        make_seq(2, 4, 8, priority=5, arrival=2.0),
    ]
    for seq in seqs:
        engine.add(seq)
    engine.step()
    out = engine.step()
    assert [s.seq_id for s in out.preempted] == [victim]
    assert victim not in [c.seq.seq_id for c in out.chunks]
    engine.run()
    engine.check_all_done(seqs)


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_queue_full_rejects_until_the_queue_drains(name):
    engine = FakeEngine(name, max_waiting_requests=2, max_num_seqs=1)
    engine.add(make_seq(0, 4, 2))
    engine.add(make_seq(1, 4, 2))
    with pytest.raises(QueueFullError, match=r"max_waiting_requests = 2"):
        engine.scheduler.add(make_seq(2, 4, 2))
    assert engine.scheduler.num_waiting == 2
    engine.step()  # admits one
    engine.add(make_seq(3, 4, 2))
    engine.run()
    assert len(engine.finished) == 3
    engine.check_all_done(engine.finished)


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_finishing_waiting_and_running_sequences_frees_their_blocks(name):
    engine = FakeEngine(name, max_num_seqs=1)
    running, waiting = make_seq(0, 9, 5), make_seq(1, 9, 5)
    engine.add(running)
    engine.add(waiting)
    engine.step()
    assert engine.scheduler.num_running == 1 and engine.scheduler.num_waiting == 1
    assert engine.pool.num_used_blocks == 3
    for seq in (waiting, running):
        engine.scheduler.finish(seq)
    assert not engine.scheduler.has_unfinished
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_integrity()
    assert not engine.scheduler.schedule().chunks


# ---------------------------------------------------------------------------
# Random workloads
# ---------------------------------------------------------------------------


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 8))
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(1, 60),  # prompt length
                st.integers(1, 12),  # max_tokens
                st.integers(0, 3),  # priority
                st.integers(0, 12),  # step at which it arrives
            ),
            min_size=1,
            max_size=8,
        )
    )
    largest = max(-(-(p + m) // block_size) for p, m, _, _ in requests)
    return {
        "name": draw(st.sampled_from(SCHEDULER_NAMES)),
        "block_size": block_size,
        "num_blocks": largest + draw(st.integers(0, 12)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_num_batched_tokens": draw(st.integers(1, 48)),
        "decode_steps_between_prefills": draw(st.integers(0, 2)),
        "requests": requests,
    }


@settings(max_examples=400, deadline=None)
@given(workloads())
def test_random_workloads_keep_invariants_and_terminate(w):
    engine = FakeEngine(
        w["name"],
        num_blocks=w["num_blocks"],
        block_size=w["block_size"],
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["max_num_batched_tokens"],
        decode_steps_between_prefills=w["decode_steps_between_prefills"],
    )
    arrivals = sorted(enumerate(w["requests"]), key=lambda r: r[1][3])
    seqs = []
    total_tokens = sum(p + m for p, m, _, _ in w["requests"])
    max_steps = 12 + 4 * total_tokens * len(w["requests"])
    for step in itertools.count():
        while arrivals and arrivals[0][1][3] <= step:
            i, (prompt, max_tokens, priority, _) = arrivals.pop(0)
            seq = make_seq(i, prompt, max_tokens, priority=priority, arrival=float(len(seqs)))
            engine.add(seq)
            seqs.append(seq)
        if not arrivals and not engine.scheduler.has_unfinished:
            break
        assert step < max_steps, "no termination"
        engine.step()
    engine.check_all_done(seqs)
