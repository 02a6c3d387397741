"""lcap's policy endpoints: each dialect served by vLLM's own handlers, with exact tokens and stitched prompts.

`/lcap/v1/chat/completions`, `/lcap/v1/messages` and `/lcap/v1/responses` (HTTP, and WebSocket for
Responses) take the agent's request as vLLM's own endpoints do and answer the same bytes, through
the same handler objects vLLM built (its chat handler, its Anthropic handler, its Responses
handler: same template, same tool and reasoning parsers, same streaming events). What lcap adds:

- adaptation (lcap_policy.adapt): what vLLM would refuse is made servable, and said so;
- exact tokens: the turn's prompt ids, sampled ids and their logprobs, for every dialect. Chat and
  Messages ask vLLM's chat path for them (`return_token_ids`, `logprobs`) and take them out of what
  the agent gets unless it asked; Responses reads them from the engine's outputs, which vLLM's
  Responses handler does not pass on;
- stitching (lcap_policy.stitch): when the request extends the conversation's previous turn, its
  prompt is that turn's exact ids plus the rendered suffix, handed to vLLM as prompt ids
  (`kv_transfer_params.prompt_token_ids`, vLLM's own way to skip templating and tokenization);
- `previous_response_id` (lcap_policy.responses_store): resolved from lcap's own bounded store of the
  responses it served, into the whole conversation stitched onto the previous turn's exact ids.

The wire format towards lcap's proxy is lcap_policy.wire; what lcap learns of one call is lcap_policy.turn's `Turn`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Body, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse
from vllm.entrypoints.openai.responses.utils import (
    construct_chat_messages_with_tool_call,
    construct_input_messages,
    construct_tool_dicts,
)
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.utils.api_utils import load_aware_call, with_cancellation
from vllm.renderers.params import merge_kwargs
from vllm.sampling_params import RequestOutputKind

from lcap_policy import adapt, responses_store, stitch, wire
from lcap_policy.turn import Turn, dumps

log = logging.getLogger("lcap_policy")
router = APIRouter()
_DONE = "data: [DONE]"
_RESPONSE_END = ("response.completed", "response.incomplete", "response.failed")


class Policy:
    """The handlers vLLM built, and what lcap does around them."""

    def __init__(self, state: Any) -> None:
        self.chat = state.openai_serving_chat
        self.messages = state.anthropic_serving_messages
        self.renderer = state.online_renderer
        self.max_model_len = int(self.renderer.model_config.max_model_len)
        self.tokenizer = self.renderer.renderer.get_tokenizer()
        self.stop_ids = self._stop_ids()
        reasoning = getattr(state.vllm_config, "reasoning_config", None)
        self.thinking_budgets = bool(reasoning is not None and getattr(reasoning, "enabled", False))
        self.taps: dict[str, Turn] = {}  # Responses request id -> its turn, while it runs
        self.stored = responses_store.from_env(dict(os.environ))  # responses a later call may continue
        # A copy of vLLM's Responses handler (sharing its stores) whose engine loop also feeds lcap's turn.
        self.responses = copy.copy(state.openai_serving_responses)
        if self.responses is not None:
            generate = self.responses._generate_with_builtin_tools
            self.responses._generate_with_builtin_tools = self._tapped(generate)

    def _stop_ids(self) -> frozenset[int]:
        """Added tokens that end a turn: the ones the template writes after every message (stitching needs them)."""
        tok = self.tokenizer
        special = set(getattr(tok, "all_special_ids", ()) or ()) | set((tok.get_added_vocab() or {}).values())
        eos = self.renderer.model_config.hf_config
        ids = {*_ids(getattr(tok, "eos_token_id", None)), *_ids(getattr(eos, "eos_token_id", None))}
        generation = self.renderer.model_config.get_diff_sampling_param().get("stop_token_ids") or ()
        ids.update(generation)
        try:  # the generation config's eos ids, which vLLM stops on too (e.g. <|endoftext|> beside <|im_end|>)
            gen_eos = self.renderer.model_config.try_get_generation_config().get("eos_token_id")
        except Exception:  # a config that cannot be read: only the tokenizer's and the model's eos then
            gen_eos = None
        ids.update(_ids(gen_eos))
        return frozenset(i for i in ids if i in special)

    def new_turn(self, dialect: str) -> Turn:
        return Turn(dialect, stop_ids=self.stop_ids, max_model_len=self.max_model_len)

    def _tapped(self, generate):
        policy = self

        async def tapped(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
            request_id = kwargs.get("request_id", args[0] if args else None)
            turn = policy.taps.get(request_id) if isinstance(request_id, str) else None
            params: Any = kwargs.get("sampling_params") if "sampling_params" in kwargs else args[2]
            if turn is not None and params.logprobs is None:
                params.logprobs = 0  # the sampled token's logprob only; the answer shows none unless asked
            delta = params.output_kind == RequestOutputKind.DELTA
            async for context in generate(*args, **kwargs):
                if turn is not None and getattr(context, "last_output", None) is not None:
                    turn.take_engine_output(context.last_output, delta)
                yield context

        return tapped

    # --- adaptation and stitching ---

    def begin(self, dialect: str, body: dict) -> tuple[Turn, dict]:
        options = body.pop(wire.REQUEST_KEY, None)
        options = options if isinstance(options, dict) else {}
        turn = self.new_turn(dialect)
        if options.get("adapt", True):
            turn.requested, turn.adapted = adapt.adapt(
                dialect, body, self.max_model_len, thinking_budgets=self.thinking_budgets
            )
        turn.limits = {name: body.get(name) for name in adapt.LIMIT_FIELDS[dialect]}
        temperature = options.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
            turn.adapted.append(adapt.override_temperature(body, float(temperature)))
        return turn, options

    async def prepare(
        self, turn: Turn, request: Any, messages: list, tool_dicts: list | None, template_kwargs: dict, options: dict
    ) -> None:
        """Digest the request for the next turn's match; stitch it onto the head it was sent with, if it extends it."""
        params = request.build_chat_params(self.renderer.chat_template, self.renderer.chat_template_content_format)
        params = params.with_defaults(merge_kwargs(template_kwargs, dict(tools=tool_dicts, tokenize=False)))
        shaping = {k: v for k, v in params.chat_template_kwargs.items() if k not in ("add_generation_prompt",)}
        turn.context = stitch.digest([params.chat_template, shaping])
        turn.n, turn.digests = len(messages), stitch.message_digests(messages)
        offered = options.get("head")
        if offered is None or not options.get("stitch", True):
            return
        try:
            why = await self._stitch(turn, request, messages, params, offered)
        except Exception as exc:  # stitching is an optimisation of the prompt: never the reason a call fails
            log.exception("lcap: stitching failed")
            why = f"stitching failed: {exc.__class__.__name__}: {exc}"
        turn.stitched, turn.note = why is None, why

    async def _stitch(self, turn: Turn, request: Any, messages: list, params: Any, offered: Any) -> str | None:
        if self.renderer.use_harmony:
            return "gpt-oss (harmony) prompts are not stitched"
        try:
            head = stitch.Head.parse(offered)
        except ValueError as exc:
            return str(exc)
        end, why = stitch.match(head, messages, turn.context)
        if end is None:
            return why
        assert head.stop is not None
        if head.stop not in self.stop_ids:
            return f"token {head.stop} is not a stop token of this model"
        prefix_kwargs = {**params.chat_template_kwargs, "add_generation_prompt": False, "continue_final_message": False}
        prefix_text = await self._render(messages[:end], replace(params, chat_template_kwargs=prefix_kwargs))
        full_text = await self._render(messages, params)
        # The token the template ends a message with: the model's own stop token, or (when the model stopped on
        # another of its stop tokens, e.g. <|endoftext|>) the stop token the template writes in its place.
        end_id = next(
            (i for i in [head.stop, *sorted(self.stop_ids - {head.stop})] if self.tokenizer.decode([i]) in prefix_text),
            head.stop,
        )
        prompt_stops = head.ids[: head.prompt_len].count(end_id)
        rest, why = stitch.suffix_text(prefix_text, full_text, self.tokenizer.decode([end_id]), prompt_stops)
        if rest is None:
            return why
        ids, why = stitch.stitched_ids(head, self.tokenizer.encode(rest, add_special_tokens=False), self.max_model_len)
        if ids is None:
            return why
        request.kv_transfer_params = {**(request.kv_transfer_params or {}), "prompt_token_ids": ids}
        return None

    async def _render(self, messages: list, params: Any) -> str:
        _, prompt = await self.renderer.renderer.render_messages_async(messages, params)
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str):
            raise ValueError("the template did not render to text")
        return text

    def _tool_dicts(self, request: ChatCompletionRequest) -> list | None:
        if request.tools is None or (
            request.tool_choice == "none" and self.renderer.exclude_tools_when_tool_choice_none
        ):
            return None
        return [tool.model_dump() for tool in request.tools]

    # --- chat completions and Messages (vLLM's chat path) ---

    async def serve_chat(self, body: dict, raw_request: Request) -> Response:
        turn, options = self.begin(adapt.CHAT, body)
        request = _validate(ChatCompletionRequest, body)
        asked_ids, asked_logprobs = bool(request.return_token_ids), bool(request.logprobs)
        request.return_token_ids, request.logprobs = True, True
        tools = self._tool_dicts(request)
        await self.prepare(turn, request, request.messages, tools, self.renderer.default_chat_template_kwargs, options)
        result = await self.chat.create_chat_completion(request, raw_request)
        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code)

        def shown(obj: dict) -> dict:
            turn.take_chat(obj)
            if not asked_ids:  # the fields lcap asked for go, as lcap's proxy strips them on any vLLM
                obj.pop("prompt_token_ids", None)
                for choice in obj.get("choices") or ():
                    choice.pop("token_ids", None)
            if not asked_logprobs:
                for choice in obj.get("choices") or ():
                    choice["logprobs"] = None
            return obj

        if isinstance(result, ChatCompletionResponse):
            return _whole(dumps(shown(result.model_dump())), turn)

        async def events() -> AsyncIterator[str]:
            async for item in result:
                if item.startswith(_DONE):
                    yield _sse_trailer(turn)
                elif item.startswith("data: "):
                    item = f"data: {dumps(shown(json.loads(item[6:])))}\n\n"
                yield item

        return StreamingResponse(events(), media_type="text/event-stream")

    async def serve_messages(self, body: dict, raw_request: Request) -> Response:
        turn, options = self.begin(adapt.MESSAGES, body)
        request = _validate(AnthropicMessagesRequest, body)
        handler = self.messages
        effort = "none"
        if request.thinking is not None and request.thinking.type == "disabled":
            effort = await handler._get_disabled_thinking_effort()
        chat = handler.to_chat_completion_request(
            request, merge_inline_system=handler._merge_inline_system, disabled_thinking_effort=effort
        )
        chat.return_token_ids, chat.logprobs = True, True
        if isinstance(body.get("logit_bias"), dict):  # vLLM's sampling extension, which its Messages model drops
            chat.logit_bias = body["logit_bias"]
        await self.prepare(
            turn, chat, chat.messages, self._tool_dicts(chat), self.renderer.default_chat_template_kwargs, options
        )
        result = await handler.create_chat_completion(chat, raw_request)
        if isinstance(result, ErrorResponse):
            return _anthropic_error(result)
        if isinstance(result, ChatCompletionResponse):
            turn.take_chat(result.model_dump())
            return _whole(dumps(handler.messages_full_converter(result).model_dump(exclude_none=True)), turn)

        async def chat_events() -> AsyncIterator[str]:
            async for item in result:
                if item.startswith("data: ") and not item.startswith(_DONE):
                    turn.take_chat(json.loads(item[6:]))
                yield item

        async def events() -> AsyncIterator[str]:
            async for item in handler.message_stream_converter(chat_events()):
                if item.startswith("event: message_stop"):
                    yield _sse_trailer(turn)
                yield item

        return StreamingResponse(events(), media_type="text/event-stream")

    # --- Responses (vLLM's Responses handler, tapped) ---

    def resolve_previous(self, body: dict) -> tuple[str | None, ErrorResponse | None]:
        """A request naming `previous_response_id` becomes the whole conversation (in place): (the previous turn's
        head, None), or (None, a 404 saying why) when lcap's store does not have it."""
        previous = body.get("previous_response_id")
        if not isinstance(previous, str) or self.stored is None:
            return None, None
        stored, why = self.stored.get(previous)
        if stored is None:
            message = (
                f"previous_response_id {previous!r} is not in lcap's response store: {why}. It keeps "
                f"{self.stored.limits()} (lcap serve --responses-max, --responses-max-age, --responses-max-bytes); "
                "send the whole conversation as input instead"
            )
            log.warning("lcap: %s", message)
            error = create_error_response(
                message, "invalid_request_error", HTTPStatus.NOT_FOUND, "previous_response_id"
            )
            return None, error
        del body["previous_response_id"]
        body["input"] = [*stored.history, *responses_store.input_items(body.get("input"))]
        return stored.head, None

    def keep(self, turn: Turn, response: Any, head: str) -> None:
        """Keep a served response for a later call's `previous_response_id`: its input, output and head."""
        if self.stored is None or turn.history is None or response is None:
            return
        if isinstance(response, dict):
            response_id, output = response.get("id"), response.get("output") or []
        else:
            response_id = response.id
            output = [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in response.output]
        if isinstance(response_id, str):
            answer = responses_store.answer_items(output)
            self.stored.put(response_id, [*turn.history, *answer], head if head != "null" else None)

    async def responses_result(self, body: dict, raw_request: Request | None) -> tuple[Turn, Any]:
        previous_head, missing = self.resolve_previous(body)
        turn, options = self.begin(adapt.RESPONSES, body)
        if missing is not None:
            return turn, _Started("", missing)
        if previous_head is not None:  # the previous response's own head: exact, whatever the proxy offered
            options["head"] = json.loads(previous_head)
        turn.history = responses_store.input_items(body.get("input"))
        request = _validate(ResponsesRequest, body)
        if self.responses is None:
            raise RequestValidationError([{"msg": "the model does not support the Responses API"}])
        if request.previous_response_id is not None or request.background:
            turn.exact = not request.background
            turn.note = "previous_response_id or background: the history is vLLM's, not the request's"
        else:
            messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
            tools = construct_tool_dicts(
                request.tools,
                request.tool_choice,
                exclude_tools_when_tool_choice_none=self.renderer.exclude_tools_when_tool_choice_none,
            )
            template_kwargs = self.renderer.effective_chat_template_kwargs(request)
            await self.prepare(turn, request, messages, tools, template_kwargs, options)
        self.taps[request.request_id] = turn
        try:
            result = await self.responses.create_responses(request, raw_request)
        except BaseException:
            self.taps.pop(request.request_id, None)
            raise
        if isinstance(result, (ErrorResponse, ResponsesResponse)):  # done: only a stream still runs
            self.taps.pop(request.request_id, None)
        return turn, _Started(request.request_id, result)

    def finish(self, turn: Turn, response: Any) -> tuple[str, str]:
        """A finished Responses answer: its turn's record and head, the response kept for `previous_response_id`."""
        self.produced(turn, response)
        record, head = turn.trailer()
        self.keep(turn, response, head)
        return record, head

    def produced(self, turn: Turn, response: Any) -> None:
        """The assistant message(s) the agent got, as the Responses handler reads them back into chat messages."""
        try:
            output = response.output if not isinstance(response, dict) else ResponsesResponse(**response).output
            turn.produced = construct_chat_messages_with_tool_call(list(output))
        except Exception as exc:
            turn.produced, turn.digests = [], []  # no head: the next turn is not stitched onto this one
            turn.note = turn.note or f"the answer could not be read back: {exc}"

    async def response_events(self, turn: Turn, started: _Started) -> AsyncIterator[tuple[str, str]]:
        """(event type, JSON) of a streamed Responses answer, lcap's two parts before its last event."""
        try:
            async for event in started.result:
                kind = getattr(event, "type", "unknown")
                data = event.model_dump_json(indent=None, by_alias=True)
                if kind == "response.output_item.done":
                    payload = json.loads(data)
                    data = dumps({**payload, "item": responses_store.filled(payload["item"])})
                elif kind in _RESPONSE_END:
                    payload = json.loads(data)
                    answered = _answered(_public(payload["response"]))
                    added = _added_items(payload, answered["output"])
                    for extra in added:
                        yield extra["type"], dumps(extra)
                    sequence = payload.get("sequence_number", 0) + len(added)
                    data = dumps({**payload, "response": answered, "sequence_number": sequence})
                    record, head = self.finish(turn, getattr(event, "response", None))
                    yield wire.RECORD_EVENT, record
                    yield wire.HEAD_EVENT, head
                elif getattr(event, "response", None) is not None:
                    payload = json.loads(data)
                    data = dumps({**payload, "response": _public(payload["response"])})
                yield kind, data
        finally:
            self.taps.pop(started.request_id, None)


def _ids(value: Any) -> list[int]:
    """A config's token id or list of ids (or neither) as a list."""
    return value if isinstance(value, list) else [value] if isinstance(value, int) else []


@dataclass
class _Started:
    request_id: str
    result: Any


def _validate(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _public(response: dict) -> dict:
    """A Responses object without vLLM's own unset extensions (`input_messages`, `output_messages`): the
    OpenAI shape a harness expects, as lcap's proxy leaves it on any vLLM."""
    for name in ("input_messages", "output_messages"):
        if response.get(name) is None:
            response.pop(name, None)
    return response


def _answered(response: dict) -> dict:
    """A finished response as the harness gets it, its output as `responses_store.answer_items` makes it: the
    history a harness sends back then holds the turn that the model's exact ids end on, so it is stitched."""
    if response.get("status") != "completed":
        return response
    return {**response, "output": responses_store.answer_items(response.get("output") or [])}


def _added_items(end: dict, output: list) -> list[dict]:
    """The `output_item.added` and `.done` events of what `_answered` added to a streamed response, numbered
    before its end event: a harness that builds its history from the items streamed (Codex) gets them too."""
    start, sequence = len(end["response"].get("output") or []), end.get("sequence_number", 0)
    events = []
    for index, item in enumerate(output[start:], start):
        for kind in ("response.output_item.added", "response.output_item.done"):
            events.append({"type": kind, "item": item, "output_index": index, "sequence_number": sequence})
            sequence += 1
    return events


def _whole(answer: str, turn: Turn, parts: tuple[str, str] | None = None) -> Response:
    record, head = parts or turn.trailer()
    return Response(f"{answer}\n{record}\n{head}".encode(), media_type="application/json")


def _sse_trailer(turn: Turn) -> str:
    record, head = turn.trailer()
    return f"event: {wire.RECORD_EVENT}\ndata: {record}\n\nevent: {wire.HEAD_EVENT}\ndata: {head}\n\n"


def _anthropic_error(error: ErrorResponse) -> JSONResponse:
    body = {"type": "error", "error": {"type": error.error.type, "message": error.error.message}}
    return JSONResponse(body, status_code=error.error.code)


def _policy(request: Request | WebSocket) -> Policy:
    return request.app.state.lcap_policy


# --- routes -------------------------------------------------------------------------------------------


@router.get(wire.INFO_PATH)
async def info(raw_request: Request) -> JSONResponse:
    policy = _policy(raw_request)
    dialects = ["chat", "messages"] + (["responses"] if policy.responses is not None else [])
    stored = policy.stored
    responses = None if stored is None else {"kept": len(stored), "limits": stored.limits(), **stored.stats}
    return JSONResponse(
        {"version": wire.VERSION, "max_model_len": policy.max_model_len, "dialects": dialects, "responses": responses}
    )


@router.post(wire.PREFIX + "/v1/chat/completions")
@with_cancellation
@load_aware_call
async def chat_completions(body: dict = Body(...), *, raw_request: Request):  # noqa: B008 (FastAPI's idiom)
    return await _policy(raw_request).serve_chat(body, raw_request)


@router.post(wire.PREFIX + "/v1/messages")
@with_cancellation
@load_aware_call
async def messages(body: dict = Body(...), *, raw_request: Request):  # noqa: B008
    return await _policy(raw_request).serve_messages(body, raw_request)


@router.post(wire.PREFIX + "/v1/responses")
@with_cancellation
@load_aware_call
async def responses(body: dict = Body(...), *, raw_request: Request):  # noqa: B008
    policy = _policy(raw_request)
    turn, started = await policy.responses_result(body, raw_request)
    result = started.result
    if isinstance(result, ErrorResponse):
        return JSONResponse(result.model_dump(mode="json", by_alias=True), status_code=result.error.code)
    if isinstance(result, ResponsesResponse):
        parts = policy.finish(turn, result)
        return _whole(dumps(_answered(_public(result.model_dump(mode="json", by_alias=True)))), turn, parts)

    async def events() -> AsyncIterator[str]:
        async for kind, data in policy.response_events(turn, started):
            yield f"event: {kind}\ndata: {data}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@router.websocket(wire.PREFIX + "/v1/responses")
async def responses_socket(socket: WebSocket) -> None:
    """The Responses API over a WebSocket: a `response.create` frame in, its events out as frames, one response
    at a time. A frame with `generate: false` (a client warming the connection up) gets an empty response."""
    await socket.accept()
    policy = _policy(socket)
    try:
        while True:
            try:
                frame = json.loads(await socket.receive_text())
            except ValueError:
                await socket.send_text(_ws_error(_invalid("a frame that is not JSON")))
                continue
            if not isinstance(frame, dict) or frame.get("type") != "response.create":
                continue
            nested = frame.get("response")
            body = dict(nested) if isinstance(nested, dict) else {k: v for k, v in frame.items() if k != "type"}
            if wire.REQUEST_KEY in frame and isinstance(nested, dict):
                body[wire.REQUEST_KEY] = frame[wire.REQUEST_KEY]
            generate = body.pop("generate", True)
            if generate is False:
                body.pop(wire.REQUEST_KEY, None)
                _, missing = policy.resolve_previous(body)  # a warm-up may continue a conversation too
                if missing is not None:
                    await socket.send_text(_ws_error(missing.error))
                    continue
                events = _empty_response(body)
                if policy.stored is not None:  # a later call may continue it: what it was sent, no output
                    policy.stored.put(
                        events[-1]["response"]["id"], responses_store.input_items(body.get("input")), None
                    )
                for event in events:
                    await socket.send_text(dumps(event))
                continue
            body["stream"] = True
            try:
                await _ws_respond(socket, policy, body)
            except WebSocketDisconnect:
                raise
            except Exception as exc:  # what vLLM's HTTP handlers answer with a 400 (a prompt past the context)
                error = create_error_response(exc).error
                log.warning("lcap: a Responses WebSocket call got an error event (%s): %s", error.code, error.message)
                await socket.send_text(_ws_error(error))
    except WebSocketDisconnect:
        return


async def _ws_respond(socket: WebSocket, policy: Policy, body: dict) -> None:
    """One `response.create` frame's answer: its events as frames, lcap's two parts among them, or an error event."""
    try:
        turn, started = await policy.responses_result(body, None)
    except RequestValidationError as exc:
        await socket.send_text(_ws_error(_invalid(str(exc.errors()))))
        return
    if isinstance(started.result, ErrorResponse):
        await socket.send_text(_ws_error(started.result.error))
        return
    async for kind, data in policy.response_events(turn, started):
        if kind == wire.HEAD_EVENT:
            await socket.send_text(f'{{"type":"{wire.HEAD_EVENT}","head":{data}}}')
        elif kind == wire.RECORD_EVENT:
            await socket.send_text(f'{{"type":"{wire.RECORD_EVENT}",{data[1:]}')
        else:
            await socket.send_text(data)


def _ws_error(error: Any) -> str:
    """A Responses WebSocket `error` event (OpenAI's shape) of vLLM's error: the HTTP status the same call gets over
    HTTP, and the error itself."""
    body = {"type": error.type, "code": None, "message": error.message, "param": error.param}
    return dumps({"type": "error", "status": error.code, "error": body})


def _invalid(message: str) -> Any:
    return create_error_response(message, "invalid_request_error", HTTPStatus.BAD_REQUEST).error


def _empty_response(body: dict) -> list[dict]:
    import time
    import uuid

    response: dict[str, Any] = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model"),
        "status": "completed",
        "output": [],
        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
    }
    return [
        {"type": "response.created", "response": {**response, "status": "in_progress"}},
        {"type": "response.completed", "response": response},
    ]
