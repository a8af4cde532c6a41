"""Around `omnijax serve`: a busy port is refused in one line before anything loads (it once cost a 27-70 s warm-up
and 42 lines of tracebacks), and SIGTERM unwinds the process so the demo model's temporary folder is removed (its
default action killed the process at once, leaving ~90 MB behind on every stop)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

from omnijax.serve.launch import port_in_use


def test_a_busy_port_is_named_and_a_free_one_passes():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        why = port_in_use("127.0.0.1", port)
        assert why is not None and f"port {port} on 127.0.0.1 is in use" in why and "--port" in why
    assert port_in_use("127.0.0.1", port) is None  # released
    assert port_in_use("127.0.0.1", 0) is None
    assert "does not resolve" in port_in_use("no-such-host.invalid", 8000)


def test_serve_on_a_busy_port_exits_at_once_with_one_line():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "omnijax.cli", "serve", "--demo-model", "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "is in use" in result.stderr, result.stderr
    # One line and nothing else: refused before the model is built or loaded (that logs "warm-up: ..." lines on
    # stderr and prints its summary on stdout; the warm-up took 27-70 s before the port was checked first).
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stdout == "", result.stdout


def test_sigterm_unwinds_and_removes_the_temporary_folder_then_ends_by_sigterm(tmp_path):
    """The mechanism `omnijax serve` runs under (`terminated_on_sigterm`), in a process that holds a temporary
    folder as the demo model does."""
    code = ("import sys, tempfile, time\n"
            "from omnijax.serve.launch import terminated_on_sigterm\n"
            "with terminated_on_sigterm() as terminated:\n"
            "    with tempfile.TemporaryDirectory(prefix='omnijax-serve-', dir=sys.argv[1]) as tmp:\n"
            "        print(tmp, flush=True)\n"
            "        time.sleep(60)\n"
            "print('terminated' if terminated else 'finished', flush=True)\n"
            "import signal; signal.signal(signal.SIGTERM, signal.SIG_DFL); signal.raise_signal(signal.SIGTERM)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    folder = proc.stdout.readline().strip()
    assert folder.startswith(str(tmp_path))
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(30) == -signal.SIGTERM
    assert rest.strip() == "terminated" and not list(tmp_path.iterdir())


def test_a_model_that_hears_no_audio_frames_gets_the_text_chunk_length():
    """`omnijax serve` of a text-only checkpoint (SmolLM2) without --chunk-tokens failed with "the llama family does
    not hear PCM frames": T comes from an audio frame only for a model that hears them."""
    from types import SimpleNamespace

    from omnijax.serve.app import TEXT_CHUNK_TOKENS, default_chunk_tokens

    text_only = SimpleNamespace(family=SimpleNamespace(duplex=False, frame_tokens=None, frame_unit=None), audio=None)
    assert default_chunk_tokens(text_only, 16_000) == TEXT_CHUNK_TOKENS == 64
    duplex = SimpleNamespace(family=SimpleNamespace(duplex=True, frame_tokens=None, frame_unit=None), audio=object())
    assert default_chunk_tokens(duplex, 16_000) == 128
