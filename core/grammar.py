"""Constrained decoding: a request's output format as a grammar, and its token masks, by llguidance.

A ``GrammarSpec`` is what a request asks for (a JSON schema, any JSON object,
a regex, a choice of strings, or a Lark/GBNF grammar); it travels to the engine
core inside ``SamplingParams``. There, each sequence gets its own matcher. Every
step fills one token bitmask per constrained row, for the whole batch at once
(llguidance's executor, on its own threads), and the sampler only ever sees
allowed tokens. Accepted tokens advance the matcher, drafts included: a draft
the grammar refuses is a rejected draft, so speculation stays lossless.

llguidance was chosen over xgrammar by measuring the per-token mask cost on
this CPU (``python -m bench grammar``): about the same on a 2k vocabulary,
several times lower on a 150k one, with no compile step to speak of and no
dependencies (xgrammar pulls in triton).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierserve.core.errors import RequestError

if TYPE_CHECKING:
    import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
INSTALL_HINT = "constrained decoding needs llguidance: pip install 'tierserve[structured]'"
# compact JSON: a fixed separator between items and keys, so the model cannot pad with whitespace forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TEMPLATES = 64  # compiled grammars a GrammarRuntime keeps (each sequence gets a copy)


def _llguidance():
    try:
        import llguidance
    except ImportError:  # an optional extra: a request that needs it is a clear 400
        raise RequestError(INSTALL_HINT, param="response_format", code="unsupported") from None
    return llguidance


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must match. ``param`` names the request field it came from (for errors).

    ``source``: the schema as JSON text (``json_schema``), ``""`` (``json_object``), the regex,
    the choices as a JSON list (``choice``), or the Lark or GBNF grammar text (``grammar``).
    """

    kind: str
    source: str
    param: str = "response_format"

    def to_llguidance(self) -> str:
        """The llguidance grammar; ``RequestError`` (naming ``param``) when it cannot be built."""
        llg = _llguidance()
        matcher = llg.LLMatcher
        if self.kind == "json_schema":
            try:
                return matcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            except ValueError as exc:
                raise RequestError(f"{self.param}: {exc}", param=self.param) from None
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = json.loads(self.source)
            return matcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in choices))
        if self.kind == "grammar":
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                return matcher.grammar_from_lark(any_to_lark(self.source))
            except Exception as exc:  # the GBNF converter raises plain errors naming the position
                raise RequestError(f"{self.param}: not a Lark or GBNF grammar: {exc}", param=self.param) from None
        raise ValueError(f"unknown grammar kind {self.kind!r}; known: {', '.join(KINDS)}")

    def check(self) -> None:
        """Raise ``RequestError`` naming ``param`` unless the grammar compiles (no tokenizer needed)."""
        grammar = self.to_llguidance()
        error = _llguidance().LLMatcher.validate_grammar(grammar)
        if error:
            raise RequestError(f"{self.param}: {error}", param=self.param)


def spec_from_schema(schema: Any, param: str) -> GrammarSpec:
    """A JSON-schema spec; ``RequestError`` for a schema that is not a JSON object."""
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param)
    return GrammarSpec("json_schema", json.dumps(schema), param)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's int32 bitmask ``[rows, ceil(vocab/32)]`` as booleans ``[rows, vocab_size]`` (True: allowed)."""
    import torch

    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class GrammarRuntime:
    """The core's side: the tokenizer as llguidance sees it, a matcher per sequence, batched masks.

    Args:
        tokenizer: the checkpoint's (fast) Hugging Face tokenizer.
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the ids that end a sequence (the grammar allows them once it is complete).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        import llguidance.hf

        self._llg = _llguidance()
        eos = sorted(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.executor = self._llg.LLExecutor()
        self._templates: OrderedDict[tuple[str, str], Any] = OrderedDict()  # compiled grammars, fresh matchers
        self.compiled = 0  # grammars compiled (the rest were copies of a template)

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh matcher for one sequence; ``RequestError`` when the grammar does not fit this tokenizer.

        A grammar is compiled once and each sequence gets a copy of that matcher: a request with ``n = 16`` and a
        schema of hundreds of fields compiled it 16 times on the step thread (0.64 s against 0.05 s measured
        for 300 fields), stalling every other request meanwhile. The last ``TEMPLATES`` grammars are kept."""
        key = (spec.kind, spec.source)
        template = self._templates.get(key)
        if template is None:
            template = self._llg.LLMatcher(self.tokenizer, spec.to_llguidance())
            if template.is_error():
                raise RequestError(f"{spec.param}: {template.get_error()}", param=spec.param)
            self.compiled += 1
            self._templates[key] = template
            while len(self._templates) > TEMPLATES:
                self._templates.popitem(last=False)
        self._templates.move_to_end(key)
        return template.deep_copy()

    def masks(self, matchers: list[Any]) -> torch.Tensor:
        """Boolean ``[len(matchers), vocab_size]``: the tokens each matcher allows next, computed in parallel."""
        import llguidance.torch

        bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), self.vocab_size)
        llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return unpack_bitmask(bitmask, self.vocab_size)

    @staticmethod
    def apply(logits: torch.Tensor, allowed: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place (rows of ``logits`` match ``allowed``)."""
        width = min(logits.shape[-1], allowed.shape[-1])
        logits[:, :width].masked_fill_(~allowed[:, :width].to(logits.device), float("-inf"))
        if logits.shape[-1] > width:
            logits[:, width:] = float("-inf")
