"""What the multi-rank tests share: the venv's mpiexec and one skip mark for machines without MPI."""

import importlib.util
import os
import shutil
import sys

import pytest

#: the mpiexec beside this interpreter (the [mpi] extra's MPICH) first, else the PATH's
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
HAVE_MPI = MPIEXEC is not None and importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs mpiexec and mpi4py (pip install 'numbactr[mpi]')")
