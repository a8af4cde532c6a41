"""Function calling on the Realtime API: the session's `tools` and `tool_choice`, the model's calls as
`function_call` output items, and tool results fed back as `function_call_output` items.

- `session.update` with `tools` (`[{"type": "function", "name", "description", "parameters"}]`, checked as chat
  completions checks them, `omnijax.serve.tool_calls`) and `tool_choice` ("auto" or "none"; "required" and a named
  function are checked, then refused as `unsupported`: nothing constrains decoding): the tools are rendered by the
  checkpoint's chat template at the conversation's start, so they can be set or changed only before anything is fed
  (later, an `error` naming `session.tools`); a template that does not render tools is refused by name. A refused
  update changes nothing.
- A response of a session with tools ("auto") reads its text with `omnijax.serve.tool_calls.ToolCallParser`: text
  before a call is the assistant message item (`response.output_text.delta` / `.done`); each call is a
  `function_call` item (`conversation.item.added`, `response.output_item.added`, its arguments as
  `response.function_call_arguments.delta` as they are decoded, then `.done`, `response.output_item.done`,
  `conversation.item.done`), all in `response.done`'s output. The answer's text stays in the conversation as the
  model wrote it.
- `conversation.item.create` of `{"type": "function_call_output", "call_id", "output"}` answering one of the
  session's calls is a tool message through the template; `response.create` then answers with it in context.
  A `call_id` the session never made is refused by name. Outputs are fed with whatever comes next (the response's
  prompt, an item, audio): Qwen-style templates put consecutive tool results in one user turn, so outputs in a row
  (the answers to parallel calls) are fed as that one turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

from omnijax.conversation import ChatTemplateError, ToolsUnsupported, template_delta
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.realtime import server_events as rse
from omnijax.serve.tool_calls import (
    ToolCallParser,
    ToolError,
    Tools,
    check_function,
    check_functions,
    parse_tool_choice,
)

if TYPE_CHECKING:
    from omnijax.serve.realtime.session import RealtimeSession

__all__ = ["ResponseOutput", "apply_tools", "flush_outputs", "function_output", "tools_of"]


def tools_of(settings: rte.SessionSettings) -> Tools:
    """The session's tools (`tool_choice` already checked to "auto" or "none")."""
    return Tools(tuple(settings.tools), settings.tool_choice, True)


def _named(choice: Any) -> Any:
    return choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None


def apply_tools(session: RealtimeSession, settings: rte.SessionSettings, eid: str | None) -> rte.SessionSettings:
    """Checks an updated session's `tool_choice` against its tools and gives the conversation the tools it renders;
    returns the settings with the choice as applied. Changes nothing when it refuses.

    Raises:
        RealtimeEventError: naming `session.tool_choice` or `session.tools`.
    """
    try:
        functions = check_functions([check_function(f, f"session.tools[{i}]") for i, f in enumerate(settings.tools)],
                                    "session.tools")
        choice = parse_tool_choice(settings.tool_choice, {f["name"] for f in functions}, "session.tool_choice",
                                   named=_named)
    except ToolError as e:
        raise rte.RealtimeEventError(e.code, str(e), event_id=eid, param=e.param) from None
    settings = dataclasses.replace(settings, tools=functions, tool_choice=choice)
    try:
        session.conversation.set_tools(tools_of(settings).template_tools())
    except ToolsUnsupported as e:
        raise rte.RealtimeEventError("unsupported", f"'session.tools': model {session.options.model_name!r} cannot "
                                     f"take them: {e}", event_id=eid, param="session.tools") from None
    except ChatTemplateError as e:
        raise rte.RealtimeEventError("unsupported", f"'session.tools': {e}", event_id=eid,
                                     param="session.tools") from None
    return settings


async def function_output(session: RealtimeSession, event: rte.FunctionCallOutput) -> None:
    """Takes a `function_call_output` item as the tool message answering its call. It is checked against the
    template now (a refusal changes nothing) but fed with what comes next (`flush_outputs`): the templates put tool
    results in a row in one user turn, so one's rendering changes once the next follows. The item is complete as
    given: `conversation.item.done` follows its `.added` at once."""
    eid = event.event_id
    session._check_placement(event)  # type: ignore[arg-type]  # the same placement fields as a message item
    if event.call_id not in session.call_ids:
        raise rte.RealtimeEventError("invalid_value", f"'item.call_id' {event.call_id!r} names no function call of "
                                     f"this session", event_id=eid, param="item.call_id")
    conversation = session.conversation
    message = {"role": "tool", "content": event.output, "tool_call_id": event.call_id}
    try:
        conversation.check_message(message)
        await asyncio.to_thread(template_delta, conversation.tokenizer, conversation.rendered,
                                conversation.messages + [message], generation_prompt=False, tools=conversation.tools)
    except ValueError as e:
        raise session._fail(e, eid, "item.output") from None
    conversation.messages.append(message)  # recorded, not fed: the next rendering feeds it
    session.held_outputs += 1
    item = rse.function_call_output_item(event)
    previous, session.last_item = session.last_item, item["id"]
    session.item_ids.add(item["id"])
    session.send(rse.conversation_item_added(item, previous))
    session.send(rse.conversation_item_done(item, previous))


async def flush_outputs(session: RealtimeSession, eid: str | None) -> None:
    """Feeds the tool results `function_output` holds, together (the session calls this before it feeds anything
    else: audio and images are not rendered by the template, so they would come before the results)."""
    if not session.held_outputs:
        return
    conversation = session.conversation
    last = conversation.messages.pop()  # its rendering takes in the held results before it
    try:
        parts = await asyncio.to_thread(conversation.message, last["role"], last["content"],
                                        tool_call_id=last["tool_call_id"])
    except ValueError as e:
        conversation.messages.append(last)
        raise session._fail(e, eid, "item.output") from None
    session.held_outputs = 0
    session._feed(parts)


@dataclasses.dataclass
class _Item:
    item: dict
    index: int
    previous: str | None


class ResponseOutput:
    """The output items of one response, as its text arrives (see the module docstring). Without a `parser`, the
    response is one assistant message item, opened at once (what a session without tools sends).

    Args:
        session: the Realtime session.
        rid: the response's id.
        parser: reads tool calls from the text (None: no tools).
        audio: the message is spoken: its text goes out as `response.output_audio_transcript` events and its part
            is `output_audio` (`omnijax.serve.realtime.audio_output`; never with a parser).
    """

    def __init__(self, session: RealtimeSession, rid: str, parser: ToolCallParser | None, audio: bool = False):
        self.session, self.rid, self.parser, self.audio = session, rid, parser, audio
        self.items: list[_Item] = []
        self.message: _Item | None = None
        self.text = ""
        self.calls: dict[int, _Item] = {}
        if parser is None:
            self._open_message()

    @property
    def done(self) -> bool:
        """The answer read all the calls it may make: the rest is not wanted."""
        return self.parser is not None and self.parser.done

    def _add(self, item: dict) -> _Item:
        s = self.session
        previous, s.last_item = s.last_item, item["id"]
        s.item_ids.add(item["id"])
        entry = _Item(item, len(self.items), previous)
        self.items.append(entry)
        s.send(rse.conversation_item_added(item, previous))
        return entry

    def _open_message(self) -> _Item:
        if self.message is None:
            self.message = self._add(rse.assistant_item(rte.new_id("item"), status="in_progress", audio=self.audio))
        return self.message

    def push(self, text: str) -> None:
        """Sends what the response's next `text` completes."""
        if self.parser is None:
            self._delta({"content": text} if text else {})
        else:
            for delta in self.parser.push(text):
                self._delta(delta)

    def _delta(self, delta: dict) -> None:
        s = self.session
        if delta.get("content"):
            message = self._open_message()
            self.text += delta["content"]
            delta_event = rse.response_output_audio_transcript_delta if self.audio else rse.response_output_text_delta
            s.send(delta_event(self.rid, message.item["id"], delta["content"], output_index=message.index))
        elif "tool_calls" in delta:
            (call,) = delta["tool_calls"]
            if "id" in call:  # a call starts: its item
                s.call_ids.add(call["id"])
                entry = self._add(rse.function_call_item(rte.new_id("item"), call["id"], call["function"]["name"],
                                                         status="in_progress"))
                self.calls[call["index"]] = entry
                s.send(rse.response_output_item_added(self.rid, entry.item, entry.index))
            elif call["function"]["arguments"]:
                entry = self.calls[call["index"]]
                entry.item["arguments"] += call["function"]["arguments"]
                s.send(rse.response_function_call_arguments_delta(
                    self.rid, entry.item["id"], entry.item["call_id"], call["function"]["arguments"],
                    output_index=entry.index))

    def finish(self, tail: str, completed: bool) -> list[dict]:
        """Sends the rest (`tail`, what the parser held) and closes every item; returns them as `response.done`'s
        output. `completed`: the answer ended by itself (else its items are "incomplete")."""
        self.push(tail)
        if self.parser is not None:
            for delta in self.parser.finish():
                self._delta(delta)
        s, out = self.session, []
        for entry in self.items:
            if entry is self.message:
                item = rse.assistant_item(entry.item["id"], self.text,
                                          status="completed" if completed else "incomplete", audio=self.audio)
                if self.audio:
                    s.send(rse.response_output_audio_done(self.rid, item["id"], output_index=entry.index))
                    s.send(rse.response_output_audio_transcript_done(self.rid, item["id"], self.text,
                                                                     output_index=entry.index))
                else:
                    s.send(rse.response_output_text_done(self.rid, item["id"], self.text, output_index=entry.index))
            else:
                call = next(c for c in self.parser.calls if c.id == entry.item["call_id"])  # type: ignore[union-attr]
                item = rse.function_call_item(entry.item["id"], call.id, call.name, call.arguments,
                                              status="completed" if call.complete else "incomplete")
                s.send(rse.response_function_call_arguments_done(self.rid, item["id"], call.id, call.name,
                                                                 call.arguments, output_index=entry.index))
                s.send(rse.response_output_item_done(self.rid, item, entry.index))
            s.send(rse.conversation_item_done(item, entry.previous))
            out.append(item)
        return out
