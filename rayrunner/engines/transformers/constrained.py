"""Structured output (OpenAI `response_format`, forced tool calls): JSON constrained decoding as a per-sequence
logits processor.

`Grammars` is built once per engine from its tokenizer. It compiles a request's JSON Schema once (`json_schema`, or
`for_target` with what structured_output.py made of the request) into a factory that `SamplingParams.constraint`
calls per sequence with the reply's token budget; each processor owns a matcher that follows the sequence's output
and masks every token the grammar forbids. Once the JSON is complete only EOS is allowed, so a reply ends exactly
where its JSON does; EOS is also allowed whenever the JSON could end there (a top-level number). Whitespace between
JSON tokens is compact by default (`json.dumps`'s separators, nothing else), or capped per gap when flexible, so a
small model cannot loop on newlines until `max_tokens`.

The processor is budget-aware: it follows where the JSON stands (`json_prefix.JsonPrefix`) and, near the end of the
budget, works out the closing text the grammar accepts (the open strings, arrays and objects closed, a pending value
`null`, and for a schema its missing required keys written with the smallest values the grammar takes, one byte at a
time, each byte approved by the matcher). Once the tokens left are what that text needs plus a small margin, only its
tokens are allowed, so a reply cut by `max_tokens` still parses. Where no closing text is found within the grammar (a
schema whose required values cannot be written in the bytes tried, a budget smaller than the shortest JSON), the
reply is cut as before.

The grammar library is llguidance, chosen over xgrammar by measurement (docs/performance.md): it enforces more of
JSON Schema and refuses with a 400 what it does not enforce.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch

from rayrunner.errors import InvalidRequestError, UnsupportedRequestError
from rayrunner.openai.json_prefix import JsonPrefix
from rayrunner.openai.sampling_params import LogitsProcessor
from rayrunner.openai.structured_output import JsonTarget

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

logger = logging.getLogger(__name__)

# Compact JSON, as `json.dumps` writes it: the default (structured_output.py says why).
_COMPACT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Flexible: at most this much whitespace in each gap between JSON tokens: enough to pretty-print a few levels deep,
# too little for a small model to spend its whole reply on blank lines.
_FLEXIBLE: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
_MESSAGE_CHARS = 400  # of a library error quoted back to the client
# Tokens kept in hand beyond the closing text: a free token may open a string, an array or a key that the closing
# text then has to close too.
_MARGIN = 4
_LOOKAHEAD = 64  # the grammar's closing text is worked out in a reply's last tokens (or when the plain one is near)
_MAX_CLOSING = 512  # bytes a closing text may have before the search gives up


class Grammars:
    """JSON grammars over one engine's tokenizer.

    `vocab_size` is the model's (its logits' width), which may exceed the tokenizer's vocabulary: the extra ids are
    never allowed. Constructing one is free; the first grammar compiled indexes the vocabulary (0.2-0.4 s, once),
    and raises `UnsupportedRequestError` when the tokenizer has no `tokenizers` backend.
    """

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self._eos_ids = sorted(eos_ids)
        self._model_vocab_size = vocab_size

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise UnsupportedRequestError("structured output needs a fast (`tokenizers`) tokenizer",
                                          param="response_format")
        backend = copy.copy(backend)  # padding or truncation would change how llguidance tokenizes text
        backend.no_padding()
        backend.no_truncation()
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos_ids or None)

    @functools.cached_property
    def vocab_size(self) -> int:
        backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
        tokenizer_size = backend.get_vocab_size(with_added_tokens=True) if backend is not None else 0
        return max(self._model_vocab_size, tokenizer_size)

    @functools.cached_property
    def byte_tokens(self) -> dict[int, int]:
        """The token that is exactly one byte, by byte (where the vocabulary has one)."""
        found = {}
        for byte in range(256):
            tokens = self.tokenizer.tokenize_bytes(bytes([byte]))
            if len(tokens) == 1 and self.tokenizer.decode_bytes(tokens) == bytes([byte]):
                found[byte] = tokens[0]
        return found

    def json_schema(self, schema: dict[str, Any], compact: bool = True, param: str = "response_format"
                    ) -> Callable[[int | None], LogitsProcessor]:
        """Compile `schema` once; each call of the result makes a fresh processor for one sequence, given its reply's
        token budget (None: unbounded). `compact`: `json.dumps`'s separators and no other whitespace, else up to 16
        whitespace characters in each gap.

        A schema that is invalid, unsatisfiable or uses a keyword llguidance does not enforce (e.g. `uniqueItems`,
        `not`, `if`) is an `InvalidRequestError` on `param` whose message says which."""
        try:
            whitespace = _COMPACT if compact else _FLEXIBLE
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=whitespace)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"invalid JSON schema: {exc}", param=param) from None
        prototype = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if prototype.is_error():
            reason = prototype.get_error()[:_MESSAGE_CHARS]
            raise InvalidRequestError(f"unsupported JSON schema: {reason}", param=param)

        def processor(budget: int | None = None) -> LogitsProcessor:
            return _JsonProcessor(prototype.deep_copy(), self, budget)

        return processor

    def for_target(self, target: JsonTarget | None) -> Callable[[int | None], LogitsProcessor] | None:
        """The constraint of a request's JSON answer (`structured_output.json_target`); None for plain text."""
        return None if target is None else self.json_schema(target.schema, target.compact, target.param)


class _JsonProcessor:
    """One sequence's grammar state: advances over the tokens it has not seen yet, then masks the forbidden ones, or
    all but the next token of the closing text once the budget left is what that text needs.

    The mask is filled into a reused bitmask (one bit per token id, as llguidance writes it) and unpacked with numpy:
    torch ops on a vocabulary-sized row start OpenMP regions, and waking the pool between grammar calls costs far
    more than numpy's unpack. CPU logits are masked in place; others get the unpacked
    mask copied to their device. A token the matcher refuses (only possible if something other than this mask chose
    it) leaves the matcher in its error state, whose mask allows EOS alone: the reply ends there."""

    def __init__(self, matcher: llguidance.LLMatcher, grammars: Grammars, budget: int | None) -> None:
        self.matcher = matcher
        self.grammars = grammars
        self.budget = budget
        self.prefix = JsonPrefix()
        self.consumed = 0
        self.words = np.zeros((grammars.vocab_size + 31) // 32, dtype=np.uint32)

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in output_ids[self.consumed:]:
            if not self.matcher.consume_token(token):
                logger.warning("constrained decoding: token %d refused (%s); ending the reply",
                               token, self.matcher.get_error()[:_MESSAGE_CHARS])
            self.prefix.feed(self.grammars.tokenizer.decode_bytes([token]))
        self.consumed = len(output_ids)
        closing = self._closing_token(len(output_ids))
        if closing is not None:
            forbidden = np.ones(logits.shape[-1], dtype=bool)
            forbidden[closing] = False
        else:
            self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
            # Little-endian words: byte k holds the bits of ids 8k..8k+7, lowest first.
            forbidden = np.unpackbits(self.words.view(np.uint8), count=logits.shape[-1], bitorder="little") == 0
        if logits.device.type == "cpu":
            np.copyto(logits.numpy(), -np.inf, where=forbidden)
            return logits
        return logits.masked_fill_(torch.from_numpy(forbidden).to(logits.device), float("-inf"))

    def _closing_token(self, generated: int) -> int | None:
        """The next token of the closing text when the budget left calls for it, else None (the grammar's mask)."""
        if self.budget is None or self.matcher.is_stopped() or self.prefix.broken:
            return None
        left = self.budget - generated
        if left > _LOOKAHEAD and left > len(self.prefix.closing()) + _MARGIN:
            return None
        tokens = self.closing_tokens()
        return tokens[0] if tokens and len(tokens) + 1 + _MARGIN >= left else None  # the 1: EOS after it

    def closing_tokens(self) -> list[int] | None:
        """Tokens that make the output whole JSON the grammar accepts (the fewest tokenization of the closing text
        that it takes); None when none is found."""
        text = self._closing_bytes()
        if not text:
            return None
        single = [self.grammars.byte_tokens[byte] for byte in text]
        tokens = self.grammars.tokenizer.tokenize_bytes(text)
        return tokens if len(tokens) < len(single) and self._completes(tokens) else single

    def _closing_bytes(self) -> bytes | None:
        """The closing text, byte by byte: at each step the first of `JsonPrefix.candidates` the matcher takes
        (as a one-byte token); the matcher is left as it was."""
        prefix, out = self.prefix.copy(), bytearray()
        try:
            while not (prefix.complete and self.matcher.is_accepting()):
                if len(out) >= _MAX_CLOSING:
                    return None
                taken = next((byte for byte in prefix.candidates() if byte in self.grammars.byte_tokens
                              and self.matcher.try_consume_tokens([self.grammars.byte_tokens[byte]]) == 1), None)
                if taken is None:
                    return None
                out.append(taken)
                prefix.feed(bytes([taken]))
            return bytes(out)
        finally:
            self.matcher.rollback(len(out))

    def _completes(self, tokens: list[int]) -> bool:
        taken = self.matcher.try_consume_tokens(tokens)
        whole = taken == len(tokens) and self.matcher.is_accepting()
        self.matcher.rollback(taken)
        return whole
