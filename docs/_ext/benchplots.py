"""Sphinx extension: the ``bench-results`` directive draws a benchmark result file as a plot and a table.

In a MyST page::

    ```{bench-results} benchmarks/results/hash-2026-11-25.json
    :name: hash table
    :metric: Mkeys/s
    :x: keys, op
    :where: threads=1
    ```

The argument is a result file (numbactr/bench/results.py's schema: ``numbactr bench ... --json PATH``
writes them), relative to the page or, with a leading ``/``, to the documentation's root. The file is
checked (a problem fails the build, naming the file). Of its results the directive keeps those whose
``name`` contains ``:name:`` and whose fields match every ``field=value`` of ``:where:`` (``;``-separated),
and shows:

* the run's context: command, date, machine, threads, versions, where the figures come from, notes;
* a grouped bar chart (matplotlib, Agg) of each metric in ``:metric:`` (comma-separated; default the first
  metric of the kept results), one bar per value of ``:group:`` (default ``implementation``: numbactr
  beside its peers) over categories made of the ``:x:`` fields (default every field that varies), on a log
  axis with ``:log:``; ``:plot: none`` leaves the chart out (for figures that are counts, not comparisons);
* a table of every kept figure: a row per implementation and shape, a column per metric.

The chart is a PNG under ``_generated/benchplots/`` in the source folder (git-ignored), named by a hash of
the file and the options, and reaches the output like any image (Sphinx copies it to ``_images``). The
result file is a dependency of the page: editing it rebuilds the page.
"""

from __future__ import annotations

import hashlib
import os

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

from numbactr.bench import results as bench_results

GENERATED = os.path.join("_generated", "benchplots")
#: the fields a table or chart never groups by (the result's own fields and the range marker's partner)
OWN = set(bench_results.RESULT_FIELDS)


def _fmt(v) -> str:
    """A figure as the bench tables print it: thousands separated, three significant digits below 100."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or (float(v).is_integer() and abs(v) >= 100):
        return f"{int(v):,}"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a == 0 or a >= 1e-3:
        return f"{v:.3g}"
    return f"{v:.2g}"


def _fields(rows) -> list:
    """The parameter fields of the results, in first-seen order."""
    seen = {}
    for r in rows:
        for k in r:
            if k not in OWN:
                seen.setdefault(k, None)
    return list(seen)


def _varying(rows, fields) -> list:
    return [f for f in fields if len({repr(r.get(f)) for r in rows}) > 1]


def _label(r, fields) -> str:
    return ", ".join(f"{f}={r[f]}" for f in fields if f in r) or "all"


def _where(text: str) -> list:
    pairs = []
    for part in filter(None, (p.strip() for p in (text or "").split(";"))):
        field, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f":where: expects field=value pairs separated by ';', got {part!r}")
        pairs.append((field.strip(), value.strip()))
    return pairs


def _matches(r, pairs) -> bool:
    return all(str(r.get(f)) == v for f, v in pairs)


class BenchResults(SphinxDirective):
    """``bench-results``: the module docstring says what it draws."""

    required_arguments = 1
    has_content = False
    option_spec = {
        "name": directives.unchanged,
        "metric": directives.unchanged,
        "x": directives.unchanged,
        "group": directives.unchanged,
        "where": directives.unchanged,
        "log": directives.flag,
        "plot": lambda arg: directives.choice(arg, ("bar", "none")),
        "caption": directives.unchanged,
    }

    def run(self) -> list:
        rel, path = self.env.relfn2path(self.arguments[0], self.env.docname)
        self.env.note_dependency(rel)
        try:
            doc = bench_results.load(path)
            kept = self._select(doc["results"])
        except (OSError, ValueError) as e:
            raise self.error(f"bench-results {self.arguments[0]}: {e}") from None
        group = self.options.get("group", "implementation").strip()
        fields = [f for f in _fields(kept) if f != group]
        out = [self._context(doc, rel)]
        if self.options.get("plot", "bar") != "none":
            out.append(self._figure(doc, kept, group, fields, rel, path))
        out.append(self._table(kept, group, fields))
        return out

    # ---- what is shown ------------------------------------------------------------------------------
    def _select(self, rows) -> list:
        name = self.options.get("name", "")
        pairs = _where(self.options.get("where", ""))
        kept = [r for r in rows if name in r["name"] and _matches(r, pairs)]
        if not kept:
            raise ValueError(f"no result matches :name: {name!r} and :where: {self.options.get('where', '')!r}")
        return kept

    def _metrics(self, kept) -> list:
        have = list(dict.fromkeys(r["metric"] for r in kept))
        wanted = [m.strip() for m in self.options.get("metric", "").split(",") if m.strip()] or have[:1]
        missing = [m for m in wanted if m not in have]
        if missing:
            raise self.error(f"bench-results {self.arguments[0]}: no metric {missing}; the file has {have}")
        return wanted

    def _context(self, doc, rel) -> nodes.Node:
        mach = doc["machine"]
        gpu = mach.get("gpu") or "no GPU"
        items = [
            ("command", nodes.literal(text=" ".join(doc["command"]))),
            ("date", nodes.Text(doc["date"])),
            (
                "machine",
                nodes.Text(f"{mach['cpu']}, {mach['cores']} cores, {gpu}; {mach['platform']}; Python {mach['python']}"),
            ),
            ("threads", nodes.Text(", ".join(f"{k} {v}" for k, v in doc["threads"].items()))),
            ("versions", nodes.Text(", ".join(f"{k} {v or 'not recorded'}" for k, v in doc["versions"].items()))),
            ("data", nodes.literal(text=rel)),
        ]
        if doc.get("source"):
            items.append(("source", nodes.Text(doc["source"])))
        if doc.get("notes"):
            items.append(("notes", nodes.Text(doc["notes"])))
        fl = nodes.field_list()
        for key, value in items:
            body = nodes.paragraph()
            body += value
            fl += nodes.field("", nodes.field_name(text=key), nodes.field_body("", body))
        return fl

    def _figure(self, doc, kept, group, fields, rel, path) -> nodes.Node:
        metrics = self._metrics(kept)
        xs = [f.strip() for f in self.options["x"].split(",")] if "x" in self.options else None
        shown = [r for r in kept if r["metric"] in metrics]
        xfields = xs if xs is not None else _varying(shown, fields)
        key = repr((rel, sorted(self.options.items()), os.path.getmtime(path)))
        stem = os.path.splitext(os.path.basename(rel))[0]
        name = f"{stem}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.png"
        target = os.path.join(self.env.srcdir, GENERATED, name)
        _draw(target, shown, metrics, group, xfields, "log" in self.options, self.options.get("caption") or "")
        uri = "/" + "/".join((*GENERATED.split(os.sep), name))
        fig = nodes.figure()
        fig += nodes.image(uri=uri, alt=f"{stem}: {', '.join(metrics)} by {group}", candidates={"*": uri})
        caption = self.options.get("caption") or f"{', '.join(metrics)} by {group} ({doc['date'][:10]})"
        fig += nodes.caption(text=caption)
        return fig

    def _table(self, kept, group, fields) -> nodes.Node:
        metrics = list(dict.fromkeys(r["metric"] for r in kept))
        names = list(dict.fromkeys(r["name"] for r in kept))
        keys = (["name"] if len(names) > 1 else []) + [group] + fields
        rows = {}
        for r in kept:
            row = rows.setdefault(tuple(repr(r.get(k)) for k in keys), {k: r.get(k) for k in keys})
            row.setdefault(r["metric"], r["value"])
        header = keys + metrics
        table = nodes.table(classes=["bench-results"])
        tgroup = nodes.tgroup(cols=len(header))
        table += tgroup
        tgroup += [nodes.colspec(colwidth=1) for _ in header]
        thead, tbody = nodes.thead(), nodes.tbody()
        thead += _row(header)
        for row in rows.values():
            tbody += _row([_fmt(row[k]) if row.get(k) is not None else "" for k in header])
        tgroup += [thead, tbody]
        if len(names) == 1:
            table.insert(0, nodes.title(text=names[0]))
        return table


def _row(cells) -> nodes.row:
    row = nodes.row()
    for c in cells:
        entry = nodes.entry()
        entry += nodes.paragraph(text=str(c))
        row += entry
    return row


def _draw(target, rows, metrics, group, xfields, log, title) -> None:
    """A grouped bar chart per metric: categories from xfields, a bar per value of group."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cats = list(dict.fromkeys(_label(r, xfields) for r in rows))
    series = list(dict.fromkeys(str(r.get(group)) for r in rows))
    # numbactr first and in the same colour on every chart, its peers after it
    series = [s for _, s in sorted(enumerate(series), key=lambda p: (not p[1].startswith("numbactr"), p[0]))]
    width = max(6.0, min(16.0, 1.2 + 0.32 * len(cats) * max(1, len(series))))
    rotate = len(cats) > 4
    labels = 0.065 * max(map(len, cats)) if rotate else 0.3  # inches the tick labels take below each chart
    fig = Figure(figsize=(width, (3.0 + labels) * len(metrics)), dpi=100, layout="constrained")
    axes = fig.subplots(len(metrics), 1, squeeze=False)[:, 0]
    bar = 0.8 / max(1, len(series))
    for ax, metric in zip(axes, metrics):
        for k, s in enumerate(series):
            vals = {}
            for r in rows:
                if r["metric"] == metric and str(r.get(group)) == s:
                    vals.setdefault(_label(r, xfields), r["value"])
            xs = [i + (k - (len(series) - 1) / 2) * bar for i, c in enumerate(cats) if c in vals]
            ys = [vals[c] for c in cats if c in vals]
            if ys:
                ax.bar(xs, ys, bar, label=s, color=f"C{k}")
        ax.set_ylabel(metric)
        ax.set_xticks(
            range(len(cats)), cats, rotation=30 if rotate else 0, ha="right" if rotate else "center", fontsize=8
        )
        if log and all(r["value"] > 0 for r in rows if r["metric"] == metric):
            ax.set_yscale("log")
        ax.grid(True, axis="y", color="0.9")
        ax.set_axisbelow(True)
        ax.legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    FigureCanvasAgg(fig)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = target + ".tmp"
    fig.savefig(tmp, format="png", metadata={"Software": None})
    os.replace(tmp, target)


def setup(app) -> dict:
    app.add_directive("bench-results", BenchResults)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
