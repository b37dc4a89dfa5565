"""Reader benchmark: samples/s delivered as training batches, Norm / Raw / RawAsync / Parquet x 1, 2, 4 workers.

    numbactr bench data [--samples 1000000] [--batch-size 16384] [--workers 1,2,4] [--step-ms 20] [--json PATH]

Data: Criteo-shaped (1 label, 13 dense float32, 26 one-hot slots), written once to a temporary folder:
Norm with Check_t.Sum and 32-bit keys in --files files, Raw (int32 label/dense, so the log(x + 1)
transform runs) in one file, read by the Raw reader and by the one-hot RawAsync reader (workers =
AsyncParam.num_threads, 4 batches ahead each; raw_async: buffered preadv, raw_async_direct: O_DIRECT, not
in the default --formats), Parquet (int64 key columns, slot_size_array offsets applied by the reader)
in --files files. Each cell is the best of --repeats full epoch-mode passes through the numbactr reader
(decode, validation, batch assembly, queue hand-off); the consumer only counts rows. Parquet normally
runs one worker per local device; here the worker count is forced (local_devices=W) to show scaling.

--step-ms S adds a second table: a loop that takes a batch and then idles S ms (standing in for a
device training step, during which the host thread waits) and reports the mean time the loop waited
for data per step after a warm-up of 3 steps: about 0 means reading overlaps the step completely.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import tempfile
import time

import numpy as np

from numbactr import log
from numbactr.runtime import threads
from numbactr.enums import Check_t, DataReaderType_t
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file
from numbactr.data.parquet import ParquetDatasetWriter
from numbactr.data.raw import write_raw_file
from numbactr.data.raw_async import AsyncParam
from numbactr.data.reader import DataReader

__all__ = ["main", "write_bench_data", "measure"]

SLOTS = 26
DENSE = 13
SLOT_SIZE = 10_000


def write_bench_data(d: str, samples: int, files: int, seed: int = 0) -> dict:
    """Write the three datasets; returns {"norm": list, "raw": path, "parquet": list}."""
    rng = np.random.default_rng(seed)
    bounds = np.linspace(0, samples, files + 1).astype(np.int64)
    norm_files = []
    pq = ParquetDatasetWriter(os.path.join(d, "parquet"), 1, DENSE, SLOTS)
    raw_path = os.path.join(d, "raw", "data.bin")
    os.makedirs(os.path.dirname(raw_path), exist_ok=True)
    open(raw_path, "wb").close()
    with log.progress(total=files, desc="bench data: write Norm, Raw, Parquet", unit="file") as bar:
        for f in range(files):
            _write_bench_file(d, f, int(bounds[f + 1] - bounds[f]), rng, pq, raw_path, norm_files)
            bar.update(1)
    norm_list = os.path.join(d, "norm", "_file_list.txt")
    write_file_list(norm_list, norm_files)
    return {"norm": norm_list, "raw": raw_path, "parquet": pq.close()}


def _write_bench_file(d, f, n, rng, pq, raw_path, norm_files) -> None:
    """File f (n samples) of the three formats: Norm part_f.data, Parquet part_f.parquet, Raw appended."""
    label = rng.integers(0, 2, (n, 1))
    counts = rng.integers(0, 1000, (n, DENSE))
    local = rng.integers(0, SLOT_SIZE, (n, SLOTS))
    glob = local + np.arange(SLOTS) * SLOT_SIZE
    p = os.path.join(d, "norm", f"part_{f}.data")
    os.makedirs(os.path.dirname(p), exist_ok=True)
    write_norm_file(p, label, np.log1p(counts).astype(np.float32), glob, Check_t.Sum, np.uint32)
    norm_files.append(p)
    pq.write_file(f"part_{f}.parquet", label, np.log1p(counts).astype(np.float32), local)
    write_raw_file(raw_path, label, counts, glob, float_label_dense=False, append=True)


def _reader(fmt: str, source: str, samples: int, batch: int, workers: int, repeat: bool = False):
    if fmt.startswith("raw_async"):
        ap = AsyncParam(workers, 4, 10, 2, 512, False, multi_hot_reader=False, is_dense_float=False)
        return DataReader(
            DataReaderType_t.RawAsync,
            source,
            batch,
            1,
            DENSE,
            [SLOTS],
            [[1] * SLOTS],
            False,
            repeat,
            async_param=ap,
            direct_io=fmt == "raw_async_direct",
        )
    t = {"norm": DataReaderType_t.Norm, "raw": DataReaderType_t.Raw, "parquet": DataReaderType_t.Parquet}[fmt]
    return DataReader(
        t,
        source,
        batch,
        1,
        DENSE,
        [SLOTS],
        [[1] * SLOTS],
        False,
        repeat,
        num_workers=workers,
        check_type=Check_t.Sum,
        num_samples=samples,
        slot_size_array=[SLOT_SIZE] * SLOTS if fmt == "parquet" else (),
        local_devices=workers,
    )


def measure(fmt, source, samples, batch, workers, repeats=2) -> float:
    """Best samples/s over `repeats` full passes."""
    r = _reader(fmt, source, samples, batch, workers)
    best = 0.0
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            n = sum(b.size for b in r)
            dt = time.perf_counter() - t
            if n != samples:
                raise RuntimeError(f"{fmt}: read {n} samples, expected {samples}")
            best = max(best, n / dt)
    finally:
        r.close()
    return best


def measure_wait(fmt, source, samples, batch, workers, step_ms, steps=40) -> tuple[float, float]:
    """(mean wait per step in ms after 3 warm-up steps, max wait) with a step of step_ms idle time."""
    r = _reader(fmt, source, samples, batch, workers, repeat=True)
    waits = []
    try:
        it = iter(r)
        for _ in range(steps):
            t = time.perf_counter()
            next(it)
            waits.append(time.perf_counter() - t)
            time.sleep(step_ms / 1000.0)
    finally:
        r.close()
    w = np.array(waits[3:]) * 1000.0
    return float(w.mean()), float(w.max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="numbactr bench data",
        description=__doc__.split("\n")[0],
        epilog="Explicit worker counts are measured as given; the training default "
        "comes from numbactr.runtime.threads (NUMBACTR_READER_WORKERS).",
    )
    ap.add_argument("--samples", type=int, default=1_000_000, help="samples per format (default: %(default)s)")
    ap.add_argument(
        "--files", type=int, default=4, help="Norm/Parquet files (>= the largest worker count; default: %(default)s)"
    )
    ap.add_argument("--batch-size", type=int, default=16384, help="batch size (default: %(default)s)")
    ap.add_argument(
        "--workers", default="1,2,4", help="worker counts to measure, comma-separated (default: %(default)s)"
    )
    ap.add_argument(
        "--formats",
        default="norm,raw,raw_async,parquet",
        help="formats to measure: norm, raw, raw_async, raw_async_direct, parquet (default: %(default)s)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="passes per cell, the best counts (default: %(default)s)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="also measure waits with an S ms step")
    ap.add_argument("--dir", default=None, help="where to write the data (default: a temporary folder)")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the results there as JSON")
    a = ap.parse_args(argv)
    try:
        workers = [int(w) for w in a.workers.split(",")]
    except ValueError:
        ap.error(f"--workers {a.workers!r}: expected comma-separated whole numbers, e.g. 1,2,4")
    formats = [f.strip().lower() for f in a.formats.split(",")]
    unknown = sorted(set(formats) - {"norm", "raw", "raw_async", "raw_async_direct", "parquet"})
    if unknown:
        ap.error(
            f"--formats: unknown format(s) {', '.join(unknown)}; choose from norm, raw, raw_async, "
            f"raw_async_direct, parquet"
        )
    if min(workers) < 1 or a.samples < 1 or a.batch_size < 1 or a.files < 1 or a.repeats < 1:
        ap.error("--samples, --files, --batch-size, --repeats and every worker count must be >= 1")
    if max(workers) > a.files:
        ap.error(f"--files {a.files} must be >= the largest worker count {max(workers)}")
    d = a.dir or tempfile.mkdtemp(prefix="numbactr_bench_")
    shape = dict(batch=a.batch_size, samples=a.samples, files=a.files, repeats=a.repeats)
    found = []  # the JSON results
    try:
        t = time.perf_counter()
        src = write_bench_data(d, a.samples, a.files)
        src["raw_async"] = src["raw_async_direct"] = src["raw"]
        print(f"wrote {a.samples} samples per format in {time.perf_counter() - t:.1f}s to {d}")
        print(
            f"\nReader throughput, {datetime.date.today().isoformat()}, {platform.node() or 'host'}: "
            f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, {a.samples} samples, "
            f"batch {a.batch_size}, 13 dense + 26 one-hot slots; workers as in each column, "
            f"{threads.current().describe()}\n"
        )
        print("| format | " + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in workers) + " |")
        print("|---|" + "---:|" * len(workers))
        with log.progress(total=len(formats) * len(workers), desc="bench data", unit="cell") as bar:
            for fmt in formats:
                cells = []
                for w in workers:
                    cells.append(measure(fmt, src[fmt], a.samples, a.batch_size, w, a.repeats))
                    found.append(_result("reader throughput", "samples/s", cells[-1], format=fmt, workers=w, **shape))
                    bar.update(1)
                print(f"| {fmt} | " + " | ".join(f"{c / 1e6:.2f} M/s" for c in cells) + " |", flush=True)
        if a.step_ms > 0:
            print(f"\nWait for data per step with a {a.step_ms:g} ms step (after 3 warm-up steps), mean / max ms:\n")
            print("| format | " + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in workers) + " |")
            print("|---|" + "---:|" * len(workers))
            for fmt in formats:
                cells = [measure_wait(fmt, src[fmt], a.samples, a.batch_size, w, a.step_ms) for w in workers]
                for w, (mean, most) in zip(workers, cells):
                    for metric, v in (("mean wait ms", mean), ("max wait ms", most)):
                        found.append(
                            _result("wait for data", metric, v, format=fmt, workers=w, step_ms=a.step_ms, **shape)
                        )
                print(f"| {fmt} | " + " | ".join(f"{m:.2f} / {x:.2f}" for m, x in cells) + " |", flush=True)
    finally:
        if a.dir is None:
            shutil.rmtree(d, ignore_errors=True)
    if a.json:
        from numbactr.bench import results

        notes = "Criteo-shaped data: 13 dense + 26 one-hot slots; samples/s: the best full epoch-mode pass"
        doc = results.document(
            found, command=None if argv is None else ["numbactr", "bench", "data", *argv], notes=notes
        )
        print(f"numbactr bench data: results written to {results.write(a.json, doc)}")
    return 0


def _result(name: str, metric: str, value: float, **params) -> dict:
    return {"name": name, "implementation": "numbactr", "metric": metric, "value": float(value), **params}


if __name__ == "__main__":
    raise SystemExit(main())
