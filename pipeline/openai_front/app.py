"""The front as an aiohttp server beside a running Triton: each OpenAI request becomes one request to the model's
Triton generate (non-streamed) or generate_stream (server-sent events) endpoint, and its answer an OpenAI answer.

`OpenAIFront` runs it on an event loop thread of its own, so `trtpipe serve --openai` and `trtpipe validate
--api openai` hold it beside the embedded server in one process.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from ..backends import bls_draft_len, not_streamed
from ..errors import UserError
from ..model_repository import read_repository
from ..triton_names import MAX_TOKENS, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS, TENSORRT_LLM_BLS, TEXT_INPUT, TEXT_OUTPUT
from .protocol import (CHAT, COMPLETIONS, DEFAULT_MAX_TOKENS, DEFAULT_OPENAI_PORT, GenerationRequest, OpenAIError,
                       ServedModel, StopScanner, chunk_body, finish_reason, parse_request, response_body, usage)

#: what the cpu model answers while `trtpipe serve` drains, and Triton when a queue is full: retry later
UNAVAILABLE_MARKERS = ("shutting down", "queue", "exceeds maximum queue size")
OWNER = "Triton Inference Server"


def served_models(repo: Path) -> dict[str, ServedModel]:
    """The repository's models that take the ensemble contract (text_input, max_tokens -> text_output): the ensemble
    and the BLS model. Triton's frontend lists every model and fails on the others at request time; an llmapi
    model (`sampling_param_max_tokens`) is not one: its OpenAI endpoint is trtllm-serve's."""
    repository = read_repository(Path(repo))
    plan = deployed_plan(repository)
    drafts, unstreamed = (bls_draft_len(plan), not_streamed(plan)) if plan is not None else (None, None)
    out = {}
    for name, model in sorted(repository.models.items()):
        if {TEXT_INPUT, MAX_TOKENS} <= set(model.inputs()) and TEXT_OUTPUT in model.outputs():
            out[name] = ServedModel(name, frozenset(model.inputs()), unstreamed=unstreamed,
                                    drafts=drafts if name == TENSORRT_LLM_BLS else None)
    if not out:
        raise UserError(f"{repo} has no model that takes text_input and max_tokens and answers text_output (the "
                        "ensemble contract the OpenAI front speaks); an llmapi repository's OpenAI endpoint is "
                        "trtllm-serve's (its trtllm-serve.sh)")
    return out


def deployed_plan(repository):
    """The plan deploy recorded in the repository (None: a repository deploy did not write)."""
    try:
        return repository.plan()
    except UserError:
        return None


def chat_renderer(tokenizer_dir: Path):
    """The tokenizer's chat template, rendered once with the generation prompt (as Triton's frontend does:
    `apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def render(messages: list[dict]) -> str:
        if not tokenizer.chat_template:
            raise OpenAIError("the model's tokenizer has no chat template: use /v1/completions")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render


def model_error(message: str) -> OpenAIError:
    """An error the model (or Triton) answered, as an OpenAI error: 503 for 'retry later', else the request's."""
    status = 503 if any(marker in message for marker in UNAVAILABLE_MARKERS) else 400
    return OpenAIError(message, status=status)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error as an OpenAI error object: refusals, unknown routes, bodies that are not JSON."""
    try:
        return await handler(request)
    except OpenAIError as error:
        return web.json_response(error.body(), status=error.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(OpenAIError(exc.reason, status=exc.status).body(), status=exc.status)


class Front:
    """The handlers: one upstream session to Triton, the served models and the chat template."""

    def __init__(self, triton_url: str, models: dict[str, ServedModel], render_chat,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS):
        self.triton_url = triton_url.rstrip("/")
        self.models, self.render_chat, self.default_max_tokens = models, render_chat, default_max_tokens
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{name}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health/ready", self.health)
        app.router.add_post(COMPLETIONS, self.completions)
        app.router.add_post(CHAT, self.chat)
        app.on_startup.append(self.open_session)
        app.on_cleanup.append(self.close_session)
        return app

    async def open_session(self, app) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))

    async def close_session(self, app) -> None:
        await self.session.close()

    def model_entry(self, model: ServedModel) -> dict:
        return {"id": model.name, "object": "model", "created": model.created, "owned_by": OWNER}

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.model_entry(m) for m in self.models.values()]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.models:
            raise OpenAIError(f"the model `{name}` does not exist", status=404, param="model", code="model_not_found")
        return web.json_response(self.model_entry(self.models[name]))

    async def health(self, request: web.Request) -> web.Response:
        try:
            async with self.session.get(f"{self.triton_url}/v2/health/ready") as upstream:
                ready = upstream.status == 200
        except aiohttp.ClientError:
            ready = False
        if not ready:
            raise OpenAIError("the Triton server is not ready", status=503)
        return web.json_response({})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, CHAT)

    async def answer(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise OpenAIError("the request body is not valid JSON") from None
        generation = parse_request(endpoint, body, self.models, self.render_chat, self.default_max_tokens)
        if generation.stream:
            return await self.stream(request, generation)
        return web.json_response(await self.generate(generation))

    async def generate(self, generation: GenerationRequest) -> dict:
        url = f"{self.triton_url}/v2/models/{generation.model}/generate"
        try:
            async with self.session.post(url, json=generation.ensemble_body()) as upstream:
                answer = await upstream.json(content_type=None)
        except (aiohttp.ClientError, json.JSONDecodeError) as exc:
            raise OpenAIError(f"the Triton server did not answer ({type(exc).__name__})", status=502) from None
        if not isinstance(answer, dict) or "error" in answer or TEXT_OUTPUT not in answer:
            message = answer.get("error") if isinstance(answer, dict) else None
            raise model_error(str(message or f"the model answered without {TEXT_OUTPUT}: {str(answer)[:200]}"))
        text, prefix = answer[TEXT_OUTPUT], generation.prompt if generation.echo else ""
        scanner = StopScanner(generation.stop)
        kept = prefix + scanner.feed(text[len(prefix):] if text.startswith(prefix) else text)
        kept += "" if scanner.stopped else scanner.flush()
        out_tokens = answer.get(NUM_OUTPUT_TOKENS)
        return response_body(generation, kept, finish_reason(scanner.stopped, out_tokens, generation.max_tokens),
                             usage(answer.get(NUM_INPUT_TOKENS), out_tokens))

    async def stream(self, request: web.Request, generation: GenerationRequest) -> web.StreamResponse:
        """Server-sent events: the role first (chat), a chunk per model response, the finish reason, the usage
        when asked (`stream_options.include_usage`), `data: [DONE]`. A refusal in the model's first response is
        an HTTP error, as for a non-streamed request; a later one an error event."""
        url = f"{self.triton_url}/v2/models/{generation.model}/generate_stream"
        try:
            upstream = await self.session.post(url, json=generation.ensemble_body())
        except aiohttp.ClientError as exc:
            raise OpenAIError(f"the Triton server did not answer ({type(exc).__name__})", status=502) from None
        async with upstream:
            events = model_events(upstream)
            first = await anext(events, None)
            if first is None or "error" in first:
                raise model_error(str((first or {}).get("error", "the model sent no response")))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            await relay(response, generation, first, events)
            await response.write(b"data: [DONE]\n\n")
        return response


async def model_events(upstream: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON of each `data:` event of Triton's generate_stream (an HTTP error as one error event)."""
    if upstream.status != 200:
        text = await upstream.text()
        try:
            yield {"error": json.loads(text).get("error", text)}
        except (ValueError, AttributeError):
            yield {"error": text}
        return
    async for line in upstream.content:
        if line.startswith(b"data:"):
            yield json.loads(line[5:])


async def relay(response: web.StreamResponse, generation: GenerationRequest, first: dict,
                events: AsyncIterator[dict]) -> None:
    """Each model response as a chunk until the stream or a stop sequence ends it."""
    scanner, prompt_tokens, out_tokens = StopScanner(generation.stop), first.get(NUM_INPUT_TOKENS), 0
    if generation.chat:
        await send(response, chunk_body(generation, "", first=True))
    elif generation.echo:
        await send(response, chunk_body(generation, generation.prompt))
    event = first
    while event is not None:
        if "error" in event:
            await send(response, OpenAIError(str(event["error"]), status=500).body())
            return
        out_tokens += int(event.get(NUM_OUTPUT_TOKENS) or 0)
        text = scanner.feed(event.get(TEXT_OUTPUT, ""))
        if text:
            await send(response, chunk_body(generation, text))
        if scanner.stopped:
            break
        event = await anext(events, None)
    rest = "" if scanner.stopped else scanner.flush()
    finish = finish_reason(scanner.stopped, out_tokens, generation.max_tokens)
    await send(response, chunk_body(generation, rest or None, finish))
    if generation.include_usage:
        await send(response, chunk_body(generation, None, used=usage(prompt_tokens, out_tokens)))


async def send(response: web.StreamResponse, body: dict) -> None:
    await response.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


class OpenAIFront:
    """The front over the Triton server at `triton_url` serving `repo`, on a thread of its own; a context manager
    (`url` once entered: http://HOST:PORT, port 0 picks a free one)."""

    def __init__(self, repo: Path, triton_url: str, *, host: str = "127.0.0.1", port: int = DEFAULT_OPENAI_PORT,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS):
        repository = read_repository(Path(repo))
        self.front = Front(triton_url, served_models(repo), chat_renderer(repository.tokenizer), default_max_tokens)
        self.host, self.port = host, port
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, name="openai-front", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> OpenAIFront:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=60)
        return self

    async def _start(self) -> None:
        self.runner = web.AppRunner(self.front.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await self.runner.cleanup()
            raise UserError(f"the OpenAI front cannot listen on {self.host}:{self.port}: {exc.strerror}") from None
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
            self.runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def __enter__(self) -> OpenAIFront:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
