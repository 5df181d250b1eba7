"""The model runner: one forward over a scheduled batch, then tokens: sampling, draft verification, next drafts.

    SchedulerOutput ─► backend.forward(chunks) ─► logits
                                                   ├─ prompt rows ─► score_tokens (prompt logprobs, raw)
                                                   ├─ plain chunks ─► Sampler (penalties, greedy/filtered draws)
                                                   ├─ chunks with drafts ─► verify (keep the longest valid run + 1)
                                                   └─ chunks with token trees ─► verify_tree (keep the longest
                                                      accepted path + 1; its KV moves to consecutive slots)
                        speculating sequences ─► speculator.propose ─► drafts (or trees) for the next step
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import structlog

from tierserve.core.batch import RunnerOutput, ScheduledChunk, SchedulerOutput
from tierserve.core.sampler import SampledToken, Sampler, SamplingRow, score_tokens
from tierserve.core.speculation import DraftRequest, Proposal, SpeculationStats, Speculator, verify
from tierserve.core.token_tree import ROOT, check_tree, tree_children, tree_depths, verify_tree, within_depth

log = structlog.get_logger(__name__)
T = TypeVar("T")

if TYPE_CHECKING:
    import torch

    from tierserve.core.backend import ModelBackend
    from tierserve.core.outputs import TokenLogprob
    from tierserve.engine.profiling import PhaseClock
    from tierserve.core.grammar import GrammarRuntime
    from tierserve.core.sequence import Sequence


def sampling_row(seq: Sequence, eos_token_ids: frozenset[int] = frozenset(), ahead: int = 0) -> SamplingRow:
    """What the sampler needs to pick a sequence's token ``ahead`` positions past its next one: its history
    only when penalties read it, and eos (unless ``ignore_eos``) and stop ids banned before ``min_tokens``."""
    params = seq.params
    suppressed: frozenset[int] = frozenset()
    if seq.num_output_tokens + ahead < params.min_tokens:
        stops = frozenset(params.stop_token_ids)
        suppressed = stops if params.ignore_eos else stops | eos_token_ids
    if params.has_penalties:
        return SamplingRow(params, seq.generator, seq.prompt_token_ids, seq.output_token_ids, suppressed)
    return SamplingRow(params, seq.generator, [], [], suppressed)


class ModelRunner:
    """Runs batches on one backend; owns the sampler and the speculators.

    Args:
        backend: the model.
        speculators: by name, what proposes drafts for sequences whose
            ``spec_method`` names it (the configured method, and the fallback a
            request may ask for).
        max_draft_tokens: the most drafts per step (``speculative.num_speculative_tokens``).
        adaptive: shrink a sequence's draft count after rejections, grow it after full acceptance.
        max_tree_nodes: the most nodes of one sequence's token tree (tree speculators).
        step_tree_nodes: the tree nodes of one step, shared among the sequences it drafts trees for: a big
            batch gets smaller trees, as its step is bound by compute rather than by reading the weights.
        clock: times the ``forward`` and ``sample`` phases (``[monitoring] detailed_profiling``), or ``None``.
    """

    def __init__(
        self,
        backend: ModelBackend,
        speculators: dict[str, Speculator] | None = None,
        *,
        max_draft_tokens: int = 4,
        adaptive: bool = True,
        max_tree_nodes: int = 16,
        step_tree_nodes: int = 64,
        clock: PhaseClock | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = frozenset(backend.eos_token_ids)
        self.speculators = dict(speculators or {})
        self.sampler = Sampler()
        self.spec_stats = SpeculationStats()
        self.max_draft_tokens = max_draft_tokens
        self.adaptive = adaptive
        self.max_tree_nodes = max_tree_nodes
        self.step_tree_nodes = step_tree_nodes
        self.clock = clock
        self._grammar: GrammarRuntime | None = None
        self._warned: set[str] = set()  # speculators whose bad proposals were logged

    @property
    def grammar(self) -> GrammarRuntime:
        """Token masks for constrained sequences (built on the first request that needs them)."""
        if self._grammar is None:
            from tierserve.core.grammar import GrammarRuntime

            backend = self.backend
            self._grammar = GrammarRuntime(backend.tokenizer, backend.vocab_size, self.eos_token_ids)
        return self._grammar

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Compute every chunk's KV and the tokens of every chunk that samples."""
        output = RunnerOutput()
        if batch.is_empty:
            return output
        clock = self.clock
        if clock is not None:
            started = time.perf_counter()
        logits = self.backend.forward(batch.chunks)
        if clock is not None:
            if logits.is_cuda:  # kernels run asynchronously: wait for them, or sampling gets the bill
                import torch

                torch.cuda.synchronize(logits.device)
            forwarded = time.perf_counter()
            clock.observe("forward", forwarded - started)
        plain: list[tuple[ScheduledChunk, int]] = []  # (chunk, its logits row)
        speculative: list[tuple[ScheduledChunk, int]] = []
        row = 0
        for chunk in batch.chunks:
            scored = chunk.num_prompt_logits
            if scored:
                output.prompt_logprobs[chunk.seq.seq_id] = self._score_prompt(chunk, logits[row : row + scored])
            # a request with max_tokens 0 scores its prompt only: its last row is computed, nothing is sampled
            if chunk.num_logits > scored and chunk.seq.params.max_tokens:
                (speculative if chunk.num_draft else plain).append((chunk, row + scored))
            row += chunk.num_logits
        if plain:
            rows_of = [sampling_row(chunk.seq, self.eos_token_ids) for chunk, _ in plain]
            picked = logits if len(plain) == logits.shape[0] else logits[[r for _, r in plain]]
            constrained = [i for i, (chunk, _) in enumerate(plain) if chunk.seq.grammar is not None]
            if constrained:
                picked = self._masked(picked, constrained, [plain[i][0].seq.grammar for i in constrained])
            for (chunk, _), sampled in zip(plain, self.sampler(picked, rows_of)):
                output.sampled[chunk.seq.seq_id] = [sampled]
                if chunk.seq.grammar is not None:
                    chunk.seq.grammar.consume_token(sampled.token_id)
                    self._check_grammar(chunk.seq, output)
        hidden_rows: dict[int, int] = {}  # seq_id -> the logits row that produced its newest token
        for chunk, first in speculative:
            rows = logits[first : first + chunk.num_draft + 1]
            if chunk.tree_parents is not None:
                output.sampled[chunk.seq.seq_id], last = self._verify_tree(chunk, rows)
            else:
                output.sampled[chunk.seq.seq_id] = self._verify(chunk, rows)
                last = len(output.sampled[chunk.seq.seq_id]) - 1
            hidden_rows[chunk.seq.seq_id] = first + last
            if chunk.seq.grammar is not None:
                self._check_grammar(chunk.seq, output)
        if self.speculators:
            for chunk, row in plain:
                hidden_rows[chunk.seq.seq_id] = row
            self._propose(batch.chunks, output, hidden_rows)
        if clock is not None:
            clock.observe("sample", time.perf_counter() - forwarded)
        return output

    @staticmethod
    def _score_prompt(chunk: ScheduledChunk, rows: torch.Tensor) -> list[TokenLogprob]:
        """The prompt tokens that ``rows`` (the logits at ``chunk.prompt_logit_positions``) predict, scored."""
        positions = chunk.prompt_logit_positions
        targets = chunk.seq.token_ids[positions.start + 1 : positions.stop + 1]
        return score_tokens(rows, targets, chunk.seq.params.prompt_logprobs)

    @staticmethod
    def _check_grammar(seq: Sequence, output: RunnerOutput) -> None:
        """A matcher in error (llguidance gave up: too many parser items for a schema of thousands of
        alternatives, or a self-referencing one) would only allow the end of the output, and the client would
        get text that breaks its schema: the request ends with an error naming the field instead."""
        matcher = seq.grammar
        if matcher.is_error():
            param = seq.params.grammar.param
            why = matcher.get_error().split("; consider")[0].split("; try")[0]
            output.failed[seq.seq_id] = (param, f"{param}: the output could not follow this schema past token "
                                         f"{seq.num_tokens - seq.num_prompt_tokens + 1} ({why}); use a smaller or "
                                         "non-recursive schema")  # fmt: skip

    def _masked(self, logits: torch.Tensor, rows: list[int], matchers: list) -> torch.Tensor:
        """A copy of ``logits`` with each of ``rows`` limited to what its grammar matcher allows next."""
        logits = logits.clone()
        block = logits[rows]
        self.grammar.apply(block, self.grammar.masks(matchers))
        logits[rows] = block
        return logits

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor) -> list[SampledToken]:
        seq = chunk.seq
        k = chunk.num_draft
        drafted = seq.spec_proposal
        probs = drafted.probs[:k] if drafted is not None and drafted.probs is not None else None
        drafts = seq.spec_token_ids[:k]
        matcher = seq.grammar
        valid = used = k
        if matcher is not None:
            # the first draft the grammar refuses is verified against its masked row (probability 0: rejected,
            # and a sampled replacement comes from the residual, so sampling stays exact); none after it is
            logits, valid = self._grammar_rows(matcher, drafts, logits)
            used = min(k, valid + 1)
        proposal = Proposal(drafts[:used], probs[:used] if probs is not None else None)
        rows = [sampling_row(seq, self.eos_token_ids, ahead) for ahead in range(used + 1)]
        emitted = verify(logits[: used + 1], proposal, rows, seq.params.greedy)
        accepted = len(emitted) - 1
        if matcher is not None:  # keep the accepted drafts, then the target's own token
            matcher.rollback(valid - accepted)
            matcher.consume_token(emitted[-1])
        stats = self.spec_stats
        stats.verifications += 1
        stats.proposed += k
        stats.depth += k
        stats.accepted += accepted
        stats.emitted += len(emitted)
        if self.adaptive:
            seq.spec_k = min(self.max_draft_tokens, seq.spec_k + 1) if accepted == k else max(1, accepted)
        return [SampledToken(token, None, None) for token in emitted]

    def _verify_tree(self, chunk: ScheduledChunk, logits: torch.Tensor) -> tuple[list[SampledToken], int]:
        """Tokens of a token tree's longest accepted path plus the target's own; the path's KV is moved to the
        slots right after the real tokens. Returns the tokens and the logits row of the path's last node."""
        seq = chunk.seq
        parents = chunk.tree_parents
        nodes = seq.spec_token_ids[: chunk.num_draft]
        depths = tree_depths(parents)
        rows = [sampling_row(seq, self.eos_token_ids, ahead) for ahead in (0, *depths)]
        emitted, path = verify_tree(logits, nodes, parents, rows, seq.params.greedy)
        base = chunk.start + chunk.num_real_tokens  # the slot of node 0, and where the path's KV must lie
        moves = [(base + node, base + depth) for depth, node in enumerate(path) if node != depth]
        if moves:
            self.backend.move_kv(seq.block_table, [m[0] for m in moves], [m[1] for m in moves])
        stats = self.spec_stats
        stats.verifications += 1
        stats.tree_verifications += 1
        stats.proposed += len(nodes)
        stats.tree_nodes += len(nodes)
        stats.depth += max(depths)
        stats.accepted += len(path)
        stats.emitted += len(emitted)
        return [SampledToken(token, None, None) for token in emitted], (path[-1] + 1 if path else 0)

    def _grammar_rows(self, matcher, drafts: list[int], logits: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Mask each verification row with the grammar's state after the drafts before it, up to the row of
        the first refused draft. Returns the rows (the one after a refused draft stays unmasked: it is never
        reached) and how many leading drafts the grammar allows; the matcher ends after those drafts."""
        valid = 0
        matchers_masks = []
        for draft in [*drafts, None]:
            matchers_masks.append(self.grammar.masks([matcher])[0])
            if draft is None or not matchers_masks[-1][draft] or not matcher.consume_token(draft):
                break
            valid += 1
        import torch

        logits = logits[: min(len(drafts), valid + 1) + 1].clone()
        self.grammar.apply(logits[: valid + 1], torch.stack(matchers_masks))  # a view: masked in place
        return logits, valid

    def _propose(self, chunks: list[ScheduledChunk], output: RunnerOutput, hidden_rows: dict[int, int]) -> None:
        """Drafts (or token trees) for the next step of every speculating sequence this step sampled for."""
        by_method: dict[str, list[tuple[Sequence, list[int], int]]] = {}
        limit = self.backend.max_model_len
        for chunk in chunks:
            seq = chunk.seq
            sampled = output.sampled.get(seq.seq_id)
            if seq.spec_method is None or sampled is None:
                continue
            history = seq.token_ids + [s.token_id for s in sampled]
            generated = len(history) - seq.num_prompt_tokens
            room = min(seq.params.max_tokens - generated - 1, limit - len(history) - 1)
            if room > 0:
                by_method.setdefault(seq.spec_method, []).append((seq, history, room))
        trees = sum(len(asked) for method, asked in by_method.items() if self.speculators[method].proposes_trees)
        nodes = min(self.max_tree_nodes, max(1, self.step_tree_nodes // trees)) if trees else 0
        hidden = self.backend.last_hidden_states
        for method, asked in by_method.items():
            speculator = self.speculators[method]
            requests = []
            for seq, history, room in asked:
                budget = nodes if speculator.proposes_trees else min(seq.spec_k, room)
                state = hidden[hidden_rows[seq.seq_id]] if speculator.needs_hidden_states else None
                requests.append(DraftRequest(seq, history, budget, room, state))
            proposals = self._contained(method, "propose", lambda: speculator.propose(requests), None)
            if proposals is None:  # it raised: these requests decode on without drafts
                for request in requests:
                    request.seq.spec_method = None
                continue
            for request, proposal in zip(requests, proposals):
                if not proposal.token_ids or not self._well_formed(method, proposal):
                    continue
                if proposal.parents is None and len(proposal.token_ids) > request.max_depth:
                    proposal = Proposal(proposal.token_ids[: request.max_depth],
                                        proposal.probs[: request.max_depth] if proposal.probs is not None else None)  # fmt: skip
                if proposal.parents is not None:
                    if not self.backend.supports_token_trees:
                        proposal = first_branch(proposal)
                    if max(tree_depths(proposal.parents)) > request.max_depth:  # past max_tokens or the context
                        tokens, parents = within_depth(proposal.token_ids, proposal.parents, request.max_depth)
                        proposal = Proposal(tokens, parents=parents)
                    if len(proposal.token_ids) > request.num_tokens:  # over the node budget: the first nodes
                        keep = request.num_tokens
                        proposal = Proposal(proposal.token_ids[:keep], parents=proposal.parents[:keep])
                    if request.seq.grammar is not None:  # the grammar checks one run of drafts: keep the first
                        proposal = first_branch(proposal)
                output.proposals[request.seq.seq_id] = proposal

    def _well_formed(self, method: str, proposal: Proposal) -> bool:
        """Whether a speculator's proposal can be verified: tokens in the vocabulary, a tree laid out as
        ``core/token_tree.py`` says. A bad one is dropped (logged once per speculator), so one plugin's bug
        costs that sequence its drafts for the step, not every request in the batch."""
        problem = None
        if min(proposal.token_ids) < 0 or max(proposal.token_ids) >= self.backend.vocab_size:
            problem = f"a draft token outside the vocabulary [0, {self.backend.vocab_size})"
        elif proposal.parents is not None:
            try:
                check_tree(proposal.token_ids, proposal.parents)
            except ValueError as error:
                problem = str(error)
        if problem is None:
            return True
        if method not in self._warned:
            self._warned.add(method)
            log.warning("speculator_proposal_dropped", speculator=method, problem=problem, logged="once per speculator")
        return False

    def release(self, seq: Sequence) -> None:
        """Forget what the backend and the speculator keep for a sequence (finished or preempted)."""
        self.backend.release(seq)
        for method, speculator in self.speculators.items():
            self._contained(method, "release", lambda speculator=speculator: speculator.release(seq), None)

    def _contained(self, method: str, call: str, run: Callable[[], T], fallback: T) -> T:
        """``run()`` (a call into a speculator plugin), or ``fallback`` when it raises: logged with the plugin
        and the traceback and counted (``speculation.errors``); the request it was for decodes on without it."""
        try:
            return run()
        except Exception:  # noqa: BLE001 - a plugin may raise anything; containing it is the point
            self.spec_stats.errors += 1
            log.exception("speculator_failed", speculator=method, call=call, errors=self.spec_stats.errors,
                          action="the requests it drafted for decode on without speculation")  # fmt: skip
            return fallback

    def close(self) -> None:
        for speculator in self.speculators.values():
            speculator.close()
        self.backend.close()


def first_branch(tree: Proposal) -> Proposal:
    """The tree's first path (the root's first child, then each node's first child) as a linear proposal."""
    children = tree_children(tree.parents)
    path: list[int] = []
    node = ROOT
    while children[node + 1]:
        node = children[node + 1][0]
        path.append(node)
    return Proposal([tree.token_ids[i] for i in path])
