"""Text generation by vLLM's async engine inside the model's replica (`engine.backend: vllm`).

Everything around the engine stays rayrunner's: the replica, registry, lifecycle, router and OpenAI surface. Chats
are rendered and their tool calls parsed as `TextEngine` does (`ChatTokens`), and the prompt goes to vLLM as token
ids; sampling maps field by field onto vLLM's `SamplingParams`; JSON answers use vLLM's structured outputs with its
llguidance backend, the library rayrunner's own engine constrains with, on the same shaped schema
(`structured_output`). A client that leaves closes the event stream, and vLLM's `generate` aborts the request.

Sleep: on CUDA vLLM's sleep mode (`engine.vllm.sleep_level`); vLLM has none on CPU, so there the engine is shut down
(its memory freed with its process) and started again on wake, in this replica with its imports kept.
The replica runs in vLLM's own interpreter (`vllm_runtime`).

Weights: vLLM (0.32) reads no GGUF, so a GGUF source is dequantized once, on the replica's node, into a safetensors
folder in rayrunner's cache at the spec's dtype (`gguf_folder`), the weights rayrunner's own engine reads from the same
file; vLLM serves that folder. The builtin SmolLM2 is already such a folder (`models.sources`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock
from transformers import AutoTokenizer
from vllm import SamplingParams as VllmSamplingParams
from vllm import TokensPrompt
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM

from rayrunner.engines.base import Engine, EngineInfo, bounded_max_tokens
from rayrunner.engines.chat_tokens import ChatTokens
from rayrunner.engines.loading import load_config, pick_device, pick_dtype, resolve_which
from rayrunner.engines.lora import adapter_folder
from rayrunner.errors import InvalidRequestError, ModelLoadError, ModelUnavailableError, RayRunnerError
from rayrunner.models.footprint import expected_weight_bytes
from rayrunner.models.load_progress import LoadProgress, for_model
from rayrunner.models.sources import ResolvedSource
from rayrunner.models.spec import ModelSpec
from rayrunner.models.which import Lora
from rayrunner.openai.events import GenerationEvent, TokenLogprob
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.openai.structured_output import JsonTarget, json_target
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest
from rayrunner.runtime.cache_dir import cache_dir

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput, RequestOutput

    from rayrunner.engines.parked_weights import ParkedWeights

_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
_MAX_LORA_RANK = 64


class VllmEngine(ChatTokens, Engine):
    kind = "text"

    def __init__(self, spec: ModelSpec) -> None:
        start = time.perf_counter()
        self.spec = spec
        progress = for_model(spec.app_name, spec.model_id)
        progress.phase("resolving")
        source, tok_location = resolve_which(spec, progress)
        self.device = pick_device(spec.engine.device)
        dtype = _dtype(spec, source, self.device)
        model = gguf_folder(Path(source.path, source.gguf_file), dtype, progress) if source.gguf_file else source.path
        self.tokenizer = AutoTokenizer.from_pretrained(tok_location or model)
        self.args = _engine_args(spec, model, tok_location or model, self.device, dtype)
        progress.phase("warming up")  # vLLM reads the weights, profiles and allocates its KV cache
        self.llm: AsyncLLM | None = self._start()
        self.max_seq_len: int = self.llm.model_config.max_model_len
        self.vocab_size: int = self.llm.model_config.get_vocab_size()
        self.adapters: dict[str, LoRARequest] = {}
        self.default_adapter = self._spec_adapter(spec)
        self.load_time_s = time.perf_counter() - start

    def _start(self) -> AsyncLLM:
        try:
            return AsyncLLM.from_engine_args(self.args)
        except Exception as exc:
            raise ModelLoadError(f"vLLM could not start `{self.spec.model_id}`: {type(exc).__name__}: {exc}"
                                 ) from None

    def _spec_adapter(self, spec: ModelSpec) -> str | None:
        """A `Which.Lora` spec serves its adapter, named by the model id, to requests that name none."""
        if not isinstance(spec.which, Lora):
            return None
        self._register(spec.model_id, adapter_folder(spec.which.adapter, spec.which.hf_cache_path))
        return spec.model_id

    def _register(self, name: str, folder: str) -> None:
        known = self.adapters.get(name)
        if known is not None and known.lora_path != folder:
            raise InvalidRequestError(f"adapter `{name}` is already loaded from `{known.lora_path}`", param="adapter")
        self.adapters[name] = LoRARequest(name, len(self.adapters) + 1, folder)

    async def use_adapter(self, name: str, source: str | None) -> None:
        """vLLM loads an adapter at its first request (and keeps `max_adapters` of them, least recently used out);
        here it is only named."""
        if source is not None and name not in self.adapters:
            hub_cache = getattr(self.spec.which, "hf_cache_path", None)
            self._register(name, await asyncio.to_thread(adapter_folder, source, hub_cache))

    def info(self) -> EngineInfo:
        options = self.spec.engine.vllm
        extra = {"backend": "vllm", "max_seq_len": self.max_seq_len, "kv_cache_bytes": options.kv_cache_bytes,
                 "compile": options.compile, "adapters": sorted(self.adapters)}
        quantization = {"method": "fp8", "backend": "vllm"} if self.spec.in_situ_quant else None
        return EngineInfo(kind=self.kind, device=self.device, dtype=self.args.dtype,
                          weight_bytes=expected_weight_bytes(self.spec), quantization=quantization,
                          load_time_s=self.load_time_s, extra=extra)

    def chat(self, request: ChatCompletionRequest, params: SamplingParams, adapter: str | None = None
             ) -> AsyncIterator[GenerationEvent]:
        target = json_target(request)
        ids = self.chat_ids(request, target)
        keep_specials = bool(self.tool_markers(request))  # the call's marker tokens stay for the tool parser
        return self._generate(ids, params, adapter, target, keep_specials)

    def complete(self, request: CompletionRequest, params: SamplingParams, adapter: str | None = None
                 ) -> AsyncIterator[GenerationEvent]:
        ids = self.completion_ids(request)
        return self._generate(ids, params, adapter)

    def _generate(self, ids: list[int], params: SamplingParams, adapter: str | None,
                  target: JsonTarget | None = None, keep_specials: bool = False) -> AsyncIterator[GenerationEvent]:
        """Check the request now (a bad one is a 400 before anything streams), then stream its events."""
        if not ids:
            raise InvalidRequestError("prompt: the prompt is empty (no tokens)", param="prompt")
        params.max_tokens = bounded_max_tokens(len(ids), params.max_tokens, self.max_seq_len)
        lora = self._lora(adapter or self.default_adapter)
        sampling = _vllm_sampling(params, target, keep_specials, self.vocab_size)
        prompt = TokensPrompt(prompt_token_ids=ids)
        if params.cache_salt is not None:
            prompt["cache_salt"] = params.cache_salt
        return self._events(prompt, sampling, lora)

    def _lora(self, adapter: str | None) -> LoRARequest | None:
        if adapter is None:
            return None
        if adapter not in self.adapters:
            raise InvalidRequestError(f"adapter `{adapter}` is not loaded on this model", param="adapter")
        return self.adapters[adapter]

    async def _events(self, prompt: TokensPrompt, sampling: VllmSamplingParams, lora: LoRARequest | None
                      ) -> AsyncIterator[GenerationEvent]:
        if self.llm is None:
            raise ModelUnavailableError("the vLLM engine is asleep")  # the slot wakes it before any request
        started = time.perf_counter()
        first: dict[int, float] = {}
        counts: dict[int, int] = {}
        request_id = uuid.uuid4().hex
        try:
            async for output in self.llm.generate(prompt, sampling, request_id,
                                                  lora_request=lora):
                for choice in output.outputs:
                    now = time.perf_counter()
                    is_first = choice.index not in first
                    first.setdefault(choice.index, now)
                    counts[choice.index] = counts.get(choice.index, 0) + len(choice.token_ids)
                    event = _event(choice, output if is_first else None, sampling.logprobs or 0)
                    if event.finish_reason is not None:
                        event.prompt_tokens = len(prompt["prompt_token_ids"])
                        event.completion_tokens = counts[choice.index]
                        event.cached_tokens = int(getattr(output, "num_cached_tokens", None) or 0)
                        event.prompt_time_s = first[choice.index] - started
                        event.completion_time_s = now - first[choice.index]
                    yield event
        except RayRunnerError:
            raise
        except ValueError as exc:  # vLLM's checks of the request as it is added
            raise InvalidRequestError(str(exc)) from None
        except Exception as exc:
            if self.llm.errored:
                raise ModelUnavailableError(f"the vLLM engine died: {exc}") from None
            raise

    async def sleep(self, parking: ParkedWeights) -> None:
        """CUDA: vLLM's sleep mode; CPU: the engine is shut down (see the module's docstring)."""
        assert self.llm is not None
        if self.device == "cuda":
            await self.llm.sleep(level=self.spec.engine.vllm.sleep_level)
            return
        llm, self.llm = self.llm, None
        await asyncio.to_thread(llm.shutdown)

    async def wake(self, parking: ParkedWeights) -> None:
        if self.llm is not None:
            await self.llm.wake_up()
            return
        self.llm = await asyncio.to_thread(self._start)

    def check_health(self) -> None:
        if self.llm is not None and self.llm.errored:
            raise ModelUnavailableError("the vLLM engine died")

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


def gguf_folder(gguf: Path, dtype: str, progress: LoadProgress | None = None) -> str:
    """The GGUF file `gguf` as a safetensors folder at `dtype`: converted once into rayrunner's cache on this node
    (keyed by the file's path, size, modification time and the dtype) and reused."""
    file = gguf.resolve()
    stat = file.stat()
    key = hashlib.sha256(f"{file}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}".encode()).hexdigest()[:16]
    target = cache_dir() / "gguf" / f"{file.stem}.{dtype}.{key}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{target}.lock"):
            if not (target / "config.json").is_file():
                if progress is not None:
                    progress.phase("converting", source=file.name)
                _convert_gguf(file, dtype, target)
    return str(target)


def _convert_gguf(file: Path, dtype: str, target: Path) -> None:
    """Dequantize `file` with transformers (the reading rayrunner's own engine does) and save it, with its tokenizer,
    as a plain model folder at `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    tmp = target.with_name(f"{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                     dtype=getattr(torch, dtype))
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the GGUF file `{file}` for vLLM: {type(exc).__name__}: {exc}") from None
    model.hf_quantizer = None  # type: ignore[assignment]  # dequantized: the folder loads as plain weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, target)


def _dtype(spec: ModelSpec, source: ResolvedSource, device: str) -> str:
    """vLLM's name of the dtype to load in: the one asked for, or for `auto` what rayrunner's own engine picks
    (the config's where the device runs it well, `loading.pick_dtype`)."""
    if spec.which.dtype != "auto":
        return _DTYPES[spec.which.dtype]
    return str(pick_dtype("auto", load_config(source), device)).removeprefix("torch.")


def _engine_args(spec: ModelSpec, model: str, tokenizer: str, device: str, dtype: str) -> AsyncEngineArgs:
    """vLLM's engine arguments from the spec: `engine.vllm.engine_args` last, so a user's choice wins."""
    settings, options = spec.engine, spec.engine.vllm
    args: dict[str, Any] = {
        "model": model, "tokenizer": tokenizer, "dtype": dtype,
        "max_num_seqs": settings.max_num_seqs,
        "kv_cache_memory_bytes": settings.kv_cache_bytes or options.kv_cache_bytes,
        "enforce_eager": not options.compile, "structured_outputs_config": {"backend": "guidance"},
        "enable_sleep_mode": device == "cuda", "disable_log_stats": True,
        "enable_prefix_caching": settings.prefix_caching,
    }
    if settings.max_seq_len is not None:
        args["max_model_len"] = settings.max_seq_len
    if settings.num_gpus > 1:
        args["tensor_parallel_size"] = int(settings.num_gpus)  # the replica's GPUs, one shard each
    if spec.in_situ_quant == "FP8":
        if device != "cuda":
            raise ModelLoadError("in_situ_quant `FP8` on the vllm backend needs a CUDA device")
        args["quantization"] = "fp8"
    if isinstance(spec.which, Lora):
        args.update(enable_lora=True, max_loras=settings.max_adapters, max_lora_rank=_MAX_LORA_RANK)
    if spec.which.revision is not None:
        args["revision"] = spec.which.revision
    try:
        return AsyncEngineArgs(**{**args, **options.engine_args})
    except TypeError as exc:
        raise ModelLoadError(f"engine.vllm.engine_args: {exc}") from None


def _vllm_sampling(params: SamplingParams, target: JsonTarget | None, keep_specials: bool, vocab_size: int
                   ) -> VllmSamplingParams:
    """rayrunner's resolved sampling settings as vLLM's, streamed as deltas; a value vLLM refuses is a 400."""
    if any(not 0 <= token < vocab_size for token in params.logit_bias):
        raise InvalidRequestError(f"logit_bias: token ids must be in [0, {vocab_size})", param="logit_bias")
    structured = None
    if target is not None:
        structured = StructuredOutputsParams(json=target.schema, disable_any_whitespace=target.compact)
    try:
        return VllmSamplingParams(
            n=params.n, max_tokens=params.max_tokens, min_tokens=params.min_tokens, temperature=params.temperature,
            top_p=params.top_p, top_k=params.top_k, min_p=params.min_p, seed=params.seed,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias or None,
            stop=params.stop or None, stop_token_ids=params.stop_token_ids or None, ignore_eos=params.ignore_eos,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens and not keep_specials,
            logprobs=params.logprobs, prompt_logprobs=params.logprobs if params.prompt_logprobs else None,
            structured_outputs=structured, output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None


def _event(choice: CompletionOutput, first_of: RequestOutput | None, k: int) -> GenerationEvent:
    """One choice's delta as an event (`k`: the alternatives asked for); the choice's first carries the prompt's
    logprobs when asked for."""
    finish = choice.finish_reason
    if finish == "abort":
        raise ModelUnavailableError("vLLM aborted the request")
    prompt = first_of.prompt_logprobs if first_of is not None else None
    return GenerationEvent(
        text=choice.text, index=choice.index, finish_reason=finish,
        logprobs=_logprobs(choice.token_ids, choice.logprobs, k) if choice.logprobs is not None else None,
        prompt_logprobs=_logprobs(first_of.prompt_token_ids or [], prompt, k) if first_of and prompt else None,
    )


def _logprobs(token_ids: Any, positions: Any, k: int) -> list[TokenLogprob]:
    """vLLM's per-position `{token id: Logprob}` (the k most likely, plus the chosen token when it is not among
    them) as TokenLogprobs; a position without any (the prompt's first token) has logprob None."""
    out = []
    for token, position in zip(token_ids, positions, strict=True):
        chosen = position.get(token) if position else None
        if chosen is None:
            out.append(TokenLogprob(token="", logprob=None))
            continue
        ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= k),
                        key=lambda lp: lp.rank)
        out.append(TokenLogprob(token=chosen.decoded_token or "", logprob=chosen.logprob,
                                top=[(lp.decoded_token or "", lp.logprob) for lp in ranked]))
    return out
