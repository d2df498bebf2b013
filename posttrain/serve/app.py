"""The OpenAI-compatible HTTP API over a Scheduler: `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`, and `POST /rl/reward` (an episode's reward, for training).

Every failure is an HTTP error with OpenAI's error body (errors.py), and the server goes on serving the other
requests: malformed or invalid JSON and unsupported fields 400 (naming the field), a wrong or missing key 401, an
unknown model or route 404, a body over the limit 413 or too slow 408 (limits.py), a prompt over the context or a
request that could never fit the scheduler's limits 400, a full queue 429, a request over `request_timeout_s` 504
(its samples cancelled), a decoding failure 500, a server shutting down 503. A client that disconnects has its
samples cancelled. A stream that fails after its first chunk ends with an `error` event and `[DONE]` (the OpenAI
client raises it). Prompts are rendered and tokenized off the event loop, and a text too long for the context is
refused before it is tokenized (admission.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
except ImportError as e:  # the serve extra is optional
    raise ImportError("the server needs FastAPI and uvicorn: pip install 'posttrain[serve]'") from e

from . import answers, fields
from .admission import Admission
from .chat import SampleText
from .errors import APIError, bad as _bad, install_error_handlers
from .generation import Cancelled, Generation, GenerationFailed, RequestTimeout, ServerClosing
from .limits import BodyLimits, KeyCheck, Limits
from .protocol import ChatRequest, CompletionRequest, RewardRequest, error_body
from .recorder import Call, Recorder
from .scheduler import PromptTooLong, QueueFull, RequestSampling
from ..tools.parse import OPEN

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
SAMPLING_EPS = 1e-5  # a temperature or top_p below it decodes greedily (vLLM's _SAMPLING_EPS)


@dataclass
class Served:
    """What the server serves: `name` (the model id clients send), the tokenizer whose chat template renders
    messages, the scheduler decoding on the model, and the tool-call format of the template (tools/parse.py)."""
    name: str
    tokenizer: object
    scheduler: object
    tool_format: str = "hermes"


def build_app(served: Served, *, api_key: str | None = None, recorder: Recorder | None = None,
              request_timeout_s: float = 600, sampling_override: RequestSampling | None = None,
              limits: Limits = Limits()) -> FastAPI:
    """The app; `sampling_override` (training): temperature / top_p / top_k / stop ids from it, not from the client,
    and the client's max_tokens capped at its max_tokens."""
    app = FastAPI(title="posttrain", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimits, max_body_bytes=limits.max_body_bytes, timeout_s=limits.read_timeout_s)
    if api_key is not None:  # added last, so it runs first: a request without the key has no body read
        app.add_middleware(KeyCheck, api_key=api_key)
    install_error_handlers(app)
    tokenizer, scheduler = served.tokenizer, served.scheduler
    admission = Admission(tokenizer, scheduler)

    @app.exception_handler(fields.FieldError)
    async def refused(_, e: fields.FieldError):
        return JSONResponse(error_body(str(e), "invalid_request_error", param=e.param), status_code=400)

    def episode_of(request: Request) -> str | None:
        given = request.headers.get("x-episode-id")
        if given:
            return given
        auth = request.headers.get("authorization", "")
        return (auth[len("Bearer "):].strip() or None) if auth.startswith("Bearer ") else None

    def timed_out() -> APIError:
        return APIError(504, f"the request took longer than {request_timeout_s:g} s and was cancelled",
                        "timeout_error", code="timeout")

    def check_model(name: str) -> None:
        if name != served.name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served.name!r}",
                           code="model_not_found", param="model")

    def sampling_for(body, prompt_len: int, options: dict) -> RequestSampling:
        room = scheduler.context_length - prompt_len
        if room <= 0:
            raise _bad(f"the prompt is {prompt_len} tokens, and the model's context is {scheduler.context_length}",
                       "messages" if isinstance(body, ChatRequest) else "prompt")
        asked = body.new_tokens()
        top_k = body.top_k if body.top_k and body.top_k > 0 else -1
        s = RequestSampling(temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k,
                            max_tokens=room if asked is None else asked, seed=body.seed,
                            logprobs=body.logprobs is not None and body.logprobs is not False, **options)
        if s.temperature < SAMPLING_EPS or s.top_p < SAMPLING_EPS:  # 1e-300 would overflow the scaled logits
            s = replace(s, temperature=0.0, top_p=1.0, top_k=-1)
        if sampling_override is not None:
            o = sampling_override
            if s.seed is not None:  # n runs of a row sending one seed would draw one sample n times
                seed_dropped()
            s = replace(s, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, seed=None,
                        stop_token_ids=tuple(dict.fromkeys(o.stop_token_ids + s.stop_token_ids)),
                        max_tokens=min(s.max_tokens, o.max_tokens))
        return s

    warned = []

    def seed_dropped() -> None:
        if recorder is not None:
            recorder.count("seeds_dropped")
        if not warned:
            warned.append(True)
            log.warning("training: a client's seed is ignored (the samples of a row's runs must differ); counted in "
                        "the recorder's seeds_dropped; logged once")

    def submit(prompts: list[list[int]], n: int, sampling: RequestSampling) -> list:
        handles = []
        try:
            for ids in prompts:
                handles.append(scheduler.submit(ids, n, sampling))
        except QueueFull as e:
            for h in handles:
                h.cancel()
            raise APIError(429, f"the server is busy ({e or 'too many requests waiting'}); retry later",
                           "rate_limit_error", code="rate_limit_exceeded") from None
        except PromptTooLong as e:
            for h in handles:
                h.cancel()
            raise _bad(str(e), "max_tokens") from None
        except ValueError as e:  # n over max_running, a token id outside the vocabulary
            for h in handles:
                h.cancel()
            raise _bad(str(e)) from None
        except RuntimeError as e:  # closed
            raise APIError(503, f"the server is shutting down ({e})", "server_error") from None
        return handles

    @contextlib.asynccontextmanager
    async def watching(gen: Generation, request: Request):
        """Inside it, a client that disconnects has its samples cancelled (the reader gets `Cancelled`)."""
        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            gen.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            yield
        finally:
            watcher.cancel()

    def failure(e: Exception) -> APIError:
        """What a client is told of a generation that ended without its answer."""
        if isinstance(e, RequestTimeout):
            return timed_out()
        if isinstance(e, ServerClosing):
            return APIError(503, str(e), "server_error", code="server_shutting_down")
        return APIError(500, str(e), "server_error")

    async def collect(gen: Generation, request: Request) -> None:
        """Every update consumed (the samples' text and ids accumulate in them); the client watched meanwhile."""
        try:
            async with watching(gen, request):
                async for _ in gen.updates():
                    pass
        except (RequestTimeout, GenerationFailed) as e:
            raise failure(e) from None
        except Cancelled:  # nobody reads this answer
            raise APIError(499, "the client closed the connection", "invalid_request_error") from None
        finally:
            gen.cancel()

    def record(request: Request, prompts: list[list[int]], n: int, samples: list[SampleText], finishes: list[str]):
        if recorder is None or (episode := episode_of(request)) is None:
            return
        for choice, (sample, finish) in enumerate(zip(samples, finishes)):
            recorder.record(episode, Call(list(prompts[choice // n]), list(sample.ids), list(sample.logprobs), finish))

    def usage(prompts: list[list[int]], n: int, samples: list[SampleText]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(s.ids) for s in samples)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"  # JSON has no NaN

    async def start(request: Request, body, prompts: list[list[int]], watch: str | None):
        """The samples submitted, and a Generation over them."""
        eos_ids = getattr(getattr(scheduler, "engine", None), "eos_ids", None) or {tokenizer.eos_token_id}
        options = await fields.options(body, tokenizer, getattr(scheduler, "vocab_size", len(tokenizer)), eos_ids)
        sampling = sampling_for(body, max(len(p) for p in prompts), options)
        deadline = time.monotonic() + request_timeout_s
        handles = submit(prompts, body.n, sampling)
        samples = [SampleText(tokenizer, body.stop_strings(), watch, whole=not body.stream,
                              include_stop=body.include_stop_str_in_output, skip_special=body.skip_special_tokens,
                              stop_ids=getattr(handles[0], "stop_ids", frozenset()))
                   for _ in range(len(prompts) * body.n)]
        return Generation(handles, body.n, samples, deadline), samples

    async def streamed(gen: Generation, request: Request, chunks, on_done):
        """The SSE response: the first update is awaited before the response starts (so a request refused or timed
        out while waiting still gets its HTTP status); `chunks(update)` gives the events of one update."""
        updates = gen.updates()
        try:
            async with watching(gen, request):
                first = await updates.__anext__()
        except StopAsyncIteration:
            first = None
        except (RequestTimeout, GenerationFailed) as e:
            gen.cancel()
            raise failure(e) from None
        except Cancelled:
            raise APIError(499, "the client closed the connection", "invalid_request_error") from None

        async def body():
            try:
                if first is not None:
                    for chunk in chunks(first):
                        yield sse(chunk)
                    async for update in updates:
                        for chunk in chunks(update):
                            yield sse(chunk)
                for chunk in on_done():
                    yield sse(chunk)
            except (RequestTimeout, GenerationFailed) as e:  # the stream ends with an error event, then [DONE]
                yield sse(failure(e).body)
            except Exception as e:  # noqa: BLE001 - a failure building a chunk still ends the stream as OpenAI's do
                log.exception("a stream failed")
                yield sse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))
            finally:  # also when the client went away (the response task is cancelled)
                gen.cancel()
                with contextlib.suppress(Exception):
                    await updates.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        stats = getattr(scheduler, "stats", None)  # requests and the prefix cache's hits (Scheduler.stats)
        return {"status": "ok"} if stats is None else {"status": "ok", "stats": stats}

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "posttrain", "max_model_len": scheduler.context_length}]}

    @app.post("/rl/reward")
    async def reward(body: RewardRequest, request: Request):
        if recorder is None:
            raise APIError(404, "this server records no episodes (it was started without a recorder)")
        episode = episode_of(request)
        if episode is None:
            raise _bad("no episode id: send X-Episode-Id or Authorization: Bearer <episode id>")
        recorder.set_reward(episode, body.reward)
        return {"episode": episode, "reward": body.reward}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        fields.screen(body)
        tools = body.tools if body.tools and body.tool_choice != "none" else None
        admission.check_fits(1, body.n)
        prompt = await admission.chat_prompt(body.messages, tools, body.chat_template_kwargs)
        gen, samples = await start(request, body, [prompt], OPEN if tools else None)
        rid, created = f"chatcmpl-{body.request_id or uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": served.name}

        def message(choice: int) -> tuple[dict, str]:
            sample = samples[choice]
            content, calls = answers.turn(sample.text, tools is not None, served.tool_format, body.parallel_tool_calls)
            reason = "tool_calls" if calls and gen.finish[choice] == "stop" else gen.finish[choice]
            return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}, reason

        if not body.stream:
            await collect(gen, request)
            choices, reasons = [], []
            for i, sample in enumerate(samples):
                msg, reason = message(i)
                reasons.append(reason)
                lp = (answers.chat_logprobs(tokenizer, zip(sample.ids, sample.shown, sample.tops)) if body.logprobs
                      else None)
                choices.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": reason})
            record(request, [prompt], body.n, samples, reasons)
            return {**head, "object": "chat.completion", "choices": choices, "usage": usage([prompt], body.n, samples)}

        started: set[int] = set()
        reasons: list[str | None] = [None] * len(samples)

        def chunk(choice: int, delta: dict, tokens=(), reason=None) -> dict:
            lp = answers.chat_logprobs(tokenizer, tokens) if body.logprobs and tokens else None
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": choice, "delta": delta, "logprobs": lp, "finish_reason": reason}]}

        def chunks(update):
            out = []
            if update.choice not in started:
                started.add(update.choice)
                out.append(chunk(update.choice, {"role": "assistant", "content": ""}))
            if update.text or update.tokens:
                out.append(chunk(update.choice, {"content": update.text} if update.text else {}, update.tokens))
            if update.finish is not None:
                tail = samples[update.choice].tail()
                _, reason = message(update.choice)
                reasons[update.choice] = reason
                if tail:
                    content, calls = answers.turn(tail, True, served.tool_format, body.parallel_tool_calls)
                    if content:
                        out.append(chunk(update.choice, {"content": content}))
                    if calls:
                        out.append(chunk(update.choice, {"tool_calls": [{"index": k, **c}
                                                                        for k, c in enumerate(calls)]}))
                out.append(chunk(update.choice, {}, reason=reason))
            return out

        def done():
            record(request, [prompt], body.n, samples, reasons)
            if body.stream_options and body.stream_options.include_usage:
                return [{**head, "object": "chat.completion.chunk", "choices": [],
                         "usage": usage([prompt], body.n, samples)}]
            return []

        return await streamed(gen, request, chunks, done)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        fields.screen(body)
        admission.check_fits(len(body.prompts()), body.n)
        prompts = await admission.completion_prompts(body.prompts())
        if not prompts:
            raise _bad("no prompt given", "prompt")
        gen, samples = await start(request, body, prompts, None)
        rid, created = f"cmpl-{body.request_id or uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": served.name, "object": "text_completion"}
        given = body.prompts()

        def echo(k: int):  # prompt k's text, ids and scored log-probs (set on its handle before its first token)
            p = given[k] if isinstance(given[k], str) else tokenizer.decode(prompts[k], skip_special_tokens=False)
            return lambda: (p, prompts[k], getattr(gen.handles[k], "prompt_logprobs", None))

        texts = [answers.CompletionText(tokenizer, body.logprobs, echo(i // body.n) if body.echo else None)
                 for i in range(len(samples))]

        if not body.stream:
            await collect(gen, request)
            choices = [{"index": i, **dict(zip(("text", "logprobs"),
                                               texts[i].piece(s.text, zip(s.ids, s.shown, s.tops)))),
                        "finish_reason": gen.finish[i]} for i, s in enumerate(samples)]
            record(request, prompts, body.n, samples, list(gen.finish))
            return {**head, "choices": choices, "usage": usage(prompts, body.n, samples)}

        def chunks(update):
            if not (update.text or update.tokens or update.finish):
                return []
            text, lp = texts[update.choice].piece(update.text, update.tokens)
            return [{**head, "choices": [{"index": update.choice, "text": text, "logprobs": lp,
                                          "finish_reason": update.finish}]}]

        def done():
            record(request, prompts, body.n, samples, list(gen.finish))
            if body.stream_options and body.stream_options.include_usage:
                return [{**head, "choices": [], "usage": usage(prompts, body.n, samples)}]
            return []

        return await streamed(gen, request, chunks, done)

    return app
