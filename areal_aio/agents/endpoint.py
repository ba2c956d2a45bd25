"""The OpenAI-compatible endpoint: an HTTP server in the controller's own event loop (aiohttp),
one base URL per episode, each call a reply of that episode's Model (agents/chat.py).

    agent --POST /<episode id>/v1/chat/completions--> [aiohttp handler task]
        key? (401) -> episode id: live (else 404; ended: 410) -> body (413, 400) -> its queue
        (past endpoint.max_concurrent: 429) -> Conversation.complete -> Model.reply
        -> groups' Generate -> rollout worker -> Completion -> chat.completion JSON
    GET /v1/models, GET /<episode id>/v1/models: the one served model (endpoint.model_name)
    POST /<episode id>/reward {"reward": x}: what an agent in another process reports
        (`await model.posted_reward()` in the episode returns it)

aiohttp because its AppRunner / TCPSite start inside a running loop and install no signal
handlers (uvicorn's Server.serve captures SIGINT / SIGTERM, which a library embedded in someone
else's loop must not), and it cancels a handler whose client disconnected, which aborts the
reply in flight (groups' _reply sends the Abort): the episode goes on, its sequence unchanged.

Lifetime: the controller serves while its run's tasks run (`serving`), and episodes.play
registers each episode for as long as it plays (`served`), through a context variable, so
training and eval episodes, of one run or several in one loop, each reach their own server. An
episode that ends takes its calls in flight with it (410, their replies aborted); its id stays
known (ENDED_KEPT) so a late call gets 410, not 404. A stop or a weight update mid-call is not
seen by the client: groups' _reply resubmits an aborted reply (on_interrupt = restart), and a
continued one returns with its tokens' versions. Every error is OpenAI's error JSON and counted
by status, as every completion is, in the counts the controller hands it (`Answered`: the run's
control/stats.py Counts, summary.json's endpoint_calls and endpoint_errors); nothing a client
sends reaches the loop's other tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import secrets
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from areal_aio.agents.chat import ChatError, ChatRequest, Conversation
from areal_aio.agents.model import Model
from areal_aio.settings import EndpointSettings, SettingsError

ENDED_KEPT = 65536
"""Ids of ended episodes remembered (oldest forgotten first): a late call gets 410, not 404."""
ID_BYTES = 18
"""Random bytes of an episode id (144 bits, URL-safe base64): unguessable, so its URL is its key."""
BACKLOG = 4096
"""Connections the kernel completes and queues while the loop is busy elsewhere (the listen
backlog; Linux caps it at net.core.somaxconn, 4096 by default). Every episode's own client
connects at its first call, so a batch of new episodes is a burst of connects; past aiohttp's
default of 128 the kernel drops the SYNs and each client retries after 1 s, then 3 s."""

CURRENT: contextvars.ContextVar[Endpoint | None] = contextvars.ContextVar("areal_aio_endpoint", default=None)
"""The endpoint of the run whose task this is (set by `serving`, inherited by the run's tasks)."""


class Answered(Protocol):
    """Who counts the endpoint's answers: the run's counts (control/stats.py Counts), handed in
    by the controller; the endpoint never imports the controller."""

    def answered(self, status: int) -> None:
        """A chat completion answered (200), or any request answered with an error (`status`)."""


class _Uncounted:
    """The counts of an endpoint started on its own (a test, a benchmark): none kept."""

    def answered(self, status: int) -> None:
        pass


@dataclass(slots=True)
class Served:
    """One episode being served: its conversation, its lock (one reply at a time) and its
    handlers in flight or waiting."""

    conversation: Conversation
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    handlers: set[asyncio.Task] = field(default_factory=set)
    ended: bool = False


class Endpoint:
    """The server and the episodes it serves (by id)."""

    def __init__(self, settings: EndpointSettings, key: str = "", counts: Answered | None = None) -> None:
        self.settings = settings
        self.key = key
        self._authorization = f"Bearer {key}".encode()  # the header a request must carry (key set)
        self.counts = counts if counts is not None else _Uncounted()  # its answers: the run's counts
        self.port = 0
        self.root = ""  # http://host:port, set by start
        self.live: dict[str, Served] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listen; `root` is known from here on (a wildcard host named by this machine's name,
        looked up once, in a thread: getfqdn may ask DNS, which would block the loop)."""
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[self._errors])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/{episode}/v1/models", self._models)
        app.router.add_post("/{episode}/v1/chat/completions", self._chat)
        app.router.add_post("/{episode}/reward", self._reward)
        self._runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, access_log=None,
                                     logger=self._server_log())
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port, backlog=BACKLOG)
        await site.start()
        self.port = self._runner.addresses[0][1]
        host = self.settings.host
        if host in ("0.0.0.0", "::", ""):
            host = await asyncio.get_running_loop().run_in_executor(None, socket.getfqdn)
        self.root = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    async def stop(self) -> None:
        """Close the server: every episode's calls in flight end (their replies aborted)."""
        for served in list(self.live.values()):
            self._end(served)
        if self._runner is not None:
            await self._runner.cleanup()

    @contextlib.contextmanager
    def episode(self, model: Model) -> Iterator[str]:
        """Serve `model` while the block runs: its base_url set, its id live; at the end the id
        is ended (410) and its calls in flight are cancelled."""
        eid = secrets.token_urlsafe(ID_BYTES)
        served = self.live[eid] = Served(Conversation(model, self.settings.model_name, eid[:8]))
        model.base_url, model.api_key = f"{self.root}/{eid}/v1", self.key
        model.model_name = self.settings.model_name
        try:
            yield eid
        finally:
            del self.live[eid]
            self.ended[eid] = None
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
            self._end(served)

    def _server_log(self) -> logging.Logger:
        """The logger aiohttp reports a request it could not parse to (a request line or a header
        past 8,190 bytes, a malformed request: aiohttp answers it 400 itself): counted as that
        client error, its traceback printed nowhere (it is aiohttp's, not a bug of ours); any
        other report goes to the loop's exception handler, as a handler's bug does."""
        log = logging.Logger("areal_aio.endpoint.server")  # its own: never the process's hierarchy
        log.addHandler(_ServerReports(self.counts))
        return log

    @staticmethod
    def _end(served: Served) -> None:
        served.ended = True
        for task in served.handlers:
            task.cancel()

    # ------------------------------------------------------------------ handlers

    def _served(self, request: web.Request) -> Served:
        eid = request.match_info["episode"]
        served = self.live.get(eid)
        if served is not None:
            return served
        if eid in self.ended:
            raise ChatError(410, "this episode has ended; its URL takes no more calls", code="episode_ended")
        raise ChatError(404, "no episode with this id is being served", code="episode_not_found")

    async def _chat(self, request: web.Request) -> web.Response:
        self._check_key(request)
        served = self._served(request)
        if len(served.handlers) >= self.settings.max_concurrent:
            raise ChatError(429, f"more than endpoint.max_concurrent = {self.settings.max_concurrent} calls "
                                 f"of this episode at once", code="too_many_requests", kind="rate_limit_error")
        task = asyncio.current_task()
        served.handlers.add(task)
        try:
            ask = ChatRequest.parse(await _json(request), self.settings.model_name, served.conversation.known)
            async with served.lock:
                body = await served.conversation.complete(ask)
        except asyncio.CancelledError:
            if served.ended and task.uncancel() == 0:  # the episode ended under it: say so
                raise ChatError(410, "the episode ended during this call", code="episode_ended") from None
            raise  # the client went away (or the server stops): the reply was aborted
        finally:
            served.handlers.discard(task)
        self.counts.answered(200)
        return _response(body)

    async def _models(self, request: web.Request) -> web.Response:
        self._check_key(request)
        if "episode" in request.match_info:
            self._served(request)
        name = self.settings.model_name
        return _response({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                      "owned_by": "areal_aio"}]})

    async def _reward(self, request: web.Request) -> web.Response:
        self._check_key(request)
        served = self._served(request)
        body = await _json(request)
        reward = body.get("reward") if isinstance(body, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ChatError(400, "the body must be {\"reward\": <number>}", param="reward")
        if not served.conversation.model.post_reward(float(reward)):
            raise ChatError(409, "this episode's reward was posted already", code="reward_posted")
        return _response({"ok": True})

    def _check_key(self, request: web.Request) -> None:
        """401 unless the request carries the key (compared in constant time: no timing says
        how much of a guess was right)."""
        if self.key and not secrets.compare_digest(
                request.headers.get("Authorization", "").encode(errors="replace"), self._authorization):
            raise ChatError(401, "a missing or wrong API key", code="invalid_api_key",
                            kind="authentication_error")

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every failure as OpenAI's error JSON, counted: the request's own (ChatError), aiohttp's
        (413 past max_body_bytes, 404 / 405 for another path or method) and a bug (500, whose
        traceback goes to the loop's exception handler, never to the client)."""
        try:
            return await handler(request)
        except ChatError as exc:
            error = exc
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = "request_too_large" if exc.status == 413 else None
            error = ChatError(exc.status, exc.reason if exc.status != 413 else
                              f"the body is larger than endpoint.max_body_bytes = {self.settings.max_body_bytes}",
                              code=code)
        except Exception as exc:  # noqa: BLE001 - a bug here must not take the run down with it
            asyncio.get_running_loop().call_exception_handler(
                {"message": "areal_aio endpoint: a request failed", "exception": exc})
            error = ChatError(500, f"internal error: {type(exc).__name__}", kind="server_error")
        self.counts.answered(error.status)
        return _response(error.body(), error.status)


class _ServerReports(logging.Handler):
    """aiohttp's own reports (Endpoint._server_log): a request it could not parse is a counted
    client error; anything else reaches the loop's exception handler."""

    def __init__(self, counts: Answered) -> None:
        super().__init__()
        self.counts = counts

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500:
            self.counts.answered(exc.code or 400)
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to report to
            asyncio.get_running_loop().call_exception_handler(
                {"message": f"areal_aio endpoint: {record.getMessage()}", "exception": exc})


async def _json(request: web.Request):
    """The request's JSON body, or ChatError (aiohttp raises 413 itself past client_max_size)."""
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise ChatError(400, "the body is not valid JSON") from None


def _response(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def key_of(settings: EndpointSettings) -> str:
    """The API key clients must send: the environment variable endpoint.key_env names ("" when
    it names none; SettingsError when it is unset or empty)."""
    if not settings.key_env:
        return ""
    key = os.environ.get(settings.key_env, "")
    if not key:
        raise SettingsError(f"endpoint.key_env: the environment variable {settings.key_env} is unset or empty")
    return key


@contextlib.asynccontextmanager
async def serving(settings: EndpointSettings, episodes: bool, counts: Answered) -> AsyncIterator[Endpoint | None]:
    """Serve the endpoint for the block (an episode run with endpoint.enabled; else None): the
    tasks created in it find it through CURRENT; its answers are counted in `counts`."""
    if not (episodes and settings.enabled):
        yield None
        return
    endpoint = Endpoint(settings, key_of(settings), counts)
    await endpoint.start()
    token = CURRENT.set(endpoint)
    try:
        yield endpoint
    finally:
        CURRENT.reset(token)
        await endpoint.stop()


@contextlib.contextmanager
def served(model: Model) -> Iterator[None]:
    """Serve `model` through the current run's endpoint while the block runs (no endpoint: as is)."""
    endpoint = CURRENT.get()
    if endpoint is None:
        yield
        return
    with endpoint.episode(model):
        yield
