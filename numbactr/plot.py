"""Learning-curve charts written as PNG files with only NumPy and zlib (no matplotlib).

The training job must run on fresh machines with minimal dependencies, so this module draws its own
charts: nice-number axes with tick marks and labels, one anti-aliased coloured polyline per series
with point markers, dashed horizontal reference lines, a legend, a title and axis labels. Text uses
the 5x7 bitmap font defined below (descenders take two rows more), scaled 2x for the title.

    save_learning_curve("auc.png", {"train": (iters, aucs)}, title="AUC on the test set",
                        xlabel="iteration", ylabel="AUC", hlines={"Bayes-optimal AUC": 0.81})
"""
import os
import struct
import zlib

import numpy as np

# Colour cycle (tab10): series take colours in order, hlines continue after the series.
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
_BG, _FG, _GRID, _BOX = (255, 255, 255), (40, 40, 40), (230, 230, 230), (170, 170, 170)

# One glyph per character of _CHARS: a hex byte per row, top row first, bit 4 = leftmost column.
# Rows 0-6 hold the glyph (baseline is row 6); rows 7-8 are given only for descenders (g j p q y , _).
_CHARS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz.,-:()/%=+_?!'*[]<>#| "
_HEX = """
0E11131519110E 040C040404040E 0E11010204081F 1F02040201110E 02060A121F0202 1F101E0101110E
0608101E11110E 1F010204080808 0E11110E11110E 0E11110F01020C
0E11111F111111 1E11111E11111E 0E11101010110E 1C12111111121C 1F10101E10101F 1F10101E101010
0E11101711110F 1111111F111111 0E04040404040E 0702020202120C 11121418141211 1010101010101F
111B1515111111 11111915131111 0E11111111110E 1E11111E101010 0E11111115120D 1E11111E141211
0F10100E01011E 1F040404040404 1111111111110E 11111111110A04 1111111515150A 11110A040A1111
1111110A040404 1F01020408101F
00000E010F110F 1010161911111E 00000E1010110E 01010D1311110F 00000E111F100E 0609081C080808
00000F1111110F010E 10101619111111 04000C0404040E 02000602020202120C 10101214181412
0C04040404040E 00001A15151515 00001619111111 00000E1111110E 00001E1111111E1010
00000F1111110F0101 00001619101010 00000F100E011E 08081C08080906 0000111111130D
00001111110A04 0000111115150A 0000110A040A11 0000111111110F010E 00001F0204081F
00000000000C0C 00000000000C0C0408 0000001F000000 000C0C000C0C00 02040808080402 08040202020408
00010204081000 18190204081303 00001F001F0000 0004041F040400 000000000000001F 0E110102040004
04040404040004 04040800000000 0004150E150400 0E08080808080E 0E02020202020E 02040810080402
08040201020408 0A0A1F0A1F0A0A 04040404040404 00000000000000
"""
_ROWS = [bytes.fromhex(h).ljust(9, b"\0") for h in _HEX.split()]
assert len(_ROWS) == len(_CHARS)
FONT = np.unpackbits(np.frombuffer(b"".join(_ROWS), np.uint8).reshape(-1, 9, 1), axis=2)[..., 3:]
FONT = FONT.astype(bool)                                       # (n_glyphs, 9, 5)
_INDEX = {c: i for i, c in enumerate(_CHARS)}


def write_png(path, rgb) -> None:
    """Write an (H, W, 3) uint8 array as an 8-bit RGB PNG (filter 0 on every row, zlib level 6)."""
    a = np.ascontiguousarray(rgb)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"write_png needs a non-empty (H, W, 3) uint8 array, got {a.dtype} {a.shape}")
    h, w, _ = a.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), a.reshape(h, w * 3)], axis=1)  # (H, 1 + 3W)

    def chunk(tag, body):
        return (struct.pack(">I", len(body)) + tag + body
                + struct.pack(">I", zlib.crc32(tag + body) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n"
           + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))   # 8 bit, RGB, no interlace
           + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
           + chunk(b"IEND", b""))
    # Write then rename, so a viewer polling the chart during training never sees half a file.
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(png)
    os.replace(tmp, path)


def axis_limits(lo: float, hi: float, pad: float = 0.04):
    """Axis range for data spanning [lo, hi]: widened by `pad` of the span on each side so that
    markers at the extremes stay off the frame; a zero-width range is opened around its value so
    that the axis never divides by zero; non-finite input gives (0, 1)."""
    lo, hi = (float(lo), float(hi)) if np.isfinite(lo) and np.isfinite(hi) else (0.0, 1.0)
    lo, hi = min(lo, hi), max(lo, hi)
    if hi - lo <= max(abs(lo), abs(hi)) * 1e-12:
        w = abs(lo) * 0.1 if lo != 0 else 1.0
        return lo - w, hi + w
    return lo - pad * (hi - lo), hi + pad * (hi - lo)


def nice_ticks(lo: float, hi: float, target: int = 6):
    """Round tick values inside [lo, hi], about `target` intervals apart: (ticks, step).

    The step is 1, 2, 2.5 or 5 times a power of ten; ticks are integer multiples of it."""
    lo, hi = axis_limits(lo, hi, 0.0)
    raw = (hi - lo) / max(int(target), 1)
    mag = 10.0 ** np.floor(np.log10(raw))
    step = mag * next(m for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    k0, k1 = np.ceil(lo / step - 1e-9), np.floor(hi / step + 1e-9)
    ticks = np.arange(k0, k1 + 1) * step                       # integer multiples: no drift
    ticks[np.abs(ticks) < step * 1e-6] = 0.0                   # no "-0"
    return ticks, step


def format_ticks(ticks, step) -> list:
    """Compact labels with just enough digits to tell neighbouring ticks apart: '0.05', '1.2e+05'."""
    ticks = np.asarray(ticks, np.float64)
    big = max(float(np.abs(ticks).max()) if ticks.size else 0.0, step)
    mant = step / 10.0 ** np.floor(np.log10(step))
    extra = 1 if abs(mant - 2.5) < 1e-6 else 0                 # 2.5-steps need one more digit
    if big >= 1e5 or big < 1e-3:                              # exponent form for extremes
        d = int(np.clip(np.floor(np.log10(big)) - np.floor(np.log10(step)) + extra, 0, 15))
        out = []
        for t in ticks:
            m, e = f"{t:.{d}e}".split("e")
            out.append(("0" if t == 0 else (m.rstrip("0").rstrip(".") if "." in m else m) + "e" + e))
        return out
    d = int(np.clip(-np.floor(np.log10(step)) + extra, 0, 15))
    return ["0" if t == 0 else f"{t:.{d}f}" for t in ticks]


def _text_mask(text: str, scale: int = 1):
    """Boolean (9*scale, (6*len - 1)*scale) bitmap of `text`; unknown characters draw as '?'."""
    idx = [_INDEX.get(c, _INDEX["?"]) for c in str(text)]
    if not idx:
        return np.zeros((9 * scale, 0), bool)
    glyphs = np.pad(FONT[idx], ((0, 0), (0, 0), (0, 1)))      # (n, 9, 6): blank column after each
    mask = glyphs.transpose(1, 0, 2).reshape(9, -1)[:, :-1]
    return mask.repeat(scale, axis=0).repeat(scale, axis=1)


def _text_width(text: str, scale: int = 1) -> int:
    return max(6 * len(str(text)) - 1, 0) * scale


def _text(img, x, y, text, color, scale=1, ha="left", va="top", rotate=False):
    """Draw text anchored at (x, y); ha/va pick which edge or centre of the text sits there.
    rotate=True turns it 90 degrees counter-clockwise (reads bottom to top, for the y label)."""
    m = _text_mask(text, scale)
    if rotate:
        m = np.rot90(m)
    h, w = m.shape
    x0 = int(x) - {"left": 0, "center": w // 2, "right": w}[ha]
    y0 = int(y) - {"top": 0, "center": (7 * scale if not rotate else h) // 2, "bottom": h}[va]
    H, W = img.shape[:2]
    cx0, cy0, cx1, cy1 = max(x0, 0), max(y0, 0), min(x0 + w, W), min(y0 + h, H)   # clip
    if cx0 < cx1 and cy0 < cy1:
        img[cy0:cy1, cx0:cx1][m[cy0 - y0:cy1 - y0, cx0 - x0:cx1 - x0]] = color


def _fill(img, x0, y0, x1, y1, color):
    """Fill the pixel rectangle [x0, x1) x [y0, y1), clipped to the image."""
    H, W = img.shape[:2]
    x0, y0, x1, y1 = max(int(x0), 0), max(int(y0), 0), min(int(x1), W), min(int(y1), H)
    if x0 < x1 and y0 < y1:
        img[y0:y1, x0:x1] = color


def _stroke(img, p0, p1, width, color):
    """Anti-aliased segment p0 -> p1 of the given width (pixel centres at integer x, y); a
    zero-length segment is a disc. Coverage comes from each pixel's distance to the segment."""
    H, W = img.shape[:2]
    r = width / 2 + 1
    xa, xb = max(int(np.floor(min(p0[0], p1[0]) - r)), 0), min(int(np.ceil(max(p0[0], p1[0]) + r)), W - 1)
    ya, yb = max(int(np.floor(min(p0[1], p1[1]) - r)), 0), min(int(np.ceil(max(p0[1], p1[1]) + r)), H - 1)
    if xa > xb or ya > yb:
        return
    ys, xs = np.mgrid[ya:yb + 1, xa:xb + 1].astype(np.float64)
    vx, vy = p1[0] - p0[0], p1[1] - p0[1]
    l2 = vx * vx + vy * vy
    t = np.clip(((xs - p0[0]) * vx + (ys - p0[1]) * vy) / l2, 0, 1) if l2 > 0 else 0.0
    d = np.hypot(xs - (p0[0] + t * vx), ys - (p0[1] + t * vy))
    a = np.clip(width / 2 + 0.5 - d, 0.0, 1.0)[..., None]     # (h, w, 1) coverage
    sub = img[ya:yb + 1, xa:xb + 1]
    sub[...] = sub * (1 - a) + np.asarray(color, np.float32) * a


def save_learning_curve(path, series, *, title, xlabel, ylabel, hlines=None, width=800,
                        height=500) -> None:
    """Draw `series` {name: (x values, y values)} as a line chart and write it as a PNG at `path`.

    Non-finite (NaN/inf) points are skipped: the line breaks there, the other points still show.
    `hlines` {name: y} are drawn as dashed horizontal reference lines. The legend goes in the plot
    corner that covers the least of the drawn data."""
    if width < 160 or height < 120:
        raise ValueError(f"chart too small: {width}x{height} (needs at least 160x120)")
    hlines = {str(k): float(v) for k, v in (hlines or {}).items()}
    data = []
    for name, (xs, ys) in series.items():
        x, y = np.asarray(xs, np.float64).ravel(), np.asarray(ys, np.float64).ravel()
        if x.shape != y.shape:
            raise ValueError(f"series {name!r}: {x.size} x values but {y.size} y values")
        data.append((str(name), x, y, np.isfinite(x) & np.isfinite(y)))
    allx = np.concatenate([x[ok] for _, x, _, ok in data] + [np.empty(0)])
    ally = np.concatenate([y[ok] for _, _, y, ok in data]
                          + [np.array([v for v in hlines.values() if np.isfinite(v)])])
    xlo, xhi = (allx.min(), allx.max()) if allx.size else (0.0, 1.0)
    ylo, yhi = (ally.min(), ally.max()) if ally.size else (0.0, 1.0)
    (ymin, ymax), (xmin, xmax) = axis_limits(ylo, yhi), axis_limits(xlo, xhi, 0.02)
    top, bottom, right = 46, 52, 24
    ph = height - top - bottom                                 # plot area height in pixels
    yt, ystep = nice_ticks(ymin, ymax, max(3, min(8, ph // 50)))
    ylabels = format_ticks(yt, ystep)
    left = 12 + 9 + 10 + max((_text_width(s) for s in ylabels), default=0) + 8
    pw = width - left - right                                  # plot area width in pixels
    for target in range(max(2, min(8, pw // 100)), 0, -1):   # fewer ticks until labels fit
        xt, xstep = nice_ticks(xmin, xmax, target)
        xlabels = format_ticks(xt, xstep)
        if xstep / (xmax - xmin) * pw >= max((_text_width(s) for s in xlabels), default=0) + 12:
            break

    def sx(v):
        return left + (np.asarray(v, np.float64) - xmin) / (xmax - xmin) * (pw - 1)

    def sy(v):
        return top + (ymax - np.asarray(v, np.float64)) / (ymax - ymin) * (ph - 1)

    img = np.empty((height, width, 3), np.float32)             # (H, W, RGB), blended in float
    img[:] = _BG
    bot = top + ph                                             # first row below the plot area
    for t, lab in zip(xt, xlabels):
        c = int(round(float(sx(t))))
        _fill(img, c, top, c + 1, bot, _GRID)
        _fill(img, c, bot, c + 1, bot + 5, _FG)                # tick mark
        _text(img, c, bot + 8, lab, _FG, ha="center")
    for t, lab in zip(yt, ylabels):
        r = int(round(float(sy(t))))
        _fill(img, left, r, left + pw, r + 1, _GRID)
        _fill(img, left - 5, r, left, r + 1, _FG)
        _text(img, left - 8, r, lab, _FG, ha="right", va="center")
    for x0, y0, x1, y1 in ((left, top, left + pw, top + 1), (left, bot - 1, left + pw, bot),
                           (left, top, left + 1, bot), (left + pw - 1, top, left + pw, bot)):
        _fill(img, x0, y0, x1, y1, _FG)                        # frame
    _text(img, left + pw // 2, bot + 28, xlabel, _FG, ha="center")
    _text(img, 12, top + ph // 2, ylabel, _FG, va="center", rotate=True)
    title, tscale = str(title), 2 if _text_width(title, 2) <= width - 20 else 1
    while _text_width(title) > width - 20:                     # too long even at 1x: shorten
        title = title[:-3] + ".."
    _text(img, width // 2, 14 if tscale == 2 else 20, title, _FG, scale=tscale, ha="center")

    before = img.copy()
    entries = []                                               # (name, colour, dashed)
    cols = np.arange(left + 1, left + pw - 1)
    for i, (name, v) in enumerate(hlines.items()):
        color = PALETTE[(len(data) + i) % len(PALETTE)]
        entries.append((name, color, True))
        if np.isfinite(v):
            r = int(round(float(sy(v))))
            img[max(r - 1, 0):r + 1, cols[(cols - left) % 12 < 7]] = color   # 2 px, 7-on 5-off
    for i, (name, x, y, ok) in enumerate(data):
        color = PALETTE[i % len(PALETTE)]
        entries.insert(i, (name, color, False))
        px, py = sx(x), sy(y)
        for j in np.flatnonzero(ok[:-1] & ok[1:]):            # segments between finite neighbours
            _stroke(img, (px[j], py[j]), (px[j + 1], py[j + 1]), 2.0, color)
        if ok.sum() <= max(pw // 8, 1):                        # markers only while they stay apart
            for j in np.flatnonzero(ok):
                _stroke(img, (px[j], py[j]), (px[j], py[j]), 6.0, color)

    if entries:
        ink = np.any(np.abs(img - before) > 8, axis=2)         # (H, W) pixels the data touched
        lw = 40 + max(_text_width(n) for n, _, _ in entries) + 8
        lh = 14 * len(entries) + 8
        xs_ = (max(left + pw - 8 - lw, 0), left + 8)
        ys_ = (top + 8, max(bot - 8 - lh, 0))
        corners = [(xs_[0], ys_[0]), (xs_[1], ys_[0]), (xs_[0], ys_[1]), (xs_[1], ys_[1])]
        bx, by = min(corners, key=lambda c: ink[c[1]:c[1] + lh, c[0]:c[0] + lw].sum())
        _fill(img, bx, by, bx + lw, by + lh, _BOX)
        _fill(img, bx + 1, by + 1, bx + lw - 1, by + lh - 1, _BG)
        for k, (name, color, dashed) in enumerate(entries):
            ty = by + 6 + 14 * k
            if dashed:
                _fill(img, bx + 6, ty + 3, bx + 14, ty + 5, color)
                _fill(img, bx + 20, ty + 3, bx + 28, ty + 5, color)
            else:
                _stroke(img, (bx + 6, ty + 3.5), (bx + 28, ty + 3.5), 2.0, color)
                _stroke(img, (bx + 17, ty + 3.5), (bx + 17, ty + 3.5), 6.0, color)
            _text(img, bx + 34, ty, name, color)
    write_png(path, np.clip(np.round(img), 0, 255).astype(np.uint8))
