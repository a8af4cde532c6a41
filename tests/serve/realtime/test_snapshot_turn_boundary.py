"""A periodic Realtime snapshot is on disk before the `response.done` of the turn it covers (issue 35 item 5:
"SIGKILL loses at most one interval"), even when the client sends its next item and `response.create` the moment
`response.done` arrives, and when it sends an item while the response is still decoding.

The old code took the snapshot of a turn only after `response.done` was sent, at the first moment its connection's
loop found the session idle, and wrote it to disk in the background while the next turn ran: a SIGKILL after a
`response.done` (the hostile probe's kill came during the next response) found that turn's write cut short, so the
session had no snapshot at all. And a client that asks again at once kept the session busy at those idle looks:
here the old code had no snapshot on disk at any of the three `response.done` (or one turn, two behind).

What the server holds on disk at the instant it emits each `response.done` is read there (the session's `send` is
wrapped), so the check does not depend on how fast the client reads. The newest generation at the third turn's
`response.done` is then copied under a fresh token, as a SIGKILL would leave it, and resumed: its next answer must
equal the uninterrupted conversation's.
"""

import json
import re
import shutil
import threading
from pathlib import Path

import pytest

pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")

import omnijax  # noqa: E402
from omnijax.retention import SinkWindow  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from omnijax.serve.realtime import session as realtime_session  # noqa: E402
from tests._support import tiny_omni  # noqa: E402

QUESTIONS = ("First question.", "Second one.", "And a third.", "Fourth, after the kill.")


def _server(tmp_path, snapshots) -> BackgroundServer:
    """The tiny Qwen2.5-Omni served in-process with `--snapshot-every 1turn` (the engine and options of
    test_realtime_durable, so its compiled programs are shared)."""
    model = omnijax.load(tiny_omni.checkpoint(tmp_path / "model", tokenizer=True))
    stream = omnijax.StreamConfig(policy=SinkWindow(sink=16, window=2048), num_pages=96, page_size=16,
                                  max_answer_tokens=8)
    options = ServeOptions(port=0, frame_ms=200, max_output_tokens=16, snapshot_dir=str(snapshots),
                           snapshot_every_turns=1)
    return BackgroundServer(build_context(model, options=options, stream=stream, chunk_tokens=32, buckets=(1, 2),
                                          aimd_target=0))


def _item(text: str) -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})


def _create() -> str:
    return json.dumps({"type": "response.create"})


def _until_done(ws) -> tuple[str, dict]:
    """Reads to the next `response.done`: the answer's text and the done event (no `error` on the way)."""
    text = []
    while True:
        event = json.loads(ws.recv(timeout=30))
        assert event["type"] != "error", event
        if event["type"] == "response.output_text.delta":
            text.append(event["delta"])
        if event["type"] == "response.done":
            return "".join(text), event


def _conversation(ws, *, then_fourth: bool) -> list[str]:
    """Turn 1; turn 2 with its next item (the third question) sent while it decodes; turn 3 on that item, asked for
    the moment turn 2's `response.done` arrives; with `then_fourth`, turn 4. Every next request goes out as soon as
    the previous `response.done` is read. Returns the answers."""
    ws.send(_item(QUESTIONS[0]))
    ws.send(_create())
    answers = [_until_done(ws)[0]]
    ws.send(_item(QUESTIONS[1]))  # at once after response.done
    ws.send(_create())
    ws.send(_item(QUESTIONS[2]))  # while the response decodes: queued behind it in the session's cache
    answers.append(_until_done(ws)[0])
    ws.send(_create())  # at once after response.done
    answers.append(_until_done(ws)[0])
    if then_fourth:
        ws.send(_item(QUESTIONS[3]))
        ws.send(_create())
        answers.append(_until_done(ws)[0])
    return answers


def _generations(folder) -> list:
    return sorted(p for p in folder.iterdir() if re.fullmatch(r"[0-9]{12}", p.name)) if folder.is_dir() else []


def _answers_on_disk(folder) -> int:
    """The assistant messages the newest whole generation of a token holds (-1: none on disk)."""
    gens = _generations(folder)
    if not gens:
        return -1
    meta = json.loads((gens[-1] / "session.json").read_text())["meta"]
    return sum(m["role"] == "assistant" for m in meta["conversation"]["messages"])


def test_each_turn_is_on_disk_before_its_response_done(tmp_path, monkeypatch):
    from websockets.sync.client import connect

    snapshots = tmp_path / "sessions"
    on_disk_at_done: dict[str, list[int | str]] = {}
    kept: dict[str, Path] = {}
    lock = threading.Lock()
    send = realtime_session.RealtimeSession.send

    def recording_send(self, event: dict) -> None:  # runs in the server's loop, where response.done is emitted
        if event.get("type") == "response.done" and self.token is not None:
            folder = snapshots / self.token
            with lock:
                seen = on_disk_at_done.setdefault(self.token, [])
                try:
                    seen.append(_answers_on_disk(folder))
                    if len(seen) == 3 and _generations(folder):  # what a SIGKILL now would leave
                        kept[self.token] = shutil.copytree(_generations(folder)[-1], tmp_path / "kept" / self.token)
                except OSError as e:  # a generation replaced while read: recorded, the response goes on
                    seen.append(f"{type(e).__name__}: {e}")
        send(self, event)

    monkeypatch.setattr(realtime_session.RealtimeSession, "send", recording_send)
    with _server(tmp_path, snapshots) as server:
        url = server.base_url.replace("http", "ws") + "/realtime"
        with connect(url, max_size=None) as ws:  # the uninterrupted conversation
            json.loads(ws.recv(timeout=30))
            expected = _conversation(ws, then_fourth=True)
        assert all(expected), expected  # answers to compare (the tiny model's greedy text)
        with connect(url, max_size=None) as ws:
            token = json.loads(ws.recv(timeout=30))["session"]["omnijax"]["resume_token"]
            assert _conversation(ws, then_fourth=False) == expected[:3]
        # At each response.done the newest snapshot on disk already held that turn's answer (the old code: none
        # yet at the first, and each later one a turn or more behind).
        assert on_disk_at_done[token] == [1, 2, 3]
        assert token in kept
        fresh = "f" * 32  # the third turn's snapshot as a SIGKILL after its response.done would have left it
        shutil.copytree(kept[token], snapshots / fresh / f"{0:012d}")
        with connect(f"{url}?resume={fresh}", max_size=None) as ws:
            created = json.loads(ws.recv(timeout=30))
            assert created["type"] == "session.created", created
            ws.send(_item(QUESTIONS[3]))
            ws.send(_create())
            assert _until_done(ws)[0] == expected[3]
