"""Full duplex over `/v1/realtime` (MiniCPM-o 4.5): the model decides per 1 s unit whether to listen or speak.

A Realtime session turns duplex on with `session.update` `{"session": {"omnijax": {"duplex": true}}}` before it sends
any input (the server must run a MiniCPM-o 4.5 checkpoint; its engine returns logits for host decisions). From then
on the session is a `omnijax.serve.engine.duplex.DuplexStream` on its engine session:

- the system prompt is the chat template's rendering of the session's `instructions` (empty: none), fed once;
- `input_audio_buffer.append`: 16-bit PCM at the session rate, cut into 1 s units (resampled to 16 kHz) that are
  answered in order while audio keeps arriving; `.commit` pads the rest with silence to a whole unit and answers
  `.committed` once every unit so far has been answered (a sync point: listening units send no event), `.clear`
  drops what is not yet a unit;
- `conversation.item.create` with `input_image` parts: the latest image becomes the next unit's video frame;
  text items, `response.create` and `response.cancel` are refused (the model decides when to speak);
- `session.omnijax.presence_penalty` / `frequency_penalty` penalise the decisions over the answer so far, across
  units (`omnijax.serve.engine.duplex.AnswerPenalties`); the other sampling settings are refused (the release's rule
  is greedy);
- a unit that speaks opens a response if none is open (`response.created`, the assistant item) and streams its text
  (`response.output_text.delta`, whole UTF-8 characters, duplex markers removed); a unit that ends by listening
  closes the open response (`.output_text.done`, `conversation.item.done`, `response.done` with usage and KV cells).

Duplex sessions are not snapshotted for resuming (the streaming audio encoder's cache is host state a snapshot does
not hold). A unit that fails (a preempted session) ends the duplex stream with an `error` event.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np

from omnijax.media.audio import resample
from omnijax.media.image import read_image
from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens
from omnijax.serve.engine.duplex import DuplexStream, speak_ids
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.realtime import server_events as rse
from omnijax.serve.realtime.sampling import duplex_penalties

if TYPE_CHECKING:
    from omnijax.models.minicpmo.model import MiniCPMOModel
    from omnijax.serve.realtime.session import RealtimeSession

log = logging.getLogger("omnijax.serve")


def duplex_rule(model: MiniCPMOModel) -> DuplexDecodeRule:
    """The release's duplex decision rule with the checkpoint's marker ids (`<|tts_pad|>` is never chosen)."""

    special = model.special_tokens
    names = {"chunk_eos": "<|chunk_eos|>", "turn_eos": "<|turn_eos|>", "listen": "<|listen|>", "tts_bos": "<|tts_bos|>"}
    missing = [text for text in names.values() if text not in special]
    if missing:
        raise ValueError(f"the checkpoint's tokenizer declares no id for {missing}: full duplex needs MiniCPM-o "
                         f"4.5's duplex markers")
    forbidden = (int(special["<|tts_pad|>"]),) if "<|tts_pad|>" in special else ()
    return DuplexDecodeRule(**{field: int(special[text]) for field, text in names.items()}, forbidden=forbidden)


class DuplexRealtime:
    """The duplex side of one `RealtimeSession` (see the module docstring).

    Args:
        session: the `omnijax.serve.realtime.session.RealtimeSession` turning duplex on.
        eid: the `session.update` event id (for errors).

    Raises:
        RealtimeEventError: the server cannot run duplex for this session (another model family, an engine
            without host logits, input already fed); nothing changes.
    """

    def __init__(self, session: RealtimeSession, eid: str | None):

        model, worker = session.context.model, session.worker
        if not model.family.duplex:
            raise rte.RealtimeEventError("unsupported", f"full duplex needs a MiniCPM-o 4.5 checkpoint; this server "
                                         f"runs {model.model_type!r}", event_id=eid, param="session.omnijax.duplex")
        if session.conversation.tokens_fed or session.audio.size:
            raise rte.RealtimeEventError("unsupported", "turn duplex on before any input (it starts the stream)",
                                         event_id=eid, param="session.omnijax.duplex")
        try:
            self.stream = DuplexStream(model, worker, session.sid, rule=duplex_rule(model),
                                       tokens=DuplexTokens.of(model), penalties=duplex_penalties(session.settings))
        except ValueError as e:
            raise rte.RealtimeEventError("unsupported", str(e), event_id=eid, param="session.omnijax.duplex") from None
        self.session, self.tokenizer = session, session.context.tokenizer
        self.units: asyncio.Queue = asyncio.Queue()
        self.audio = np.zeros((0,), np.int16)  # session-rate samples not yet a unit
        self.frame: np.ndarray | None = None  # the next unit's video frame
        self.decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        self.response: dict | None = None  # the open response: ids, text pieces, tokens
        self.task = session._spawn(self._run(session.settings.instructions))

    def handle(self, event: rte.ClientEvent) -> None:
        """A client event of the duplex session (see the module docstring); refusals raise `RealtimeEventError`."""

        session = self.session
        eid = event.event_id
        if isinstance(event, rte.InputAudioBufferAppend):
            pcm = np.frombuffer(event.audio, "<i2")
            held = (self.audio.size + pcm.size) / session.settings.input_audio_rate
            if held > session.options.max_audio_buffer_s:
                raise rte.RealtimeEventError("buffer_too_large", f"the input audio buffer would hold {held:.1f} s, "
                                             f"over the server's cap of {session.options.max_audio_buffer_s:g} s",
                                             event_id=eid, param="audio")
            self.append(pcm)
        elif isinstance(event, rte.InputAudioBufferCommit):
            self.commit(eid)
        elif isinstance(event, rte.InputAudioBufferClear):
            self.clear()
            session.send(rse.input_audio_buffer_cleared())
        elif isinstance(event, rte.ConversationItemCreate) and all(isinstance(p, rte.InputImage)
                                                                   for p in event.content):
            images = []
            for i, part in enumerate(event.content):
                try:
                    images.append(read_image(part.data))
                except ValueError as e:
                    raise session._fail(e, eid, f"item.content[{i}].image_url") from None
            self.image(images[-1])
            item = rse.user_item(event)
            previous, session.last_item = session.last_item, item["id"]
            session.send(rse.conversation_item_added(item, previous))
            session.send(rse.conversation_item_done(item, previous))
        else:
            raise rte.RealtimeEventError("unsupported", f"{type(event).__name__}: in a duplex session the model "
                                         f"decides when to speak; send audio and images only", event_id=eid)

    @property
    def _unit(self) -> int:
        return int(self.session.settings.input_audio_rate)  # samples of 1 s at the session rate

    def append(self, pcm: np.ndarray) -> None:
        self.audio = np.concatenate([self.audio, pcm])
        while self.audio.size >= self._unit:
            self._queue(self.audio[:self._unit])
            self.audio = self.audio[self._unit:]

    def commit(self, eid: str | None) -> None:
        if self.audio.size:
            unit = np.zeros((self._unit,), np.int16)
            unit[:self.audio.size] = self.audio
            self.audio = self.audio[:0]
            self._queue(unit)
        self.units.put_nowait(None)  # answered with `.committed` once the units before it are

    def clear(self) -> None:
        self.audio = self.audio[:0]

    def image(self, image: np.ndarray) -> None:
        self.frame = image

    def _queue(self, unit: np.ndarray) -> None:

        pcm = resample(unit.astype(np.float32) / 32768.0, self._unit)  # [16000]
        self.units.put_nowait((pcm, self.frame))
        self.frame = None

    async def _run(self, instructions: str) -> None:
        stream = self.stream
        try:
            prefix = self.tokenizer.encode(self.tokenizer.render([{"role": "system", "content": instructions}])
                                           ) if instructions else []
            await stream.prepare(prefix, [])
            while True:
                unit = await self.units.get()
                if unit is None:
                    self.session.send(rse.input_audio_buffer_committed(rte.new_id("item"), self.session.last_item))
                    continue
                await self._emit(await stream.step(*unit))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream cannot go on; the client is told why
            log.warning("realtime duplex session=%s stopped: %s: %s", self.session.sid, type(e).__name__, e)
            self.session.send(rte.error_event("duplex_stopped", f"the duplex stream stopped: {e}",
                                              error_type="server_error"))
            await self._close("failed")

    async def _emit(self, result) -> None:

        ids = speak_ids(result, self.stream.markers)
        text = self.decoder.push(ids)
        if ids and self.response is None:
            rid, item = rte.new_id("resp"), rte.new_id("item")
            previous, self.session.last_item = self.session.last_item, item
            self.response = {"id": rid, "item": item, "previous": previous, "pieces": [], "tokens": 0}
            self.session.send(rse.response_created(rid))
            self.session.send(rse.conversation_item_added(rse.assistant_item(item, status="in_progress"), previous))
        if self.response is not None:
            self.response["tokens"] += len(ids)
            if text:
                self.response["pieces"].append(text)
                self.session.send(rse.response_output_text_delta(self.response["id"], self.response["item"], text))
            if result.listened:
                await self._close("completed")

    async def _close(self, status: str) -> None:
        response, self.response = self.response, None
        if response is None:
            return
        tail = self.decoder.flush()
        if tail:
            response["pieces"].append(tail)
            self.session.send(rse.response_output_text_delta(response["id"], response["item"], tail))
        text = "".join(response["pieces"])
        worker = self.session.worker
        cells = (await worker.in_engine(worker.kv_cells, [self.session.sid])).get(self.session.sid, 0)
        item = rse.assistant_item(response["item"], text, status="completed" if status == "completed" else
                                  "incomplete")
        self.session.send(rse.response_output_text_done(response["id"], response["item"], text))
        self.session.send(rse.conversation_item_done(item, response["previous"]))
        self.session.send(rse.response_done(response["id"], status=status, output=[item],
                                            output_tokens=response["tokens"], kv_cells=cells))
