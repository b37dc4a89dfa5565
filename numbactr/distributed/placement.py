"""Where a rank runs: its node, its local rank, its GPU, and how its collectives travel.

Pure decisions over plain values, so that the cpu test suite exercises exactly the code a GPU job runs:

* ``local_from_env(env)``: the launcher's local rank and local size (Open MPI, MPICH/Intel MPI, PMI,
  MVAPICH2, Slurm), or None without one.
* ``node_of(leaders, rank)``: the node index of a rank from every rank's node leader (the world rank of
  local rank 0 of its node, gathered over MPI's shared-memory split communicator).
* ``choose_gpu(...)``: one GPU per rank. HugeCTR's ``vvgpu=[[0, 1, ...], ...]`` lists each node's GPUs;
  local rank i of node n uses ``vvgpu[n][i % len(vvgpu[n])]``. Without an explicit vvgpu (HugeCTR's
  default ``[[0]]``) local rank i uses visible GPU ``i % visible`` so that ranks never pile onto GPU 0.
* ``choose_transport(...)``: NCCL (through CuPy) when every rank of the job has a GPU of its own and
  ``cupy.cuda.nccl`` imports; host-staged MPI otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

#: (local rank, local size) variables of the launchers, in the order they are trusted
LOCAL_ENV = (
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),     # Open MPI
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),                           # MPICH hydra, Intel MPI
    ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),                             # PMI-2/PMIx launchers
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),       # MVAPICH2
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),                       # srun
)

DEFAULT_VVGPU = ((0,),)          # HugeCTR's default: "GPU 0", which numbactr reads as "not chosen"


class PlacementError(ValueError):
    """A launcher variable or a vvgpu that cannot place this rank."""


@dataclass(frozen=True)
class Placement:
    """This rank's place in the job: world rank/size, local rank/size on its node, node index/count,
    and where the local values came from (for the device report)."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node: int = 0
    nodes: int = 1
    source: str = "one process"


def _int_var(env, name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    raw = raw.strip()
    if not raw.isdigit():
        # Slurm writes SLURM_NTASKS_PER_NODE as "2(x3)" on uneven allocations: the first count is this
        # layout's, and only the local rank matters for the choice of GPU
        head = raw.split("(")[0].split(",")[0]
        if name == "SLURM_NTASKS_PER_NODE" and head.isdigit():
            return int(head)
        raise PlacementError(f"environment variable {name}={raw!r} is not a non-negative integer")
    return int(raw)


def local_from_env(env) -> tuple[int, int | None, str] | None:
    """(local rank, local size or None, variable) from the first launcher variable set in `env`
    (a mapping such as os.environ), or None when no launcher set one."""
    for rank_var, size_var in LOCAL_ENV:
        local = _int_var(env, rank_var)
        if local is None:
            continue
        size = _int_var(env, size_var)
        if size is not None and local >= size:
            raise PlacementError(f"environment: {rank_var}={local} is not below {size_var}={size}")
        return local, size, rank_var
    return None


def node_of(leaders: list[int], rank: int) -> tuple[int, int]:
    """(node index, node count) of `rank`: leaders[r] is the world rank of the first rank on r's node
    (local rank 0 of MPI's shared-memory split); nodes are numbered by their leaders' ranks."""
    if not 0 <= rank < len(leaders):
        raise PlacementError(f"rank {rank} is outside the {len(leaders)} gathered node leaders")
    order = sorted(set(leaders))
    return order.index(leaders[rank]), len(order)


def _vvgpu_tuple(vvgpu) -> tuple[tuple[int, ...], ...]:
    try:
        out = tuple(tuple(int(g) for g in node) for node in vvgpu)
    except TypeError:
        raise PlacementError(f"vvgpu must be a list of per-node GPU lists such as [[0, 1]], got {vvgpu!r}") \
            from None
    if not out or any(len(n) == 0 for n in out):
        raise PlacementError(f"vvgpu={vvgpu!r} has an empty node list")
    if any(g < 0 for n in out for g in n):
        raise PlacementError(f"vvgpu={vvgpu!r} lists a negative GPU index")
    return out


def choose_gpu(local_rank: int, node: int, visible: int, vvgpu=None) -> tuple[int, str]:
    """(GPU index among the visible ones, why) for local rank `local_rank` of node `node`.

    vvgpu None or HugeCTR's default [[0]]: GPU ``local_rank % visible``. An explicit vvgpu: node n's
    list is ``vvgpu[n]`` (a single list serves every node) and local rank i takes
    ``vvgpu[n][i % len(vvgpu[n])]``, which must be a visible GPU."""
    if visible < 1:
        raise PlacementError("no visible CUDA GPU to choose from")
    if local_rank < 0 or node < 0:
        raise PlacementError(f"local rank {local_rank} / node {node} must be >= 0")
    vv = DEFAULT_VVGPU if vvgpu is None else _vvgpu_tuple(vvgpu)
    if vv == DEFAULT_VVGPU:
        gpu = local_rank % visible
        return gpu, f"local rank {local_rank} of {visible} visible GPU(s) -> GPU {gpu}"
    if len(vv) == 1:
        gpus, which = vv[0], "vvgpu[0] (one list for every node)"
    elif node < len(vv):
        gpus, which = vv[node], f"vvgpu[{node}]"
    else:
        raise PlacementError(f"vvgpu lists {len(vv)} nodes but this rank runs on node {node}: give one GPU "
                             f"list per node")
    gpu = gpus[local_rank % len(gpus)]
    if gpu >= visible:
        raise PlacementError(f"{which}={list(gpus)} asks local rank {local_rank} for GPU {gpu}, but only "
                             f"{visible} GPU(s) are visible (0..{visible - 1}; CUDA_VISIBLE_DEVICES renumbers)")
    return gpu, f"local rank {local_rank} -> {which}[{local_rank % len(gpus)}] = GPU {gpu}"


def idle_gpus(placement: Placement, vvgpu) -> list[tuple[int, int]]:
    """(node, GPU) pairs that an explicit vvgpu lists but no rank of this job uses, assuming every node
    runs placement.local_size ranks (what CreateSolver warns about)."""
    vv = _vvgpu_tuple(vvgpu)
    idle = []
    for n, gpus in enumerate(vv):
        if n >= placement.nodes:
            idle.extend((n, g) for g in gpus)
            continue
        used = {gpus[i % len(gpus)] for i in range(placement.local_size)}
        idle.extend((n, g) for g in gpus if g not in used)
    return idle


def choose_transport(size: int, device_kind: str, gpu_per_rank: bool, nccl_importable: bool,
                     forced: str = "") -> tuple[str, str]:
    """('nccl' | 'mpi', why): how device buffers travel between ranks.

    NCCL needs several ranks, the gpu device, a GPU of its own on every rank (``gpu_per_rank``: the
    ranks' chosen (node, GPU) pairs are all different) and cupy.cuda.nccl; everything else stages
    through host memory and MPI. ``forced`` is NUMBACTR_COMM's value: 'mpi' turns NCCL off, 'nccl'
    makes its absence an error."""
    forced = (forced or "").strip().lower()
    if forced not in ("", "nccl", "mpi"):
        raise PlacementError(f"NUMBACTR_COMM={forced!r}: expected nccl or mpi")
    if size <= 1:
        return "mpi", "one rank: no collectives to run"
    if forced == "mpi":
        return "mpi", "NUMBACTR_COMM=mpi: host-staged MPI"
    missing = []
    if device_kind != "gpu":
        missing.append(f"the device is {device_kind}, not gpu")
    elif not gpu_per_rank:
        missing.append("some ranks share a GPU")
    if not nccl_importable:
        missing.append("cupy.cuda.nccl does not import")
    if missing:
        if forced == "nccl":
            raise PlacementError("NUMBACTR_COMM=nccl, but " + "; ".join(missing))
        return "mpi", "host-staged MPI: " + "; ".join(missing)
    return "nccl", f"NCCL through CuPy: {size} ranks, one GPU each"
