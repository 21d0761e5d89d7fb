"""Answers in a shape: a request's `structured_outputs` compiled to a grammar, and one matcher per sequence.

Lesson: lessons/18-answers-in-a-shape.md.

llguidance (the `structured` extra, imported here and only when a constrained request arrives) turns a JSON
schema, a regular expression, a list of choices or a Lark grammar into a grammar over the tokenizer's bytes, and a
matcher walks it token by token. At each sampled row the matcher's bitmask says which vocabulary entries keep the
answer inside the grammar; the sampler sets the others to -inf (`GrammarMatcher.mask`), greedy and sampled alike, before the
penalties and filters, as vLLM applies its bitmask to the logits before its sampler (so `logprobs` are those of the
masked distribution). EOS is in the mask only where the grammar accepts; once the grammar can take nothing more the
request stops with finish reason "stop" (`advance`). JSON answers are laid out as json.dumps writes them (no free
whitespace, unlike llguidance's and vLLM's default): the trained demo model, free to, filled 40 tokens with blanks.

The matcher lives on the request and advances only on committed tokens: a chunked prefill samples nothing until
its last chunk, a preempted request keeps its matcher (its recompute re-reads tokens the matcher already took,
and samples only the next one), and each completion of n > 1 has its own. Speculative proposals are walked
through the matcher to mask each verification row, then rolled back; a proposal the grammar refuses gets
probability zero at its row, which ends the accepted run there.

A constraint is compiled once per engine (`GrammarCompiler`, cached by its text) and checked against the
tokenizer when the request is added, before any compute: a bad schema or regex is an InvalidInputError.
"""

from __future__ import annotations

import json

import torch

from nanomm.errors import InvalidInputError
from nanomm.structured_params import StructuredOutputsParams

EXTRA_HINT = "structured outputs need llguidance: pip install nanomm[structured]"
MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex, grammar or choice list larger than this is refused
MAX_CACHED_GRAMMARS = 256
# llguidance's names for our kinds (grammar_from's formats)
FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
           "grammar": "lark"}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise InvalidInputError(EXTRA_HINT) from None
    return llguidance


def compiler_of(engine) -> "GrammarCompiler":
    """The engine's grammar compiler, made by its first constrained request."""
    if engine.grammars is None:
        engine.grammars = GrammarCompiler(engine.tokenizer, engine.model.config.text.vocab_size)
    return engine.grammars


class GrammarCompiler:
    """An engine's constraints -> llguidance grammars, compiled and checked once each, and matchers over them."""

    def __init__(self, tokenizer, model_vocab_size: int):
        self.tokenizer, self.model_vocab_size = tokenizer, model_vocab_size
        self._lltokenizer = None  # built on the first constrained request (about a second for a real vocabulary)
        self._grammars: dict[tuple[str, str], str] = {}

    @property
    def lltokenizer(self):
        if self._lltokenizer is None:
            llguidance = _llguidance()
            self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.tokenizer.to_str(),
                                                       n_vocab=self.tokenizer.vocab_size,
                                                       eos_token=list(self.tokenizer.eos_token_ids))
        return self._lltokenizer

    def compile(self, constraint: StructuredOutputsParams) -> str:
        """The grammar of a constraint, from the cache or compiled and checked; InvalidInputError naming the
        problem."""
        key = constraint.key()
        if key not in self._grammars:
            if len(self._grammars) >= MAX_CACHED_GRAMMARS:
                self._grammars.pop(next(iter(self._grammars)))  # the oldest
            self._grammars[key] = self._compile(*key)
        return self._grammars[key]

    def _compile(self, kind: str, text: str) -> str:
        llguidance = _llguidance()
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise InvalidInputError(f"structured_outputs.{kind} is {len(text):,} characters; at most "
                                    f"{MAX_CONSTRAINT_CHARS:,} are accepted")
        if kind == "json_object":
            text = compact_json_schema('{"type": "object"}')
        elif kind == "json":
            text = compact_json_schema(text)
        try:
            grammar = llguidance.grammar_from(FORMATS[kind], text)
        except (ValueError, TypeError) as exc:
            raise InvalidInputError(f"structured_outputs.{kind} does not compile: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if error:
            raise InvalidInputError(f"structured_outputs.{kind} does not compile: {error.strip()}")
        return grammar

    def matcher(self, constraint: StructuredOutputsParams) -> "GrammarMatcher":
        """A fresh matcher for one sequence (each completion of n > 1 gets its own)."""
        matcher = _llguidance().LLMatcher(self.lltokenizer, self.compile(constraint), log_level=0)
        if matcher.is_error():  # checked at compile time: only a resource limit could land here
            raise InvalidInputError(f"structured_outputs: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.model_vocab_size)


# JSON as json.dumps writes it, and as Qwen's templates write tool calls: one space after ":" and ",", no other blank
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def compact_json_schema(text: str) -> str:
    """The schema with llguidance's layout fixed (JSON_LAYOUT, in its "x-guidance") unless it sets its own
    x-guidance: no free whitespace, so a small model cannot spend its max_tokens on blanks."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidInputError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": JSON_LAYOUT}
    return json.dumps(schema)


class GrammarMatcher:
    """One sequence's place in its grammar: the tokens it may sample next, and the tokens it committed."""

    def __init__(self, matcher, model_vocab_size: int):
        self.matcher, self.model_vocab_size = matcher, model_vocab_size

    def allowed(self) -> torch.Tensor:
        """(model vocab,) bool: the entries that keep the answer in the grammar now. Rows of the model's vocabulary
        past the tokenizer's are never allowed. llguidance's bitmask holds token i at bit i % 8 of byte i // 8."""
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        bits = ((packed[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().flatten()
        allowed = torch.zeros(self.model_vocab_size, dtype=torch.bool)
        n = min(self.model_vocab_size, bits.numel())
        allowed[:n] = bits[:n]
        return allowed

    def allowed_along(self, proposed: list[int]) -> torch.Tensor:
        """(1 + len(proposed), model vocab) bool: the mask at each verification row, row i after the first i
        proposals. The walk stops at the first proposal the grammar refuses (its row refuses it, which ends the
        accepted run there; the rows after it are never read and repeat that row's mask); then rolled back."""
        rows, consumed = [self.allowed()], 0
        for token in proposed:
            if not rows[-1][token] or not self.matcher.consume_token(token):
                break
            consumed += 1
            rows.append(self.allowed())
        if consumed:
            self.matcher.rollback(consumed)
        rows += [rows[-1]] * (1 + len(proposed) - len(rows))
        return torch.stack(rows)

    def mask(self, logits: torch.Tensor, proposed: list[int]) -> torch.Tensor:
        """A step's verification rows (1 + len(proposed), vocab) with the disallowed entries at -inf; new."""
        return logits.masked_fill(~self.allowed_along(proposed).to(logits.device), float("-inf"))

    def advance(self, token_ids: list[int]) -> tuple[list[int], bool]:
        """Take committed tokens; returns those that stand (none after the one that completes the grammar) and
        whether the grammar is complete (can take nothing but EOS)."""
        for i, token in enumerate(token_ids):
            if self.matcher.is_stopped():
                return token_ids[:i], True
            self.matcher.consume_token(token)
        return token_ids, self.matcher.is_stopped()
