"""omnijax-serve: frame and hello validation, and an end-to-end loopback run with the tiny demo model."""

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")

from omnijax.serve import loadgen  # noqa: E402
from omnijax.serve import server as srv  # noqa: E402

FRAME_MS = 250.0  # 4000 samples: 6 audio tokens + 2 markers per frame
SAMPLES = 4000


# ------------------------------------------------------------------------------------------------------ validation
def test_frame_samples():
    assert srv.frame_samples(250) == 4000 and srv.frame_samples(20) == 320 and srv.frame_samples(1000) == 16000
    with pytest.raises(ValueError):
        srv.frame_samples(0.01)  # 0.16 samples


def test_decode_frame_accepts_exactly_one_frame_of_int16():
    pcm = (np.arange(SAMPLES) - 2000).astype("<i2")
    out = srv.decode_frame(pcm.tobytes(), SAMPLES)
    assert out.dtype == np.int16 and np.array_equal(out, pcm)


@pytest.mark.parametrize("size, code", [(2 * SAMPLES - 2, "bad_frame_size"), (2 * SAMPLES + 2, "bad_frame_size"),
                                        (2 * SAMPLES - 1, "odd_byte_count"), (0, "bad_frame_size"),
                                        (7, "odd_byte_count")])
def test_decode_frame_rejects_wrong_sizes(size, code):
    with pytest.raises(srv.ProtocolError) as e:
        srv.decode_frame(b"\x01" * size, SAMPLES)
    assert e.value.code == code


def test_parse_hello():
    hello = {"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS}
    assert srv.parse_hello(json.dumps(hello), frame_ms=FRAME_MS) == SAMPLES
    assert srv.parse_hello(json.dumps({"type": "hello"}), frame_ms=FRAME_MS) == SAMPLES  # defaults
    cases = [(b"\x00\x01", "no_hello"), ("not json", "bad_json"), ("[1, 2]", "bad_json"), ("{}", "bad_message"),
             (json.dumps({"type": "frame"}), "no_hello"),
             (json.dumps(dict(hello, sample_rate=8000)), "bad_sample_rate"),
             (json.dumps(dict(hello, sample_rate=True)), "bad_sample_rate"),
             (json.dumps(dict(hello, frame_ms=20)), "bad_frame_ms"),
             (json.dumps(dict(hello, frame_ms="250")), "bad_frame_ms"), ('{"type": "hello", "frame_ms": NaN}',
                                                                         "bad_frame_ms")]
    for message, code in cases:
        with pytest.raises(srv.ProtocolError) as e:
            srv.parse_hello(message, frame_ms=FRAME_MS)
        assert e.value.code == code, message


def test_speech_like_pcm():
    a, b = loadgen.speech_like_pcm(1.0, seed=3), loadgen.speech_like_pcm(1.0, seed=3)
    assert a.dtype == np.int16 and a.shape == (16000,) and np.array_equal(a, b)
    assert 500 < np.abs(a.astype(np.float64)).mean() < 20000  # audible, not clipped flat
    with pytest.raises(ValueError):
        asyncio.run(loadgen.closed_loop("ws://127.0.0.1:1/session", sessions=0, duration_s=1, frame_ms=FRAME_MS))


# ------------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A warmed-up engine and encoder on the tiny demo checkpoint (one batch bucket of 4: one compile)."""
    import omnijax
    from omnijax.retention import SinkWindow
    from omnijax.serve.engine import Engine, EngineConfig

    model = omnijax.load(srv.build_demo_model(tmp_path_factory.mktemp("serve")))
    config = EngineConfig(omnijax.StreamConfig(policy=SinkWindow(4, 48), num_pages=32, page_size=16,
                                               max_answer_tokens=2), chunk_tokens=8, buckets=(4,),
                          frame_budget_s=FRAME_MS / 1000)
    engine = Engine(model, config)
    encoder = srv.AudioFrameEncoder(model, chunk_tokens=8, answer_tokens=2)
    assert srv.frame_tokens(SAMPLES) == 8 and srv.frame_tokens(480) == 3  # 30 ms: one audio token
    srv.warm_up(engine, encoder, SAMPLES, 4)
    assert engine.sessions == []
    return engine, encoder


async def _bad_client(url, payloads, hello=None):
    """Sends a hello then `payloads` (one per frame budget); returns every message received and the close code."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    got = []
    async with connect(url) as ws:
        async def read():
            try:
                async for message in ws:
                    got.append(json.loads(message))
            except ConnectionClosed:
                pass
        reader = asyncio.create_task(read())
        try:
            await ws.send(json.dumps(hello or {"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS}))
            for p in payloads:
                await asyncio.sleep(FRAME_MS / 1000)
                await ws.send(p)
        except ConnectionClosed:
            pass
        await asyncio.wait_for(reader, 10)
        return got, ws.close_code


def test_end_to_end_garbage_client_is_closed_others_keep_streaming(served):
    engine, encoder = served
    good_pcm = loadgen.speech_like_pcm(FRAME_MS / 1000, seed=9).tobytes()

    async def scenario():
        server = srv.MetronomeServer(engine, encoder, srv.ServeConfig(frame_ms=FRAME_MS, answer_tokens=2))
        await server.start()
        loop = asyncio.get_running_loop()
        t0, rows = loop.time(), []
        good = [asyncio.create_task(loadgen.run_client(server.url, client=i, frame_ms=FRAME_MS, duration_s=30,
                                                        t0=t0, phase_s=0.1 * i, seed=i, frames=rows))
                for i in range(2)]
        await asyncio.sleep(1.0)
        # the third client: one good frame, then a wrong-size frame -> error + close; then more sessions sending
        # non-PCM text, an odd byte count, a bad hello
        garbage = await _bad_client(server.url, [good_pcm, b"\x00" * 1000, good_pcm])
        t_garbage = loop.time() - t0
        text = await _bad_client(server.url, ["this is not PCM"])
        odd = await _bad_client(server.url, [b"\x00" * (2 * SAMPLES - 1)])
        bad_hello = await _bad_client(server.url, [], hello={"type": "hello", "sample_rate": 44100})
        await asyncio.sleep(1.5)
        assert len(server.clients) == 2
        await server.stop()  # graceful: the good clients are closed with 1001 mid-stream
        clients = await asyncio.wait_for(asyncio.gather(*good), 10)
        return server, garbage, text, odd, bad_hello, t_garbage, rows, clients

    server, garbage, text, odd, bad_hello, t_garbage, rows, clients = asyncio.run(scenario())

    messages, code = garbage
    assert messages[0]["type"] == "ready" and code == 1008
    assert [m["type"] for m in messages][-1] == "error" and messages[-1]["code"] == "bad_frame_size"
    assert text[1] == 1008 and text[0][-1]["code"] == "bad_json"
    assert odd[1] == 1008 and odd[0][-1]["code"] == "odd_byte_count"
    assert bad_hello[1] == 1008 and bad_hello[0] == [{"type": "error", "code": "bad_sample_rate",
                                                       "message": bad_hello[0][0]["message"]}]
    assert server.stats["errors"] == 4 and server.stats["ticks"] > 0
    for i, client in enumerate(clients):
        assert client["admitted"] and client["error"] is None and client["close_code"] == 1001, client
        mine = [r for r in rows if r["client"] == i]
        assert len(mine) >= 8 and client["received"] == len(mine)
        assert sum(r["tokens"] == 2 for r in mine) >= len(mine) - 1  # every served frame carries its tokens
        after = [r for r in mine if r["t"] > t_garbage]
        assert len(after) >= 4 and all(r["tokens"] == 2 and not r["empty"] for r in after)
        assert [r["seq"] for r in mine] == sorted(r["seq"] for r in mine)
    assert engine.sessions == []  # every slot went back


def test_admission_path_and_message_errors(served):
    from omnijax.serve.admission import AIMD

    engine, encoder = served

    async def scenario():
        aimd = AIMD(target_fraction=0.6, frame_budget_s=FRAME_MS / 1000, initial_cap=1)
        server = srv.MetronomeServer(engine, encoder, srv.ServeConfig(frame_ms=FRAME_MS, answer_tokens=2),
                                     admission=aimd)
        await server.start()
        url = server.url
        first = asyncio.create_task(_bad_client(url, [loadgen.speech_like_pcm(0.25).tobytes()] * 3
                                                + [json.dumps({"type": "bye"})]))
        await asyncio.sleep(0.3)
        second = await _bad_client(url, [])  # over the cap of 1
        image = None
        first = await first
        image = await _bad_client(url, [json.dumps({"type": "image", "data": ""})])
        path = await _bad_client(url.replace("/session", "/other"), [])
        await server.stop()
        return first, second, image, path, server.stats

    first, second, image, path, stats = asyncio.run(scenario())
    assert first[1] == 1000 and first[0][0]["type"] == "ready"
    assert [m["seq"] for m in first[0] if m["type"] == "frame"] == [0, 1, 2]
    assert second[1] == 1013 and second[0][0]["code"] == "overloaded" and "cap 1" in second[0][0]["message"]
    assert image[1] == 1008 and image[0][-1]["code"] == "unsupported"
    assert path[1] == 1008 and path[0][0]["code"] == "not_found"
    assert stats["rejected"] == 1 and engine.sessions == []


def test_cli_argument_errors():
    for argv in ([], ["ckpt", "--demo-model"], ["--demo-model", "--frame-ms", "20"],
                 ["--demo-model", "--frame-ms", "0.01"]):
        with pytest.raises(SystemExit):
            srv.main(argv)


def test_cli_reports_an_unreadable_checkpoint_without_a_traceback(tmp_path, capsys):
    assert srv.main([str(tmp_path)]) == 1
    assert "omnijax-serve: error:" in capsys.readouterr().err


def test_connections_refusals_and_warm_up_are_logged(served, caplog):
    """One log line per admitted connection, per refusal (AIMD cap here) and per session end, each naming the peer
    and the session; the warm-up logs each bucket it compiles with its time."""
    import logging

    from omnijax.serve.admission import AIMD

    engine, encoder = served
    caplog.set_level(logging.INFO, logger="omnijax.serve")
    seconds = srv.warm_up(engine, encoder, SAMPLES, 4)
    warm = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
    assert any("compiling the audio encoder" in m for m in warm)
    assert any(m.startswith("warm-up: compiling the engine tick for bucket 4 ") for m in warm)
    assert any(m.startswith("warm-up: bucket 4 ready in ") and m.endswith(" s") for m in warm)
    assert warm[-1].startswith("warm-up: done, 1 bucket(s) [4] in ") and seconds > 0
    caplog.clear()

    async def scenario():
        aimd = AIMD(target_fraction=0.6, frame_budget_s=FRAME_MS / 1000, initial_cap=1)
        server = srv.MetronomeServer(engine, encoder, srv.ServeConfig(frame_ms=FRAME_MS, answer_tokens=2),
                                     admission=aimd)
        await server.start()
        first = asyncio.create_task(_bad_client(server.url, [loadgen.speech_like_pcm(0.25).tobytes()] * 2
                                                + [json.dumps({"type": "bye"})]))
        await asyncio.sleep(0.3)
        second = await _bad_client(server.url, [])  # over the cap of 1
        first = await first
        await server.stop()
        return first, second

    first, second = asyncio.run(scenario())
    assert first[1] == 1000 and second[1] == 1013
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "omnijax.serve"]
    connects = [m for level, m in lines if m.startswith("connect ")]
    refusals = [(level, m) for level, m in lines if m.startswith("refuse ")]
    closes = [m for level, m in lines if m.startswith("close ")]
    assert len(connects) == 1 and connects[0].startswith("connect peer=127.0.0.1:")
    assert " session=s0 " in connects[0] and connects[0].endswith("sessions=1")
    assert len(refusals) == 1 and refusals[0][0] == logging.WARNING
    refusal = refusals[0][1]
    assert refusal.startswith("refuse peer=127.0.0.1:") and " session=s1 reason=overloaded: " in refusal
    assert "cap 1" in refusal
    assert len(closes) == 1 and " session=s0 reason=bye" in closes[0]


def test_websockets_is_a_base_dependency():
    """`omnijax-serve` works after `pip install omnijax`: its WebSocket library is not behind an extra."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert any(d.replace(" ", "").startswith("websockets>=") for d in project["dependencies"])
    assert project["scripts"]["omnijax-serve"] == "omnijax.serve.server:main"
