"""``check_speculator``: the rules every speculator keeps, run over a speculator class in a real engine.

The rules are those ``tierserve.core.speculation`` states. The speculator
is registered as ``under_test`` through ``register_speculators`` and
proposes drafts for an engine on ``builtin:tiny``; every proposal is checked
as it is made, and the output must equal decoding without speculation
(drafts change how many forwards run, never which tokens come out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tierserve.core.sampling_params import SamplingParams
from tierserve.core.speculation import DraftRequest, Proposal, Speculator
from tierserve.testing.harness import component_plugin, plugin_manager, tiny_engine
from tierserve.testing.rules import RuleBroken, rule

if TYPE_CHECKING:
    from pydantic import BaseModel

NAME = "under_test"
PROMPTS = [
    "the cat sat on the mat and the cat sat on the mat and the cat",
    "1 2 3 1 2 3 1 2 3 1 2",
    "once upon a time",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def check_speculator(
    speculator: type[Speculator],
    *,
    settings_model: type[BaseModel] | None = None,
    options: Mapping[str, Any] | None = None,
    num_speculative_tokens: int = 4,
) -> list[str]:
    """Run every speculator rule over ``speculator`` (the class, or the factory registered for it).

    Args:
        speculator: called as the engine calls it: ``speculator(settings, target_backend)``.
        settings_model: the pydantic model it registers as ``settings=``, if any.
        options: its ``[plugins.under_test]`` table.
        num_speculative_tokens: drafts asked for per step (``[speculative] num_speculative_tokens``).

    Returns:
        The names of the rules checked (all passed).

    Raises:
        RuleBroken: (an ``AssertionError``) the first rule broken, with what happened.
    """
    metadata = {"settings": settings_model} if settings_model is not None else {}
    plugins = plugin_manager(component_plugin("speculators", NAME, speculator, **metadata))
    settings = {f"plugins.{NAME}.{key}": value for key, value in (options or {}).items()}
    speculative = {**settings, "speculative.method": NAME, "speculative.num_speculative_tokens": num_speculative_tokens}
    with tiny_engine({}, plugins) as engine:
        reference = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        vocab_size = engine.info.vocab_size
    checked = []
    with rule(_proposals_are_well_formed, speculator), tiny_engine(speculative, plugins) as engine:
        _proposals_are_well_formed(engine, vocab_size, reference)
    checked.append("proposals_are_well_formed")
    checked.append("outputs_equal_decoding_without_drafts")
    return checked


def check_proposal(request: DraftRequest, proposal: Proposal, vocab_size: int, trees: bool) -> str | None:
    """What is wrong with one proposal, or None."""
    tokens = proposal.token_ids
    if len(tokens) > request.num_tokens:
        return f"{len(tokens)} drafts proposed, {request.num_tokens} asked for at most"
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in tokens):
        return f"a draft token outside the vocabulary [0, {vocab_size}): {tokens}"
    if proposal.probs is not None and tuple(proposal.probs.shape) != (len(tokens), vocab_size):
        return f"probs of shape {tuple(proposal.probs.shape)}, not ({len(tokens)}, {vocab_size})"
    if proposal.parents is not None:
        if not trees:
            return "a token tree (parents) from a speculator without proposes_trees = True"
        if len(proposal.parents) != len(tokens) or any(not -1 <= p < i for i, p in enumerate(proposal.parents)):
            return f"parents {proposal.parents}: each must be -1 or an earlier node"
        depth = [0] * len(tokens)
        for i, parent in enumerate(proposal.parents):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        if depth and max(depth) > request.max_depth:
            return f"a path {max(depth)} deep, max_depth {request.max_depth}"
    return None


def _proposals_are_well_formed(engine: Any, vocab_size: int, reference: list[list[int]]) -> None:
    """``propose`` returns one ``Proposal`` per request: at most ``num_tokens`` drafts, in the vocabulary, ``probs``
    of shape (drafts, vocab) or None, trees only with ``proposes_trees``; and greedy output equals decoding without drafts."""
    runner = engine.driver.core.runner
    [speculator] = [s for name, s in runner.speculators.items() if name == NAME]
    propose = speculator.propose
    asked, problems = [0], []  # the runner contains a speculator's exceptions: what is wrong is kept here

    def checked_propose(requests: list[DraftRequest]) -> list[Proposal]:
        try:
            proposals = propose(requests)
        except Exception as exc:
            problems.append(f"propose() raised {type(exc).__name__}: {exc}")
            raise
        asked[0] += len(requests)
        if not isinstance(proposals, list) or len(proposals) != len(requests):
            problems.append(f"propose() of {len(requests)} requests returned {proposals!r}")
            return proposals
        for request, proposal in zip(requests, proposals):
            if not isinstance(proposal, Proposal):
                problems.append(f"propose() returned {proposal!r}, not a tierserve.core.speculation.Proposal")
            elif problem := check_proposal(request, proposal, vocab_size, speculator.proposes_trees):
                problems.append(problem)
        return proposals

    speculator.propose = checked_propose
    outputs = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    if problems:
        raise RuleBroken(problems[0])
    if not asked[0]:
        raise RuleBroken("the engine never asked the speculator for drafts")
    for index, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        if got != want:
            raise RuleBroken(f"prompt {index}: tokens {got} with drafts, {want} without")
    engine.check_integrity()
