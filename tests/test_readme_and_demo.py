"""The README's quick start runs as written (real-weight paths swapped for tiny checkpoints; the commands on the
demo's tiny checkpoint exactly as written) and `make demo` completes."""

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from omnijax import demo
from omnijax.testing import checkpoints

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A working directory holding what `make demo` leaves (`demo_out/`, a short session with small watermarks),
    and what the demo printed."""
    cwd = tmp_path_factory.mktemp("readme")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert demo.main(["--out", str(cwd / "demo_out"), "--units", "6", "--high", "240", "--low", "160"]) == 0
    return cwd, printed.getvalue()


@pytest.fixture(scope="module")
def demo_dir(demo_run):
    return demo_run[0]


def test_demo_leaves_a_checkpoint_a_clip_and_a_plot(demo_dir):
    out = demo_dir / "demo_out"
    assert (out / "omnijax" / "tokenizer.json").is_file() and (out / "clip.mp4").is_file()
    assert (out / "session.png").stat().st_size > 10_000


def test_demo_prints_the_three_runs(demo_run):
    printed = demo_run[1]
    rows = {line.split()[0]: line.split() for line in printed.splitlines()
            if line.split()[:1] in (["NoSlide"], ["OmniPick"], ["OmniPick+tile_skip"])}
    assert set(rows) == {"NoSlide", "OmniPick", "OmniPick+tile_skip"}
    retained = {name: int(row[1]) for name, row in rows.items()}
    assert retained["OmniPick"] < retained["NoSlide"] and retained["OmniPick+tile_skip"] < retained["NoSlide"]
    assert "Chat.kept()" in printed and "session.png" in printed


def _commands(prefix):
    return [line for line in re.findall(r"^(.*\.venv/bin/omnijax .*)$", README, flags=re.M) if prefix in line]


def _run(line, cwd):
    line = line.replace(".venv/bin/omnijax", shlex.quote(str(BIN / "omnijax")))
    return subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=600)


def _shown(command):
    """The output block the README shows after a command."""
    after = README[README.index(command) + len(command):]
    return re.match(r"\s*```\s*```\n(.*?)```", after, flags=re.S).group(1)


def test_readme_chat_and_watch_commands(demo_dir):
    (chat,) = _commands(" chat ")
    (watch,) = _commands(" watch ")
    for command in (chat, watch):
        done = _run(command, demo_dir)
        assert done.returncode == 0, done.stderr
        shown = _shown(command)
        # The same rows and figures' shape as shown: the table header, one row per (unit, span) line shown.
        shown_rows = [line.split()[-4:] for line in shown.splitlines() if re.search(r"\s\d+\s+\d+$", line)]
        got_rows = [line.split()[-4:] for line in done.stdout.splitlines() if re.search(r"\s\d+\s+\d+$", line)]
        assert [r[0] for r in got_rows] == [r[0] for r in shown_rows]
        assert [r[1] for r in got_rows] == [r[1] for r in shown_rows]  # span kinds in order
        assert [r[2] for r in got_rows] == [r[2] for r in shown_rows]  # tokens fed
    assert (demo_dir / "demo_out" / "watch.png").is_file()
    serve = _commands(" serve ")[0]
    help_run = _run(serve.split(" demo_out")[0] + " --help", demo_dir)
    assert help_run.returncode == 0 and "--policy" in help_run.stdout


def _python_block(marker: str) -> str:
    """The README's one Python block containing `marker`."""
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README, flags=re.S) if marker in b]
    return block


def test_readme_serve_command_and_openai_client(demo_dir):
    """`omnijax serve` on the demo's checkpoint as the README writes it (on a free port), and the README's openai
    SDK client against it, as written: a chat completion, a streamed one and a Realtime session with audio."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    serve = _commands(" serve ")[0].replace("--port 8000", f"--port {port}")
    line = serve.replace(".venv/bin/omnijax", shlex.quote(str(BIN / "omnijax")))
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
        assert ready.wait(300) and proc.poll() is None, "".join(lines[-20:])
        code = _python_block("realtime.connect").replace("8000", port)
        done = subprocess.run([sys.executable, "-c", code], cwd=demo_dir, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "CompletionUsage(" in done.stdout and "RealtimeResponseUsage(" in done.stdout
    finally:
        proc.terminate()
        proc.wait(60)


def test_readme_python_chat(demo_dir, monkeypatch):
    monkeypatch.chdir(demo_dir)
    namespace = {}
    exec(compile(_python_block("omnijax.Chat(model"), "README.md", "exec"), namespace)
    chat = namespace["chat"]
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant"]
    assert sum(1 for u in chat.units if u.kind == "av") == 5
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
    subprocess.run([str(BIN / "omnijax"), *args], check=True)
    code = _python_block("/path/to/omni7b-jax").replace("/path/to/omni7b-jax", str(dst))
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    result, out = namespace["result"], namespace["out"]
    assert namespace["answer"].shape == (1, 8)
    assert int(namespace["compressed"].cache.layers[0].length[0, 0]) == 64
    assert result.tokens.shape == (2, 1, 16) and (result.tokens[-1, 0] >= 0).all()
    assert out.tokens.shape == (1, 16) and int((out.tokens[0] >= 0).sum()) == 8
