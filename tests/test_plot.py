"""numbactr.plot: PNG encoding (structure, CRCs, exact pixels), ticks, font and chart edge cases."""
import struct
import zlib

import numpy as np
import pytest

from numbactr import plot

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_chunks(path):
    """[(tag, body)] of a PNG file, asserting the signature and every chunk's CRC."""
    data = open(path, "rb").read()
    assert data[:8] == SIGNATURE
    chunks, pos = [], 8
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, f"bad CRC in {tag!r}"
        chunks.append((tag, body))
        pos += 12 + n
    assert pos == len(data)
    return chunks


def read_png(path):
    """Decode an RGB8, non-interlaced, filter-0 PNG (what write_png writes) to (H, W, 3) uint8."""
    chunks = read_chunks(path)
    tags = [t for t, _ in chunks]
    assert tags[0] == b"IHDR" and tags[-1] == b"IEND" and b"IDAT" in tags
    assert chunks[-1][1] == b""
    w, h, depth, ctype, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(b for t, b in chunks if t == b"IDAT"))
    rows = np.frombuffer(raw, np.uint8).reshape(h, 1 + 3 * w)   # (H, filter byte + 3W)
    assert np.all(rows[:, 0] == 0)
    return rows[:, 1:].reshape(h, w, 3)


def has_colour(img, rgb):
    return bool(np.any(np.all(img == np.array(rgb, np.uint8), axis=2)))


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 13, 3), (64, 3, 3)])
def test_write_png_round_trips_exact_pixels(tmp_path, shape):
    rgb = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    path = tmp_path / "x.png"
    plot.write_png(path, rgb)
    np.testing.assert_array_equal(read_png(path), rgb)
    assert not (tmp_path / "x.png.tmp").exists()


def test_write_png_ihdr_fields_and_non_contiguous_input(tmp_path):
    rgb = np.arange(5 * 8 * 3, dtype=np.uint8).reshape(5, 8, 3)[:, ::2]    # (5, 4, 3), strided
    plot.write_png(tmp_path / "x.png", rgb)
    chunks = read_chunks(tmp_path / "x.png")
    assert struct.unpack(">II", chunks[0][1][:8]) == (4, 5)               # width, height
    np.testing.assert_array_equal(read_png(tmp_path / "x.png"), rgb)


def test_write_png_crc_check_catches_corruption(tmp_path):
    plot.write_png(tmp_path / "x.png", np.zeros((4, 4, 3), np.uint8))
    data = bytearray(open(tmp_path / "x.png", "rb").read())
    data[20] ^= 1                                          # a byte inside IHDR's body
    open(tmp_path / "bad.png", "wb").write(bytes(data))
    with pytest.raises(AssertionError, match="bad CRC"):
        read_chunks(tmp_path / "bad.png")


@pytest.mark.parametrize("bad", [np.zeros((4, 4, 3), np.float32), np.zeros((4, 4), np.uint8),
                                 np.zeros((4, 4, 4), np.uint8), np.zeros((0, 4, 3), np.uint8)])
def test_write_png_rejects_bad_arrays(tmp_path, bad):
    with pytest.raises(ValueError):
        plot.write_png(tmp_path / "x.png", bad)


@pytest.mark.parametrize("lo,hi", [(0, 1), (0.5, 0.82), (-3, 7), (0, 1.2e5), (1e-7, 3e-7),
                                   (0.8001, 0.8003), (1e9, 1e9 + 3), (-2e6, -1e6), (4, 4)])
def test_nice_ticks_are_round_and_inside(lo, hi):
    ticks, step = plot.nice_ticks(lo, hi, 6)
    mant = step / 10.0 ** np.floor(np.log10(step))
    assert any(np.isclose(mant, m) for m in (1, 2, 2.5, 5, 10))
    assert 2 <= ticks.size <= 13
    a, b = plot.axis_limits(lo, hi, 0.0)
    assert np.all(ticks >= a - 1e-9 * step) and np.all(ticks <= b + 1e-9 * step)
    np.testing.assert_allclose(np.diff(ticks), step, rtol=1e-6)
    labels = plot.format_ticks(ticks, step)
    assert len(set(labels)) == len(labels), labels        # neighbours stay distinguishable
    np.testing.assert_allclose([float(s) for s in labels], ticks, rtol=1e-9, atol=step * 1e-6)


def test_format_ticks_is_compact():
    t, s = plot.nice_ticks(0, 1.2e5)
    assert plot.format_ticks(t, s)[-1] == "1.2e+05"
    t, s = plot.nice_ticks(0.001, 0.0075)
    assert plot.format_ticks(t, s)[0] == "0.002"
    assert plot.format_ticks([0.0, 0.001, 0.002], 0.001) == ["0", "0.001", "0.002"]
    assert plot.format_ticks([0.5, 0.75, 1.0], 0.25) == ["0.50", "0.75", "1.00"]
    assert plot.format_ticks([-2e-7, 0.0, 2e-7], 2e-7) == ["-2e-07", "0", "2e-07"]
    assert plot.format_ticks([0, 2000, 4000], 2000) == ["0", "2000", "4000"]


def test_axis_limits_open_degenerate_ranges():
    assert plot.axis_limits(0.7, 0.7)[0] < 0.7 < plot.axis_limits(0.7, 0.7)[1]
    assert plot.axis_limits(0, 0) == (-1.0, 1.0)
    assert plot.axis_limits(float("nan"), 1, 0.0) == (0.0, 1.0)
    lo, hi = plot.axis_limits(0, 10, 0.1)
    assert (lo, hi) == (-1.0, 11.0)


def test_font_covers_the_required_characters_with_distinct_glyphs():
    required = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz .,-:()/%=+_"
    assert set(required) <= set(plot._CHARS)
    assert plot.FONT.shape == (len(plot._CHARS), 9, 5)
    flat = {plot.FONT[i].tobytes(): c for i, c in enumerate(plot._CHARS)}
    assert len(flat) == len(plot._CHARS)                  # no two characters drawn alike
    assert not plot.FONT[plot._CHARS.index(" ")].any()
    for c in required.replace(" ", ""):
        assert plot.FONT[plot._CHARS.index(c)].any(), c
    m = plot._text_mask("Ab1", 2)
    assert m.shape == (18, (6 * 3 - 1) * 2)
    assert plot._text_mask("\u00e9").tolist() == plot._text_mask("?").tolist()   # unknown -> '?'


def _chart(tmp_path, series, hlines=None, **kw):
    path = tmp_path / "c.png"
    kw = {"title": "AUC vs iteration", "xlabel": "iteration", "ylabel": "AUC", **kw}
    plot.save_learning_curve(path, series, hlines=hlines, **kw)
    return read_png(path)


def test_chart_draws_series_hlines_and_text(tmp_path):
    it = np.arange(0, 2001, 100)
    img = _chart(tmp_path, {"train": (it, 0.8 - 0.3 * np.exp(-it / 500)),
                            "eval": (list(it), list(0.78 - 0.3 * np.exp(-it / 600)))},
                 hlines={"Bayes-optimal AUC": 0.81}, width=640, height=400)
    assert img.shape == (400, 640, 3)
    assert np.all(img[0, 0] == 255)                       # white background
    for rgb in plot.PALETTE[:3]:                          # 2 series + 1 hline, exact colours
        assert has_colour(img, rgb), rgb
    assert not has_colour(img, plot.PALETTE[3])           # nothing drawn in an unused colour
    dark = np.all(img < 80, axis=2)                       # frame, ticks and black text
    assert dark[:40].sum() > 100                          # the 2x title in the top band
    assert dark[-50:].sum() > 50                          # x tick labels and x label


def test_chart_series_are_where_the_data_says(tmp_path):
    # A flat line at y=1 between y=0 and y=2 points must sit in the vertical middle of the plot.
    img = _chart(tmp_path, {"lo": ([0, 10], [0, 0]), "mid": ([0, 10], [1, 1]), "hi": ([0, 10], [2, 2])})
    band = img[:, 395:405]                                # middle columns: clear of the legend
    rows = [np.flatnonzero(np.all(band == np.array(c, np.uint8), axis=2).any(axis=1))
            for c in plot.PALETTE[:3]]
    lo, mid, hi = (np.median(r) for r in rows)
    assert hi < mid < lo                                  # larger y is higher up
    assert abs(mid - (lo + hi) / 2) <= 1.5


@pytest.mark.parametrize("series,hlines", [
    ({"one": ([3], [0.5])}, None),                                       # single point
    ({"nan": ([0, 1, 2, 3], [0.5, np.nan, 0.7, np.inf])}, None),         # NaN / inf skipped
    ({"allnan": ([0, 1], [np.nan, np.nan])}, {"ref": 0.5}),
    ({"const": ([0, 1, 2], [0.7, 0.7, 0.7])}, None),                     # zero y range
    ({"samex": ([5, 5], [1, 2])}, None),                                 # zero x range
    ({"huge": ([0, 1e5, 3.3e5], [1e12, 5e11, 2e11])}, None),
    ({"tiny": ([0, 1, 2], [1.2e-9, 5e-10, 3e-10])}, {"floor": 2e-10}),
    ({"neg": ([-5, 0, 5], [-1e-3, 0, 2e-3])}, None),
    ({"empty": ([], [])}, {"nan ref": float("nan")}),
    ({}, None),
    ({f"s{i}": ([0, 1], [i, i + 1]) for i in range(14)}, {"a": 3.0}),    # more series than colours
    ({"none ok": ([0, 1, 2], [0.1, None, 0.3])}, None),
])
def test_chart_edge_cases_do_not_crash(tmp_path, series, hlines):
    img = _chart(tmp_path, series, hlines, width=400, height=260)
    assert img.shape == (260, 400, 3)
    assert (img < 255).any()


def test_chart_single_point_and_nan_gap_are_visible(tmp_path):
    img = _chart(tmp_path, {"one": ([3], [0.5])})
    assert has_colour(img, plot.PALETTE[0])               # its marker
    # The NaN breaks the line: no series-coloured pixels between x=1 and x=2 columns of the plot.
    img = _chart(tmp_path, {"gap": ([0, 1, 2, 3], [0.0, 1.0, np.nan, 1.0])}, width=800)
    cols = np.flatnonzero(np.all(img == np.array(plot.PALETTE[0], np.uint8), axis=2).any(axis=0))
    span = cols.max() - cols.min()
    gap = np.diff(cols).max()
    assert gap > span / 3 - 10                            # the 1 -> 3 stretch is empty


def test_chart_unknown_characters_and_long_titles(tmp_path):
    img = _chart(tmp_path, {"\u00e9t\u00e9": ([0, 1], [0, 1])}, title="x" * 500, width=200, height=150)
    assert img.shape == (150, 200, 3)


def test_chart_input_errors(tmp_path):
    with pytest.raises(ValueError, match="2 x values but 3 y values"):
        _chart(tmp_path, {"bad": ([0, 1], [0, 1, 2])})
    with pytest.raises(ValueError, match="too small"):
        _chart(tmp_path, {"a": ([0], [0])}, width=100, height=100)
