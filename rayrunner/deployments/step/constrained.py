"""Structured output (OpenAI `response_format`, forced tool calls): JSON constrained decoding as a per-sequence
logits processor.

`Grammars` is built once per engine from its tokenizer. It compiles a request's JSON Schema once (`json_schema`, or
`for_target` with what structured_output.py made of the request) into a factory that `SamplingParams.constraint`
calls per sequence; each processor owns a matcher that follows the sequence's output and masks every token the
grammar forbids. Once the JSON is complete only EOS is allowed, so a reply ends exactly where its JSON does; EOS is
also allowed whenever the JSON could end there (a top-level number). Whitespace between JSON tokens is compact by
default (`json.dumps`'s separators, nothing else), or capped per gap when flexible, so a small model cannot loop on
newlines until `max_tokens`.

The grammar library is llguidance, chosen over xgrammar by measurement on SmolLM2's tokenizer (49152 tokens) on this
busy 2-core CPU (`bench/bench_structured.py`). Per-token mask along 115 tokens x 3 of an 8-property schema (nested
object, bounded arrays, enum, pattern, format): llguidance mean 60 us, p99 0.5 ms; xgrammar 20 us, p99 60-100 us;
this module's whole processor call (advance, mask, apply) 120 us, p99 0.7 ms. Schema compile (per request):
llguidance 2-4 ms, xgrammar 28-38 ms; tokenizer index (per engine): 0.3-0.4 s and 0.16-0.21 s. Decode with the
schema against without: 1.02x tok/s at 1 stream, 1.04x at 8 (noise: a step is 20-75 ms). Coverage over 28 features,
each a valid instance that must be accepted and an invalid one that must be refused: both enforce nested objects,
minItems/maxItems, enum, const, anyOf/oneOf, $ref/$defs (recursive too), pattern, min/maxLength, format (date-time,
email, uuid), number bounds, exclusive bounds, multipleOf, additionalProperties, required, type lists, prefixItems and
maxProperties; only llguidance enforces allOf and patternProperties (xgrammar let an invalid allOf through and
refused a valid patternProperties). What neither enforces (uniqueItems, not, if/then/else) llguidance refuses with
"Unimplemented keys: [...]", while xgrammar compiles it and lets invalid output through. A 400 that names the
keyword beats output that breaks the schema, and the mask cost difference is lost in a decode step.
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

from rayrunner.deployments.sampling_params import LogitsProcessor
from rayrunner.deployments.structured_output import JsonTarget
from rayrunner.errors import InvalidRequestError, UnsupportedRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

logger = logging.getLogger(__name__)

# Compact JSON, as `json.dumps` writes it: the default (structured_output.py says why).
_COMPACT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Flexible: at most this much whitespace in each gap between JSON tokens: enough to pretty-print a few levels deep,
# too little for a small model to spend its whole reply on blank lines.
_FLEXIBLE: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
_MESSAGE_CHARS = 400  # of a library error quoted back to the client


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

    def json_schema(self, schema: dict[str, Any], compact: bool = True, param: str = "response_format"
                    ) -> Callable[[], LogitsProcessor]:
        """Compile `schema` once; each call of the result makes a fresh processor for one sequence. `compact`:
        `json.dumps`'s separators and no other whitespace, else up to 16 whitespace characters in each gap.

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
        return lambda: _JsonProcessor(prototype.deep_copy(), self.vocab_size)

    def for_target(self, target: JsonTarget | None) -> Callable[[], LogitsProcessor] | None:
        """The constraint of a request's JSON answer (`structured_output.json_target`); None for plain text."""
        return None if target is None else self.json_schema(target.schema, target.compact, target.param)


class _JsonProcessor:
    """One sequence's grammar state: advances over the tokens it has not seen yet, then masks the forbidden ones.

    The mask is filled into a reused bitmask (one bit per token id, as llguidance writes it) and unpacked with numpy:
    torch ops on a vocabulary-sized row start OpenMP regions, and waking the pool between grammar calls cost 2-5 ms
    a call on this busy 2-core box against ~50 us for numpy. CPU logits are masked in place; others get the unpacked
    mask copied to their device. A token the matcher refuses (only possible if something other than this mask chose
    it) leaves the matcher in its error state, whose mask allows EOS alone: the reply ends there."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.consumed = 0
        self.words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in output_ids[self.consumed:]:
            if not self.matcher.consume_token(token):
                logger.warning("constrained decoding: token %d refused (%s); ending the reply",
                               token, self.matcher.get_error()[:_MESSAGE_CHARS])
        self.consumed = len(output_ids)
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        # Little-endian words: byte k holds the bits of ids 8k..8k+7, lowest first.
        forbidden = np.unpackbits(self.words.view(np.uint8), count=logits.shape[-1], bitorder="little") == 0
        if logits.device.type == "cpu":
            np.copyto(logits.numpy(), -np.inf, where=forbidden)
            return logits
        return logits.masked_fill_(torch.from_numpy(forbidden).to(logits.device), float("-inf"))
