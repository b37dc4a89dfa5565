"""Where a rank runs: its node, its local rank, its GPU, and how its collectives travel.

Pure decisions over plain values, so that the cpu test suite exercises exactly the code a GPU job runs:

* ``local_from_env(env)``: the launcher's local rank and local size (Open MPI, MPICH/Intel MPI, PMI,
  MVAPICH2, Slurm), or None without one.
* ``node_of(leaders, rank)``: the node index of a rank from every rank's node leader (the world rank of
  local rank 0 of its node, gathered over MPI's shared-memory split communicator).
* ``choose_gpu(...)``: one GPU per rank. HugeCTR's ``vvgpu=[[0, 1, ...], ...]`` lists each node's GPUs;
  local rank i of node n uses ``vvgpu[n][i % len(vvgpu[n])]``. Without an explicit vvgpu (HugeCTR's
  default ``[[0]]``) local rank i uses visible GPU ``i % visible`` so that ranks never pile onto GPU 0.
  A rank that the launcher pinned to one GPU (``CUDA_VISIBLE_DEVICES`` names one device and one is
  visible: Slurm's ``--gpus-per-task=1``, wrapper scripts) uses it, whatever vvgpu lists: the launcher
  has already made the per-rank choice that vvgpu would make, and renumbered that GPU 0.
* ``own_gpus(rows)``: whether every rank has a GPU of its own, from every rank's (node, PCI address of
  its GPU) -- the physical GPU, as NCCL tells GPUs apart, never the visible index, which is 0 on every
  rank under per-rank ``CUDA_VISIBLE_DEVICES``.
* ``choose_transport(...)``: NCCL (through CuPy) when every rank of the job has a GPU of its own and
  ``cupy.cuda.nccl`` imports; host-staged MPI otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

#: (local rank, local size) variables of the launchers, in the order they are trusted
LOCAL_ENV = (
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH hydra, Intel MPI
    ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),  # PMI-2/PMIx launchers
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),  # MVAPICH2
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),  # srun
)

DEFAULT_VVGPU = ((0,),)  # HugeCTR's default: "GPU 0", which numbactr reads as "not chosen"


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
        raise PlacementError(f"vvgpu must be a list of per-node GPU lists such as [[0, 1]], got {vvgpu!r}") from None
    if not out or any(len(n) == 0 for n in out):
        raise PlacementError(f"vvgpu={vvgpu!r} has an empty node list")
    if any(g < 0 for n in out for g in n):
        raise PlacementError(f"vvgpu={vvgpu!r} lists a negative GPU index")
    return out


def pinned_device(visible_devices: str | None) -> str | None:
    """The one device a ``CUDA_VISIBLE_DEVICES`` value names (an index, ``GPU-<uuid>``, ``MIG-<uuid>``),
    or None when it is unset or names none or several. CUDA reads the comma-separated list up to its
    first invalid entry; only its length matters here."""
    if visible_devices is None:
        return None
    names = [d.strip() for d in visible_devices.split(",") if d.strip()]
    return names[0] if len(names) == 1 else None


def choose_gpu(
    local_rank: int, node: int, visible: int, vvgpu=None, visible_devices: str | None = None
) -> tuple[int, str]:
    """(GPU index among the visible ones, why) for local rank `local_rank` of node `node`.

    vvgpu None or HugeCTR's default [[0]]: GPU ``local_rank % visible``. An explicit vvgpu: node n's
    list is ``vvgpu[n]`` (a single list serves every node) and local rank i takes
    ``vvgpu[n][i % len(vvgpu[n])]``, which must be a visible GPU.

    `visible_devices` is the process's ``CUDA_VISIBLE_DEVICES`` (None when unset). When it names exactly
    one device and one GPU is visible, the launcher pinned this rank to that GPU (Slurm
    ``--gpus-per-task=1``, a wrapper script): the rank uses visible GPU 0 whatever vvgpu lists, since a
    HugeCTR script's ``vvgpu=[[0, 1, ..., 7]]`` names the node's GPUs, which the launcher has already
    handed out one per rank, renumbering each rank's own GPU 0."""
    if visible < 1:
        raise PlacementError("no visible CUDA GPU to choose from")
    if local_rank < 0 or node < 0:
        raise PlacementError(f"local rank {local_rank} / node {node} must be >= 0")
    vv = DEFAULT_VVGPU if vvgpu is None else _vvgpu_tuple(vvgpu)
    pinned = pinned_device(visible_devices)
    if visible == 1 and pinned is not None:
        return 0, (
            f"CUDA_VISIBLE_DEVICES={pinned}: the launcher assigned this rank (local rank {local_rank}) "
            f"its one visible GPU -> GPU 0" + ("" if vv == DEFAULT_VVGPU else ", vvgpu not applied")
        )
    if vv == DEFAULT_VVGPU:
        gpu = local_rank % visible
        return gpu, f"local rank {local_rank} of {visible} visible GPU(s) -> GPU {gpu}"
    if len(vv) == 1:
        gpus, which = vv[0], "vvgpu[0] (one list for every node)"
    elif node < len(vv):
        gpus, which = vv[node], f"vvgpu[{node}]"
    else:
        raise PlacementError(
            f"vvgpu lists {len(vv)} nodes but this rank runs on node {node}: give one GPU list per node"
        )
    gpu = gpus[local_rank % len(gpus)]
    if gpu >= visible:
        raise PlacementError(
            f"{which}={list(gpus)} asks local rank {local_rank} for GPU {gpu}, but only "
            f"{visible} GPU(s) are visible (0..{visible - 1}; CUDA_VISIBLE_DEVICES renumbers)"
        )
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


def pci_key(domain: int, bus: int, device: int) -> int:
    """A GPU's PCI address (domain:bus:device) as one int64 for an allgather: domain << 16 | bus << 8 |
    device (bus and device below 256; a domain of up to 32 bits still fits)."""
    domain, bus, device = int(domain), int(bus), int(device)
    if domain < 0 or not 0 <= bus < 256 or not 0 <= device < 256:
        raise PlacementError(f"PCI address {domain}:{bus}:{device} is out of range")
    return domain << 16 | bus << 8 | device


def pci_key_from_text(bus_id: str) -> int:
    """pci_key of a PCI bus id string such as CUDA's ``0000:3b:00.0`` (cudaDeviceGetPCIBusId, CuPy's
    ``Device.pci_bus_id``) or nvidia-smi's ``00000000:3B:00.0`` (all hexadecimal; the function is ignored:
    a GPU is one PCI device)."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        return pci_key(int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16))
    except (ValueError, AttributeError):
        raise PlacementError(f"{bus_id!r} is not a PCI bus id (domain:bus:device.function)") from None


def pci_text(key: int) -> str:
    """A pci_key as ``dddd:bb:dd`` (hexadecimal, as CUDA writes it)."""
    return f"{key >> 16:04x}:{(key >> 8) & 0xFF:02x}:{key & 0xFF:02x}"


def own_gpus(rows) -> tuple[bool, str]:
    """(every rank has a GPU of its own, why not) from rows[r] = (node, pci_key of rank r's GPU, or -1
    when it has none or its address could not be read).

    A GPU is its node plus its PCI address, which is how NCCL itself tells GPUs apart (it refuses two
    ranks on one host with the same bus id). The visible index cannot serve: under per-rank
    ``CUDA_VISIBLE_DEVICES`` every rank's GPU is its visible GPU 0, and the nodes' GPUs repeat the same
    PCI addresses, so the node stays in the key. MIG instances of one GPU share its address and count
    as shared (NCCL does not run between them)."""
    seen: dict[tuple[int, int], int] = {}
    for r, (node, key) in enumerate(rows):
        node, key = int(node), int(key)
        if key < 0:
            return False, f"rank {r} has no GPU whose PCI address could be read"
        if (node, key) in seen:
            return False, (f"ranks {seen[(node, key)]} and {r} share a GPU (PCI {pci_text(key)} on node {node})")
        seen[(node, key)] = r
    return True, ""


def choose_transport(
    size: int, device_kind: str, gpu_per_rank: bool, nccl_importable: bool, forced: str = "", shared_why: str = ""
) -> tuple[str, str]:
    """('nccl' | 'mpi', why): how device buffers travel between ranks.

    NCCL needs several ranks, the gpu device, a GPU of its own on every rank (``gpu_per_rank``,
    ``own_gpus``: the ranks' (node, PCI address) pairs are all different; ``shared_why`` is own_gpus'
    reason when not) and cupy.cuda.nccl; everything else stages through host memory and MPI.
    ``forced`` is NUMBACTR_COMM's value: 'mpi' turns NCCL off, 'nccl' makes its absence an error."""
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
        missing.append(shared_why or "some ranks share a GPU")
    if not nccl_importable:
        missing.append("cupy.cuda.nccl does not import")
    if missing:
        if forced == "nccl":
            raise PlacementError("NUMBACTR_COMM=nccl, but " + "; ".join(missing))
        return "mpi", "host-staged MPI: " + "; ".join(missing)
    return "nccl", f"NCCL through CuPy: {size} ranks, one GPU each"
