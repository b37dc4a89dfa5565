"""The ``numbactr`` command."""
from __future__ import annotations

import sys

USAGE = """usage: numbactr <command> [options]

commands:
  demo                 train a DLRM on built-in planted-signal data and print its AUC (the main job)
  bench {hash,embedding,dlrm,all} [--quick]
                       kernel and training-step benchmarks (vs PyTorch when torch is installed)
  bench data           data-reader throughput (Norm, Raw, Parquet; 1, 2, 4 workers)
  data criteo ...      convert Criteo TSV click logs to Norm or Parquet
  device               print which device numbactr would use and why
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo
        return demo(rest)
    if cmd == "bench":
        if rest[:1] == ["data"]:
            from .data.bench import main as bench_data
            return bench_data(rest[1:])
        from .bench import main as bench
        return bench(rest)
    if cmd == "data":
        if rest[:1] == ["criteo"]:
            from .data.criteo import main as criteo
            return criteo(rest[1:])
        print("usage: numbactr data criteo --help", file=sys.stderr)
        return 2
    if cmd == "device":
        from . import device
        device.kind()
        return 0
    print(f"numbactr: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
