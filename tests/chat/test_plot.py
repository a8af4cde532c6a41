"""Session plots (`omnijax.plot`): the trace of a real stream is its layout statistics, and the plots are PNGs with
something drawn on them."""

import sys

import numpy as np
import pytest

import omnijax
from omnijax import plot
from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.models.config import TINY_OMNI
from omnijax.retention import OmniPick

pytest.importorskip("matplotlib", reason="matplotlib (the `plot` and `test` extras) draws the plots")
Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def streamed():
    """Eight text units of 10 tokens, the last three asking for 2 answer tokens, under a bound of 40 cells."""
    rng = np.random.default_rng(0)
    chunks = stack_chunks([text_chunk(rng.integers(0, 300, 10), unit=i, answer_tokens=2 if i >= 5 else 0)
                           for i in range(8)])
    policy = OmniPick(high_watermark=40, low_watermark=25, recent_units=1, text_budget=6)
    result = omnijax.stream(omnijax.Decoder(TINY_OMNI), chunks, policy=policy, page_size=8, num_pages=16,
                            max_answer_tokens=2, impl="reference")
    return result, chunks


def _drawn(path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == "PNG"
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.size > 0 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 10  # not blank
    return pixels


def test_trace_of_a_stream_is_its_layout_statistics(streamed):
    result, chunks = streamed
    layout = result.stats.layout
    trace = plot.trace_of(result)
    np.testing.assert_array_equal(trace.retained, np.asarray(layout.retained_cells)[:, 0])
    np.testing.assert_array_equal(trace.physical_span, np.asarray(layout.physical_span)[:, 0])
    np.testing.assert_array_equal(trace.active_pages, np.asarray(layout.active_pages)[:, 0])
    assert trace.steps == 8 and trace.page_size == 8 and np.isnan(trace.latency_ms).all()
    assert trace.retained.max() <= 40 and trace.retained[-1] < trace.retained.max()  # the bound trims
    assert trace.labels == ("chunk",) * 5 + ("answer",) * 3
    labelled = plot.trace_of(result, latency_ms=np.arange(8.0), chunks=chunks)
    assert labelled.labels == ("text",) * 5 + ("answer",) * 3
    np.testing.assert_array_equal(labelled.latency_ms, np.arange(8.0))
    with pytest.raises(ValueError, match="one value per step"):
        plot.trace_of(result, latency_ms=[1.0])
    with pytest.raises(IndexError, match="1 sequence"):
        plot.trace_of(result, sequence=1)
    with pytest.raises(ValueError, match="labels has 2 entries for 8 steps"):
        plot.SessionTrace(trace.retained, trace.physical_span, trace.active_pages, trace.latency_ms, ("a", "b"), 8)


def test_session_and_compare_write_pngs(streamed, tmp_path):
    result, chunks = streamed
    trace = plot.trace_of(result, latency_ms=np.linspace(5, 12, 8), chunks=chunks)

    class Chatty:  # what omnijax.Chat offers: a trace() method
        def trace(self):
            return trace

    first = plot.session(trace, tmp_path / "session.png", title="a session")
    assert first == tmp_path / "session.png"
    pixels = _drawn(first)
    _drawn(plot.session(result, tmp_path / "from_result.png"))  # no latency measured: the panel says so
    np.testing.assert_array_equal(_drawn(plot.session(Chatty(), tmp_path / "chat.png", title="a session")), pixels)
    unbounded = plot.SessionTrace(retained=10 * np.arange(1, 9), physical_span=8 * np.ceil(10 * np.arange(1, 9) / 8),
                                  active_pages=np.ceil(10 * np.arange(1, 9) / 8), latency_ms=np.full(8, np.nan),
                                  labels=("text",) * 8, page_size=8)
    out = plot.compare({"NoSlide": unbounded, "OmniPick": trace, "result": result}, tmp_path / "runs" / "cmp.png")
    assert out.is_file() and out.parent.name == "runs"
    _drawn(out)


def test_steps_above_the_latency_panel_break_the_line_and_sit_on_its_top_edge():
    """A compiling step (seconds) is off the clipped latency panel: the line breaks there instead of running off the
    top to it, and a marker on the top edge shows it."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    latency = np.array([5.0, 6.0, 2000.0, 5.0, 6.0, np.nan, 5.0, 1500.0])
    top = plot._latency_top([latency])
    assert top == 4 * np.nanmedian(latency)
    ax = Figure().subplots()
    plot._plot_latency(ax, np.arange(8), latency, top, color="C0")
    (line,) = ax.lines
    ys = np.asarray(line.get_ydata(), np.float64)
    assert np.nanmax(ys) <= top and np.isnan(ys[[2, 5, 7]]).all()
    (marks,) = ax.collections
    np.testing.assert_array_equal(marks.get_offsets(), [[2, top], [7, top]])
    assert plot._latency_top([np.array([5.0, 6.0, 7.0])]) is None  # nothing to clip: the whole line


def test_bad_sources_and_a_missing_matplotlib(streamed, tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="got builtins.dict"):
        plot.session({"retained": [1, 2]}, tmp_path / "x.png")
    with pytest.raises(TypeError, match="compare\\(\\) takes .* got builtins.list"):
        plot.compare({"a": [1, 2]}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="non-empty dict"):
        plot.compare({}, tmp_path / "x.png")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r"pip install 'omnijax\[plot\]'"):
        plot.session(plot.trace_of(streamed[0]), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
