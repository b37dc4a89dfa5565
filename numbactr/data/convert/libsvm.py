"""libSVM text files -> HugeCTR data: ``numbactr data libsvm IN OUT``, the libFM converter with
inferred fields (see numbactr.data.convert.libfm)."""

from __future__ import annotations

import sys

from numbactr.data.convert.libfm import convert_libfm

__all__ = ["convert_libsvm", "main"]


def convert_libsvm(source, out_dir, fmt="parquet", fields="position", **kw):
    """``convert_libfm(..., kind="libsvm")``: fields "position", "single" or a list of boundaries."""
    return convert_libfm(source, out_dir, fmt, kind="libsvm", fields=fields, **kw)


def main(argv=None) -> int:
    from numbactr.data.convert.libfm import main as libfm_main

    return libfm_main(argv, kind="libsvm")


if __name__ == "__main__":
    sys.exit(main())
