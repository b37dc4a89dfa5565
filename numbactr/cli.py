"""The ``numbactr`` command."""
from __future__ import annotations

import sys

USAGE = """usage: numbactr <command> [options]

commands:
  demo      train a DLRM on built-in planted-signal data and print its AUC (the main job)
  device    print which device numbactr would use and why
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
    if cmd == "device":
        from . import device
        device.kind()
        return 0
    print(f"numbactr: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
