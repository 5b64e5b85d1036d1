"""ServerContext: what every route shares (client, settings, gate, metrics) and the steps generation routes take.

Handlers get it with `ctx: Ctx` (a FastAPI dependency reading `app.state.ctx`) and only translate:
check the model, set the deadline, get the prompt (the client tokenizes it off the event loop and admits it where its
ids are first known: admission.py), size the token budget from its length, start an `EngineRun` (whose client checks
each request's parameters). A chat decides here, once for every front, where it runs: on the engine, or on the
transformers VLM beside it (vlm_chat.py) when it holds images the engine's model cannot take.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from minisgl_cli import harmony
from minisgl_cli.admission import AdmissionError, new_tokens
from minisgl_cli.api import protocol as p
from minisgl_cli.client.protocol import EngineClient
from minisgl_cli.media.service import MediaService
from minisgl_cli.media.settings import MediaSettings
from minisgl_cli.server import tools, vlm_chat
from minisgl_cli.server.choices import ChoiceStream
from minisgl_cli.server.deadline import Deadline
from minisgl_cli.server.errors import InputError, admission_error, coded_error
from minisgl_cli.server.gate import InflightGate
from minisgl_cli.server.metrics import ServerMetrics
from minisgl_cli.server.reasoning import HarmonySplit, ReasoningSplit, new_split, resolve_parser
from minisgl_cli.server.runs import EngineRun
from minisgl_cli.server.settings import ServerSettings, VisionSettings
from minisgl_cli.types import Delta, GenerateRequest, Prompt, SchedulerStats, new_request_id
from minisgl_cli.vision.image_source import ImageError, ImagePolicy, load_image_url

if TYPE_CHECKING:
    from minisgl_cli.vision.vlm import VlmChat

log = logging.getLogger("minisgl.server")


def has_images(messages: list[p.ChatMessage]) -> bool:
    return any(isinstance(m, p.UserMessage) and m.images for m in messages)


def chat_with_images(messages: list[p.ChatMessage], policy: ImagePolicy) -> list[dict]:
    """The chat as templates take it, image parts read under `policy` into PIL images (an ImageError names the
    part it is about)."""
    out = []
    for i, m in enumerate(messages):
        d = m.as_template_dict()
        if isinstance(m, p.UserMessage) and isinstance(m.content, list) and m.images:
            d["content"] = [
                {"type": "text", "text": part.text} if isinstance(part, p.TextPart) else
                {"type": "image", "image": load_image_url(part.image_url.url, policy,
                                                          f"messages.{i}.content.{j}.image_url.url")}
                for j, part in enumerate(m.content)]
        out.append(d)
    return out


@dataclass
class ChatRun:
    """A started chat (n choices): its run, how its output is read (`how`: None, "auto", "required" or
    "named:<tool>", as tools.parse takes it), its tools' names, the downscale note, its prompt's length, the
    reasoning parser its replies go through (None: none), the name of the model that answers it (the served
    model's, or the VLM's beside the engine), and the start of its replies the prompt wrote (harmony's forced call)."""

    run: EngineRun
    how: str | None
    names: set[str]
    note: str | None
    prompt_tokens: int
    reasoning: str | None
    model: str
    prefill: str = ""

    def split(self) -> ReasoningSplit | HarmonySplit | None:
        """A new split of one reply's thoughts from its content (None without a parser)."""
        return new_split(self.reasoning, self.prefill) if self.reasoning else None

    def reply(self, text: str, parallel: bool | None) -> tuple[str | None, str | None, list[tools.Call]]:
        """A whole reply (a non-streamed choice) as (thoughts or None, content, tool calls): the thoughts split off
        first, then the calls parsed from the content only (harmony's: its commentary channel's; where the request
        takes no tool calls, their text stays in the content)."""
        split = self.split()
        thoughts, text = split.split(text) if split else (None, text)
        if isinstance(split, HarmonySplit):
            found = split.take_calls()
            if self.how is None:
                return thoughts, text + "".join(harmony.call_text(*c) for c in found), []
            calls = tools.harmony_calls(found, parallel)
            return thoughts, text if text or not calls else None, calls
        content, calls = tools.parse(self.how, text, self.names, parallel) if self.how else (text, [])
        return thoughts, content, calls

    async def deltas(self, first: tuple[int, Delta] | None, parallel: bool | None) \
            -> AsyncIterator[tuple[Delta, list[dict[str, Any]]]]:
        """A streamed one-choice reply from its first event on: each delta with its chunk contents (ChoiceStream's,
        which each front writes as its own events); an error delta comes with none, and ends it."""
        choice = ChoiceStream(self.how, self.names, parallel, split=self.split())
        event = first
        while event is not None:
            d = event[1]
            if d.error:
                yield d, []
                return
            yield d, choice.feed(d)
            event = await self.run.next()


@dataclass
class ServerContext:
    client: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    gate: InflightGate
    model_name: str  # the served name (answers /v1/models)
    aliases: frozenset[str]  # lower-cased names a request's `model` may use
    created: int = field(default_factory=p.now)
    active: set[EngineRun] = field(default_factory=set)  # runs not yet closed, aborted at shutdown
    vlm: VlmChat | None = None  # chat requests with images (server/vlm_chat.py); None: they get a 400
    # The media worker's client (its process starts on the first image / video request); set by `create`.
    media: MediaService = field(default_factory=lambda: MediaService(MediaSettings()))
    reasoning: str | None = None  # the reasoning parser of chat replies (server/reasoning.py); None: no split

    @classmethod
    def create(cls, client: EngineClient, settings: ServerSettings) -> ServerContext:
        info = client.info
        name = settings.served_model_name or info.name
        aliases = frozenset({name.lower(), info.name.lower(), *(a.lower() for a in settings.extra_model_aliases)})
        metrics = ServerMetrics()
        vlm = settings.vision.vlm_chat() if settings.vision else None
        media = MediaService(settings.media or MediaSettings.from_env())
        return cls(client, settings, metrics, InflightGate(settings, info.max_running, metrics), name, aliases, vlm=vlm,
                   media=media, reasoning=resolve_parser(settings.reasoning_parser, info.model_dir))

    # --- the steps of every generation route ---
    def check_model(self, requested: str | None) -> None:
        if requested and requested.lower() not in self.aliases:
            raise InputError(f"model {requested!r} does not exist; this server serves {self.model_name!r}",
                             "model", 404, "model_not_found")

    def deadline(self, requested: float | None) -> Deadline:
        """The request's deadline, from now: its `timeout`, else the server's --request-timeout (0: none). A
        request may shorten the server's, not lengthen it (a 400 naming `timeout`)."""
        limit = self.settings.request_timeout_s or None
        if requested is not None and limit is not None and requested > limit:
            raise InputError(f"timeout: {requested:g} s is longer than this server allows ({limit:g} s: "
                             "--request-timeout)", "timeout")
        return Deadline(requested or limit)

    async def prompt_of(self, deadline: Deadline, prompt: str | list[int] | None = None,
                        messages: list[p.ChatMessage] | None = None, param: str = "prompt",
                        tools: list[p.Tool] | None = None, images: bool = False,
                        template_kwargs: dict[str, Any] | None = None) -> Prompt:
        """The prompt (chat template applied to messages and tools), tokenized and admitted by the client: a 400 naming
        `param` where it cannot run. With `images`, the images of a chat for a model on the engine that takes them
        (`info.images`); without, image parts are refused."""
        if messages is not None and has_images(messages) and not images:
            raise InputError("image parts are served by the chat routes only (/v1/chat/completions, /v1/messages, "
                             "/v1/responses, /api/chat)", param)
        try:
            if messages is not None:
                chat = await self._read_images(messages, deadline) if has_images(messages) else \
                    [m.as_template_dict() for m in messages]
                req = GenerateRequest(messages=chat, tools=[t.model_dump(exclude_none=True) for t in tools]
                                      if tools else None, prompt_param=param, template_kwargs=template_kwargs)
            elif isinstance(prompt, list):
                req = GenerateRequest(input_ids=prompt, prompt_param=param)
            else:
                req = GenerateRequest(prompt=prompt or "", prompt_param=param)
            return await deadline.wait(self.client.prompt(req))
        except AdmissionError as exc:
            raise admission_error(exc) from None
        except InputError:
            raise
        except Exception as exc:
            # The engine gone (503), the deadline passed (504): not the input's fault. Template or tokenizer failures
            # are.
            if (error := coded_error(exc, self.gate.retry_after_s)) is not None:
                raise error from None
            raise InputError(f"could not tokenize the {param}: {exc}", param) from exc

    async def _read_images(self, messages: list[p.ChatMessage], deadline: Deadline) -> list[dict]:
        """The chat as templates take it, its images read under the server's policy off the event loop (files,
        remote fetches, decoding): a 400 naming the part that cannot be read."""
        policy = (self.settings.vision or VisionSettings()).images
        try:
            return await deadline.wait(asyncio.get_running_loop().run_in_executor(
                None, chat_with_images, messages, policy))
        except ImageError as exc:
            raise InputError(exc.message, exc.param) from None

    def budget(self, prompts: list[Prompt], requested: int | None, param: str,
               prompt_param: str = "prompt") -> tuple[int, str | None]:
        """max_new_tokens for the run (`param`: the field that asked) from its prompts' lengths, and the downscale note
        (None if not applied). The prompts are admitted: each fits the context (`prompt_param` names one that would
        not, for new_tokens' sake)."""
        try:
            requested = new_tokens(max(pr.tokens for pr in prompts), requested, self.client.info.max_context_len,
                                   param, prompt_param=prompt_param)
        except AdmissionError as exc:
            raise admission_error(exc) from None
        cut = self.gate.downscale(requested)
        return (cut, f"{requested}->{cut}") if cut < requested else (requested, None)

    def start(self, reqs: list[GenerateRequest], endpoint: str, deadline: Deadline,
              user: str | None = None) -> EngineRun:
        """Start the requests (429 past the cap) under `deadline`; the client checks each one's parameters (a refusal
        is the run's first event, a 400 with its field); `user` (the request's end-user id) is logged."""
        self.gate.take(len(reqs))
        if log.isEnabledFor(logging.INFO):
            for r in reqs:
                assert r.tokenized is not None  # the routes tokenize before they start a run
                log.info("rid=%s %s admitted: prompt_tokens=%d max_new_tokens=%d temperature=%s inflight=%d%s",
                         r.rid, endpoint, r.tokenized.tokens, r.params.max_new_tokens, r.params.temperature,
                         self.gate.inflight, f" user={user!r}" if user else "")
        return EngineRun(self.client, reqs, self.gate, self.metrics, endpoint, self.active, deadline)

    def beside_engine(self, body: p.ChatCompletionRequest) -> bool:
        """Whether a chat runs on the VLM beside the engine (vlm_chat.py): it holds images the engine's model cannot
        take (a Qwen2-VL / Qwen2.5-VL engine takes them itself)."""
        return body.has_images and not self.client.info.images

    async def start_chat(self, body: p.ChatCompletionRequest, endpoint: str, rid_prefix: str,
                         user: str | None = None) -> ChatRun:
        """Every step of a chat request (the chat completions route's, and those of the fronts that translate onto
        it): model, deadline, template with tools, budget, grammar of forced tool calls, start; on the engine, or on
        the VLM beside it (`beside_engine`)."""
        if body.reasoning_effort is not None and self.reasoning is None:
            raise InputError("reasoning_effort: this server runs no reasoning parser for its model "
                             "(--reasoning-parser)", "reasoning_effort")
        if self.beside_engine(body):
            return await self._start_vlm(body, endpoint, rid_prefix, user)
        self.check_model(body.model)
        deadline = self.deadline(body.timeout)
        mode = body.tool_mode
        template_kwargs, prefill, forced_choice = body.chat_template_kwargs, "", None
        if self.reasoning == "harmony":
            # a forced call: the prompt ends inside it (the model's own format), the parser reads on from there
            if mode in ("named", "required"):
                forced_choice = body.tool_choice.model_dump() if mode == "named" else mode  # type: ignore[union-attr]
                template_kwargs = {**(template_kwargs or {}), "tool_choice": forced_choice}
            prefill = harmony.forced_call((template_kwargs or {}).get("tool_choice"))
        prompt = await self.prompt_of(deadline, messages=body.messages, param="messages",
                                      tools=body.tools if mode else None, images=True,
                                      template_kwargs=template_kwargs)
        max_new, note = self.budget([prompt], body.requested_max_tokens, "max_tokens", "messages")
        structured = body.structured()
        if mode in ("named", "required"):
            if structured:
                raise InputError(f"tool_choice {mode} already constrains the output: drop response_format / regex / "
                                 "ebnf", "tool_choice")
            structured = tools.forced_grammar(body, harmony_choice=forced_choice)
        # Not streamed: the text is needed only at the end, decoded once there (stream_text), not token by token.
        extra = dict(logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0, stream_text=bool(body.stream),
                     **structured)
        if self.reasoning == "harmony":  # its channel markers are special tokens: the parser reads them in the text
            extra["skip_special_tokens"] = False
        vocab = self.client.info.vocab_size
        reqs = [GenerateRequest(tokenized=prompt, params=body.sampling_params(max_new, i, vocab, extra),
                                rid=new_request_id(rid_prefix), prompt_param="messages")
                for i in range(body.n)]
        run = self.start(reqs, endpoint, deadline, user)
        names = {t.function.name for t in body.tools or []}
        how = f"named:{body.tool_choice.function.name}" if mode == "named" else mode  # type: ignore[union-attr]
        return ChatRun(run, how, names, note, prompt.tokens, self.reasoning, self.model_name, prefill)

    async def vlm_prompt(self, body: p.ChatCompletionRequest) -> vlm_chat.VlmPrompt:
        """A chat with images, checked and prepared for the VLM beside the engine: a 400 where the server has none
        (or the chat asks what it cannot do), a 404 for another model's name."""
        vlm = self.vlm
        if vlm is None:
            raise InputError(f"this request has images, but {self.model_name} takes text only and no vision-language "
                             "model runs beside it: start `minisgl serve` with --vlm-model PATH (or set "
                             "MINISGL_VLM_MODEL), or serve a Qwen2-VL / Qwen2.5-VL model as --model", "messages",
                             code="vlm_not_loaded")
        if body.model and body.model.lower() not in self.aliases | {vlm.name.lower()}:
            raise InputError(f"model {body.model!r} does not exist; this server's vision-language model is "
                             f"{vlm.name!r}", "model", 404, "model_not_found")
        vlm_chat.refuse(body)
        # Reading the images and preparing count toward the deadline; only the generation is cut short by it.
        chat = await self._read_images(body.messages, Deadline(None))
        return await vlm_chat.prepare_chat(vlm, chat, body.chat_template_kwargs)

    async def _start_vlm(self, body: p.ChatCompletionRequest, endpoint: str, rid_prefix: str,
                         user: str | None) -> ChatRun:
        """start_chat on the VLM beside the engine: one reply, streamed by an EngineRun from the prepared chat."""
        deadline = self.deadline(body.timeout)
        prompt = await self.vlm_prompt(body)
        requested = prompt.budget(body.requested_max_tokens)
        max_new = self.gate.downscale(requested)
        note = f"{requested}->{max_new}" if max_new < requested else None
        req = prompt.request(body.sampling_params(max_new), new_request_id(rid_prefix))
        self.gate.take(1)
        log.info("rid=%s %s admitted (VLM %s): prompt_tokens=%d images=%d max_new_tokens=%d inflight=%d%s", req.rid,
                 endpoint, prompt.name, prompt.prompt_tokens, prompt.prepared.images, max_new, self.gate.inflight,
                 f" user={user!r}" if user else "")
        run = EngineRun(prompt, [req], self.gate, self.metrics, endpoint, self.active, deadline)
        return ChatRun(run, None, set(), note, prompt.prompt_tokens, None, prompt.name)

    # --- what the other routes read ---
    def model_card(self) -> p.ModelCard:
        return p.ModelCard(id=self.model_name, created=self.created, max_model_len=self.client.info.max_context_len)

    def metrics_json(self, stats: SchedulerStats) -> dict[str, Any]:
        return {**self.metrics.to_json(stats, self.model_name, self.gate.cap, self.client.info),
                "media": self.media.metrics()}

    async def shutdown(self) -> None:
        """Abort the requests still in flight while this event loop still takes the scheduler's replies
        (a reply into a closed loop would break the scheduler thread, which may outlive the app)."""
        rids = [rid for run in list(self.active) if run.client is self.client for rid in run.unfinished_rids()]
        for rid in rids:
            self.client.abort(rid)
        for run in list(self.active):
            run.close()
        if rids:
            await asyncio.get_running_loop().run_in_executor(
                None, self.client.stats
            )  # returns once the scheduler has processed the aborts


async def server_context(request: Request) -> ServerContext:
    # async: FastAPI would run a plain def dependency on the thread pool, a hop per request for nothing.
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(server_context)]
