"""Which CPUs the training thread keeps, which CPUs each native pool is pinned to, and which NUMA
node holds the host state.

On a GPU machine the Python thread that launches device work must never wait for a core: a late
launch is a GPU stall. Measured on a 16-core H200 host (docs/design.md, "Threads and buffer ownership"), 16 native threads plus
Python's own threads shared 16 cores and the CPU update's time spread from 245 to 380 ms. So the
native pools (native/pool.c) get the cores that are left after ``zenflow.tuning.reserved_cores``,
each pool thread pinned to a core of its own, and the reserved cores never run pool work.

What is read, once, when the optimizer is built (every input injectable, for tests: a fake sysfs
root, a fake allowed set, fake GPU PCI addresses):

- the CPUs this process may run on (``sched_getaffinity``): a cgroup, ``taskset`` or torchrun
  ``--numa-binding`` restriction is respected, never widened;
- torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``: the ranks of one node split its cores, so two
  ranks never pin onto the same ones (zfctl gives local rank r GPU r: train/dist.py);
- sysfs: each NUMA node's CPU list, each CPU's hyperthread siblings, the GPU's NUMA node (its PCI
  device's ``numa_node``).

The plan (``plan_cores``, pure):

1. Candidates: with more than one NUMA node and the GPU's node known, the allowed CPUs of that
   node (the host state is DMA'd to and from the GPU every interval, and the pools stream it);
   else every allowed CPU.
2. This rank's share: the candidates' physical cores (hyperthread siblings kept together, so two
   ranks or two pools never share a core's two threads), cut into equal contiguous parts, one per
   local rank that draws from the same candidates: the ranks whose GPU is on the same node, or
   every local rank when that is unknown (safe: never shared, at worst fewer cores each).
   Assumption: the ranks of a node start from the same allowed set (torchrun without a binding,
   a container, a ``taskset`` on the launcher); a launcher that already gives each rank its own
   cores makes each rank use a part of its own set (``pin_threads: off`` avoids that).
3. Reserved: the share's first ``reserved_cores`` physical cores are the training thread's and
   Python's other threads' (the backward's thread, data loading). ``auto``: with a GPU, 2 when
   the share has 8 cores or more, 1 with 3-7, none with 1-2; on the CPU none (there the training's
   own compute is torch's intra-op threads on every core, and nothing launches device work).
4. The pool: the rest, core by core, go to the CPU update's pool (native pool 0; threads.py
   ``split_threads``: nothing runs native code on the host per step, on any gradient path, so the
   update takes them all). ``zenflow.cpu_threads`` N > 0 uses the first N of them; more than
   there are leaves the threads unpinned.
5. Pinning: ``pin_threads: auto`` pins with a GPU only. On the CPU the pools share every core with
   torch's compute anyway, and a pinned thread cannot move off a core another process holds (on a
   shared 2-core machine a pinned 600K-element native call took 1.7-2.6 ms against 0.26-1.7 ms
   unpinned).

NUMA placement (more than one node, the GPU's node known): the host buffers are allocated with
the building thread running on the node's CPUs (``on_node``: what that thread touches first,
page-locking included, lands there), then each is ``mbind``-ed to the node with its touched pages
moved (``bind_host``: torch's intra-op threads zero a large tensor from wherever they run). With
one node all of it is skipped.

torch's intra-op threads are not kept off the pools' cores: libgomp creates them on torch's first
parallel operation (model loading, long before the optimizer exists), they inherit the affinity of
the thread that created them, and libgomp has no call to move them afterwards; ``OMP_PLACES`` /
``GOMP_CPU_AFFINITY`` are read once when torch is imported. With ``OMP_WAIT_POLICY=PASSIVE``
(zfctl/__init__.py) they sleep between torch CPU operations, which a CUDA step has few of.
``zfctl doctor`` prints the reserved CPUs, so a user can set ``GOMP_CPU_AFFINITY`` to them before
launching.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zfctl.offload.cpu.threads import split_threads

UPDATE_POOL = 0  # the native pool of the CPU update's AdamW (pool 1 serves no zfctl caller now)
SYSFS = Path("/sys")


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Linux's CPU list format ("0-3,8,10-11"; empty for none) as sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cpus))


def format_cpulist(cpus: Sequence[int]) -> str:
    """The inverse of ``parse_cpulist``: ranges for runs ("0-3,8"); "-" for none."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


@dataclass(frozen=True)
class Machine:
    """What the plan reads about this machine and process."""

    allowed: tuple[int, ...]  # CPUs this process may run on
    nodes: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # NUMA node -> its CPUs; {} = unknown
    siblings: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # CPU -> its core's CPUs
    gpu_nodes: tuple[int | None, ...] = ()  # NUMA node of each visible CUDA device (None: unknown)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def pci_numa_node(pci: str | None, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node of PCI device ``pci`` ("0000:1b:00.0"); None when unknown (-1: one node)."""
    text = _read(sysfs / "bus" / "pci" / "devices" / pci / "numa_node") if pci else None
    try:
        node = int(text.strip()) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def gpu_pci_addresses() -> list[str | None]:
    """Each visible CUDA device's PCI address as sysfs names it; [] without CUDA. Reads device
    properties only (no CUDA context is created)."""
    import torch

    if not torch.cuda.is_available():
        return []
    out: list[str | None] = []
    for i in range(torch.cuda.device_count()):
        props: Any = torch.cuda.get_device_properties(i)
        try:
            out.append(f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0")
        except AttributeError:  # a torch without these fields
            out.append(None)
    return out


def read_machine(sysfs: Path = SYSFS, allowed: Sequence[int] | None = None,
                 gpu_pci: Sequence[str | None] | None = None) -> Machine:
    """The machine as this process sees it: ``allowed`` defaults to ``sched_getaffinity(0)``,
    ``gpu_pci`` to the visible CUDA devices' PCI addresses."""
    cpus = tuple(sorted(allowed if allowed is not None else os.sched_getaffinity(0)))
    nodes: dict[int, tuple[int, ...]] = {}
    node_root = sysfs / "devices" / "system" / "node"
    for d in sorted(node_root.glob("node[0-9]*")) if node_root.is_dir() else ():
        text = _read(d / "cpulist")
        if text is not None and d.name[4:].isdigit():
            nodes[int(d.name[4:])] = parse_cpulist(text)
    siblings: dict[int, tuple[int, ...]] = {}
    for c in cpus:
        text = _read(sysfs / "devices" / "system" / "cpu" / f"cpu{c}" / "topology" / "thread_siblings_list")
        if text is not None:
            siblings[c] = parse_cpulist(text)
    pcis = gpu_pci_addresses() if gpu_pci is None else list(gpu_pci)
    return Machine(cpus, nodes, siblings, tuple(pci_numa_node(p, sysfs) for p in pcis))


@dataclass(frozen=True)
class CorePlan:
    """The core split of one rank (see the module docstring for how it is chosen)."""

    share: tuple[int, ...]  # this rank's CPUs
    training: tuple[int, ...]  # reserved: no pool work runs here
    update: tuple[int, ...]  # native pool 0 (the CPU update's AdamW), pinned one thread per CPU
    threads: int  # the update's participants, threads.py's split
    total: int  # the native library's thread count (zf_set_num_threads)
    pinned: bool
    node: int | None  # NUMA node for the host state; None: one node, or the GPU's unknown
    gpu_node: int | None
    numa_nodes: int  # NUMA nodes of the machine
    notes: tuple[str, ...] = ()  # where a setting was clamped or a fallback taken

    def lines(self) -> list[str]:
        """Human-readable summary (zfctl doctor, the run's log)."""
        pin = "pinned" if self.pinned else "not pinned"
        numa = (f"{self.numa_nodes} NUMA node(s); host state on node {self.node}" if self.node is not None
                else f"{self.numa_nodes} NUMA node(s); host state not placed (one node, or the GPU's node unknown)")
        if self.gpu_node is not None:
            numa += f"; the GPU is on node {self.gpu_node}"
        share = (f"this rank's CPUs {format_cpulist(self.share)}; reserved for the training thread: "
                 f"{format_cpulist(self.training)} ({len(self.training)})")
        return [
            share,
            f"update pool {self.threads} thread(s) on CPUs {format_cpulist(self.update)} ({pin})",
            numa, *self.notes,
        ]


def _cores(cpus: Sequence[int], siblings: Mapping[int, tuple[int, ...]]) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (hyperthread siblings together), in order of first CPU."""
    allowed, seen, out = set(cpus), set[int](), list[tuple[int, ...]]()
    for c in sorted(cpus):
        if c in seen:
            continue
        group = tuple(sorted({c, *siblings.get(c, ())} & allowed))
        seen.update(group)
        out.append(group)
    return out


def _auto_reserved(cores: int, gpu: bool) -> int:
    if not gpu:
        return 0
    return 2 if cores >= 8 else 1 if cores >= 3 else 0


def plan_cores(machine: Machine, *, gpu: int | None, local_rank: int = 0, local_world: int = 1,
               reserved: int | str = "auto", cpu_threads: int = 0, pin: str = "auto", cap: int = 0) -> CorePlan:
    """This rank's core split. ``gpu``: its CUDA device index (None: training on the CPU);
    ``reserved``/``pin``: ``zenflow.tuning.reserved_cores``/``pin_threads``; ``cpu_threads``:
    ``zenflow.cpu_threads``; ``cap`` > 0: at most this many threads when ``cpu_threads`` is 0 (a
    single process's ``OMP_NUM_THREADS``)."""
    notes: list[str] = []
    allowed = machine.allowed or (0,)
    gpu_node = machine.gpu_nodes[gpu] if gpu is not None and gpu < len(machine.gpu_nodes) else None
    node = None
    candidates: tuple[int, ...] = tuple(allowed)
    peers = list(range(max(1, local_world)))
    if len(machine.nodes) > 1 and gpu_node is not None:
        on_node = tuple(c for c in allowed if c in set(machine.nodes.get(gpu_node, ())))
        if on_node:
            node, candidates = gpu_node, on_node
            if len(machine.gpu_nodes) >= local_world:  # local rank r drives GPU r (train/dist.py)
                peers = [r for r in range(local_world) if machine.gpu_nodes[r] == gpu_node] or peers
        else:
            notes.append(f"the GPU is on NUMA node {gpu_node} but this process may not run there: "
                         "host state left next to the pools")
    k, n = (peers.index(local_rank), len(peers)) if local_rank in peers else (local_rank % len(peers), len(peers))
    cores = _cores(candidates, machine.siblings)
    if len(cores) < n:  # fewer cores than ranks: split the logical CPUs, sharing if still short
        cores = [(c,) for c in candidates]
        if len(cores) < n:
            notes.append(f"{n} ranks share {len(cores)} CPU(s): ranks may run on the same CPUs")
            cores = [cores[k % len(cores)]]
            k, n = 0, 1
    mine = cores[k * len(cores) // n:(k + 1) * len(cores) // n]
    want = _auto_reserved(len(mine), gpu is not None) if reserved == "auto" else int(reserved)
    keep = min(want, len(mine) - 1)
    if keep < want:
        notes.append(f"reserved_cores {want} leaves no core for the pools: {keep} reserved")
    training = tuple(c for core in mine[:keep] for c in core)
    pool = [c for core in mine[keep:] for c in core]
    total = cpu_threads or (min(cap, len(pool)) if cap > 0 else len(pool))
    upd = split_threads(total)
    pinned = pin == "on" or (pin == "auto" and gpu is not None)
    if pinned and upd > len(pool) and total > 1:
        notes.append(f"cpu_threads {total} > {len(pool)} pool CPUs: threads not pinned")
        pinned = False
    upd_cpus = tuple(pool[:upd])  # the first CPUs of the share's pool cores, in core order
    # Kept sorted (the pinning takes any order).
    return CorePlan(tuple(sorted(c for core in mine for c in core)), tuple(sorted(training)),
                    tuple(sorted(upd_cpus)), upd, total, pinned, node,
                    gpu_node, max(1, len(machine.nodes)), tuple(notes))


def local_ranks(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them; (0, 1) outside torchrun."""
    env = os.environ if env is None else env
    try:
        rank, world = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1
    return (rank, world) if 0 <= rank < world else (0, 1)


def omp_cap(env: Mapping[str, str], local_world: int) -> int:
    """A single process's ``OMP_NUM_THREADS`` (a user's cap on every thread pool, as before the
    split existed); 0 under torchrun with several local ranks, which sets it to 1 for each of them
    (the split by local rank decides there), or when unset or not a count."""
    text = env.get("OMP_NUM_THREADS", "")
    return int(text) if local_world == 1 and text.isdigit() else 0


def plan_for(config: Any, device: Any, *, machine: Machine | None = None,
             env: Mapping[str, str] | None = None) -> CorePlan:
    """``plan_cores`` for a ZenFlowConfig and a torch device, on this machine and rank."""
    env = os.environ if env is None else env
    gpu = (device.index or 0) if device.type == "cuda" else None
    rank, world = local_ranks(env)
    t = config.tuning
    return plan_cores(machine or read_machine(), gpu=gpu, local_rank=rank, local_world=world,
                      reserved=t.reserved_cores, cpu_threads=config.cpu_threads, pin=t.pin_threads,
                      cap=omp_cap(env, world))


def apply(plan: CorePlan, native: Any) -> int:
    """Set the native library's thread count and pin (or unpin) the update's pool; returns the
    update's thread count for the CPU worker."""
    native.set_num_threads(max(1, plan.total))
    native.set_pool_cpus(UPDATE_POOL, plan.update if plan.pinned else ())
    return plan.threads


@contextlib.contextmanager
def on_node(plan: CorePlan) -> Iterator[None]:
    """Run the calling thread on the plan's NUMA node while the host buffers are allocated, so
    the pages it touches first (zeroing, cudaHostRegister's page-locking) land there; its own
    CPUs come back after. Nothing happens with one node."""
    if plan.node is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(plan.share))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def bind_host(plan: CorePlan, native: Any, buffers: Sequence[Any]) -> list[str]:
    """mbind each host buffer to the plan's NUMA node, moving pages already touched elsewhere;
    returns one note per refusal (EPERM in a container without CAP_SYS_NICE): placement only
    changes speed, so it never fails the run."""
    if plan.node is None:
        return []
    notes = []
    for t in buffers:
        err = native.bind_node(t, plan.node)
        if err:
            notes.append(f"NUMA placement refused ({os.strerror(err)}): host state left where first touched")
            break
    return notes
