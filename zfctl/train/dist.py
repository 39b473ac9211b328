"""Processes: who am I (torchrun's environment), this process's device, seeds and process group,
relaunching under torchrun, rank errors.

zfctl wraps torchrun instead of replacing it. ``zfctl finetune ... --nproc N`` (not already under
torchrun) checks what it can in the launching process (zfctl/train/launch.py) - the output folder,
the logger packages, and the data, which it prepares into the cache so that the N ranks load it
instead of tokenising it N times - and then runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m
zfctl finetune <the same arguments>``. Each rank sees torchrun's RANK/WORLD_SIZE/LOCAL_RANK and
trains; ``torchrun --nnodes ... --nproc-per-node N -m zfctl finetune ...`` (multi-node, slurm)
takes the same path minus the relaunch. When any rank fails, torchrun stops the others; the
failing rank prefixes its message with ``rank R:`` so the user knows whose data or disk it was.
A peer waiting for it in a collective learns of it from gloo/NCCL at once (the dead process's
sockets close) and ends with one line too (:func:`rank_error`), and a rank killed without a word
is named by ``zfctl.train._torchrun``: the whole job ends within seconds (tests/e2e/test_failures.py).
Checkpoints stay whole: a save interrupted anywhere leaves only a ``.tmp-*`` folder, never read.

The launcher owns what it starts. torchrun runs in its own session (the terminal's Ctrl-C and a
``kill`` of the launcher's process group reach only the launcher), and torchrun starts every
rank in a session of its own. The launcher forwards SIGINT/SIGTERM to the ranks themselves, once
per signal it receives: each rank finishes its step, they write the stop checkpoint together,
and exit 130/143; torchrun then ends with their code and so does the launcher. Signalling
torchrun instead would make it SIGTERM the ranks a second time (they would abort without a
checkpoint) and SIGKILL them after its shutdown timeout (30 s), however long the checkpoint
takes. torchrun itself is run through ``zfctl.train._torchrun``, which ends with the ranks' exit
code instead of a traceback.

Nothing outlives the launcher, even a SIGKILL of it (which no handler sees): torchrun asks the
kernel to SIGKILL it when the launcher dies, and each rank to SIGKILL it when torchrun dies
(``PR_SET_PDEATHSIG``, :func:`bind_to_launcher`). A rank that hangs without dying is caught by
``distributed.timeout``: its peers' collective raises after that many seconds, and each of them
ends with one line naming the rank that did not answer (:func:`rank_error`, exit code
``TIMEOUT_EXIT``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch

from zfctl.errors import RunFailed, UserError
from zfctl.plan.schema import RunPlan
from zfctl.quiet import torchrun_env

# Set by torchrun (elastic agent) in every worker; their presence means "do not relaunch".
_TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
# Set by `relaunch` for its workers: the launcher printed the plan already, rank 0 need not.
PLAN_PRINTED_ENV = "ZFCTL_PLAN_PRINTED"
# The pid each process of an --nproc job must die with: the launcher's for torchrun (set by
# `relaunch`), torchrun's for the ranks (set by zfctl.train._torchrun).
PARENT_ENV = "ZFCTL_DIE_WITH_PID"
# The checkpoint a ``resume`` launcher resolved (and, with --latest-good, verified) once: its ranks
# load that folder instead of resolving (and hashing) the run folder again, each of them.
RESUME_FROM_ENV = "ZFCTL_RESUME_CHECKPOINT"
# The run folder of an --nproc job (set by the launcher, zfctl/train/launch.py): torchrun's line for
# a rank that died without a word (zfctl.train._torchrun) says how to continue it.
RUN_DIR_ENV = "ZFCTL_RUN_DIR"
# The exit code of a rank that waited distributed.timeout for a peer (coreutils' `timeout` uses it).
TIMEOUT_EXIT = 124
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as torchrun describes it (one process without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that prints, writes metrics and writes shared checkpoint files."""
        return self.rank == 0

    @property
    def local_world_size(self) -> int:
        """The processes on this node (torchrun's LOCAL_WORLD_SIZE; without it the world)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))


def dist_env() -> DistEnv:
    """Read RANK / WORLD_SIZE / LOCAL_RANK (torchrun's variables)."""
    return DistEnv(
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def resolve_device(want: str, *, no_cuda: str, index: int | None = None) -> torch.device:
    """The device ``want`` names: ``auto`` (CUDA when visible, else the CPU), ``cuda`` or ``cpu``.

    ``no_cuda``: the UserError's line when CUDA is asked for and none is visible (it names the
    option as the user gave it). ``index``: which GPU (a rank's LOCAL_RANK); None: the current one.
    """
    cuda = torch.cuda.is_available()
    if want == "cuda" and not cuda:
        raise UserError(no_cuda)
    if want == "cuda" or (want == "auto" and cuda):
        return torch.device("cuda") if index is None else torch.device("cuda", index)
    return torch.device("cpu" if want == "auto" else want)


def train_device(plan: RunPlan, env: DistEnv) -> torch.device:
    """``train.device`` for this rank: its own GPU (LOCAL_RANK) on a node, or the CPU."""
    return resolve_device(plan.train.device, index=env.local_rank,
                          no_cuda="train.device=cuda but no CUDA device is visible; use --set train.device=cpu")


@contextlib.contextmanager
def process_setup(plan: RunPlan, env: DistEnv, device: torch.device) -> Iterator[None]:
    """Seeds, the determinism flag and the process group for one run, restored/torn down on exit."""
    import torch.distributed as torch_dist

    prev_det = torch.are_deterministic_algorithms_enabled()
    from zfctl.train.checkpoint.rng import seed_rngs

    seed_rngs(plan.train.seed)
    # CPU kernels are deterministic for a fixed thread count already; the flag makes any op
    # that is not warn instead of silently breaking bit-exact resume. On CUDA it would force
    # slower kernels (and needs CUBLAS_WORKSPACE_CONFIG), so it stays off there.
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    own_group = False
    if env.world_size > 1 and not torch_dist.is_initialized():
        backend = plan.distributed.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # distributed.timeout: a collective that waits longer raises, and the survivors name the
        # rank that did not answer (rank_error below); None = the backend's default.
        timeout = plan.distributed.timeout
        torch_dist.init_process_group(backend=backend,
                                      timeout=None if timeout is None else timedelta(seconds=timeout))
        own_group = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_det)
        if own_group:
            torch_dist.destroy_process_group()


def under_torchrun() -> bool:
    """True inside a torchrun worker (never relaunch from there)."""
    return any(v in os.environ for v in _TORCHRUN_VARS)


def torchrun_command(nproc: int, argv: Sequence[str]) -> list[str]:
    """The single-node torchrun command that re-runs ``zfctl <argv>`` on ``nproc`` processes.

    ``--standalone`` gives a local rendezvous on a free port (no MASTER_ADDR to configure).
    """
    return [
        sys.executable,
        "-m",
        "zfctl.train._torchrun",  # torch.distributed.run without the tracebacks (see that file)
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "zfctl",
        *argv,
    ]


def worker_argv(argv: Sequence[str], nproc_set: str | None = None) -> list[str]:
    """``argv`` without ``--nproc N`` (optionally with ``--set <nproc_set>=N`` instead).

    torchrun's argparse matches option prefixes anywhere on its command line, and ``--nproc``
    is ambiguous there (``--nproc-per-node``/``--nproc_per_node``), so it must not reach it. The
    workers never relaunch (they see torchrun's variables); ``finetune`` keeps the value in the
    plan through ``--set distributed.nproc=N`` (the same resolved plan on every rank).
    """
    out, it, value = [], iter(argv), None
    for a in it:
        if a == "--nproc":
            value = next(it, None)
        elif a.startswith("--nproc="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
    if nproc_set is not None and value is not None:
        out += ["--set", f"{nproc_set}={value}"]
    return out


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (Linux /proc; empty where that is not available)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def forward_signal(torchrun_pid: int, signum: int) -> None:
    """Pass ``signum`` to the ranks (torchrun's children), or to torchrun before they exist."""
    ranks = _children(torchrun_pid)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):  # already gone: nothing to stop
            os.kill(pid, signum)
    if not ranks:  # still in rendezvous (or no /proc): torchrun stops whatever it started
        with contextlib.suppress(ProcessLookupError):
            os.killpg(torchrun_pid, signum)


def bind_to_launcher() -> None:
    """Die (SIGKILL) when the process that started this one dies: under ``--nproc`` (torchrun with
    the launcher, each rank with torchrun), and any rank of a torchrun job the user started (on
    several nodes, one per node), with its node's torchrun agent. Without that, killing one node's
    agent left its ranks training on, and the other node's agent waiting 300 s in torch's exit
    barrier for an agent that was gone; now the ranks die with it, their peers stop with one line
    each (rank_error), and every agent ends as a failed job, without that barrier.

    ``PR_SET_PDEATHSIG`` is Linux's; elsewhere, and outside a job, this does nothing. The kernel
    sends the signal when the parent *thread* that forked us exits: torchrun starts its ranks
    (``subprocess``, so the agent is the parent), and the launcher torchrun, from their main
    threads, which live as long as the process. A parent that died before the call can no longer
    send it, hence the check after.
    """
    parent = os.environ.get(PARENT_ENV)
    if parent is None and under_torchrun() and "TORCHELASTIC_RUN_ID" in os.environ:
        parent = str(os.getppid())  # a rank of the user's own torchrun: its node's agent
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not permitted here (a seccomp sandbox): the old behaviour, nothing worse
    if os.getppid() != int(parent):  # orphaned already, adopted by init or a subreaper
        os.kill(os.getpid(), signal.SIGKILL)


def relaunch(nproc: int, argv: Sequence[str], extra_env: dict[str, str] | None = None) -> int:
    """Run ``zfctl <argv>`` under torchrun on this node and wait; returns the ranks' exit code.

    The ranks get OMP_NUM_THREADS=1 unless the user set it, as torchrun would give them, but set
    here so that torchrun prints no banner about it (zfctl/quiet.py): with N processes per node
    each one should use about cores/N threads (``zenflow.cpu_threads``). SIGINT and
    SIGTERM are forwarded to the ranks (module docstring); the launcher returns only once
    torchrun has exited, so nothing it started outlives it.
    """
    env = torchrun_env({**os.environ, **(extra_env or {}), PLAN_PRINTED_ENV: "1", PARENT_ENV: str(os.getpid())})
    proc: subprocess.Popen | None = None
    pending: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if proc is None:
            pending.append(signum)
        else:
            forward_signal(proc.pid, signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc = subprocess.Popen(torchrun_command(nproc, argv), env=env, start_new_session=True)
        for signum in pending:
            forward_signal(proc.pid, signum)
        code = proc.wait()  # a handled signal does not interrupt the wait (PEP 475)
        return 128 - code if code < 0 else code
    finally:
        if proc is not None and proc.poll() is None:  # only when the wait itself failed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)


# What gloo and NCCL say when a collective fails because the other end is gone: its process
# raised, was killed or was stopped by torchrun, and the kernel closed its sockets.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote process exited", "communicator was aborted", "connection refused")


def peer_lost(e: BaseException) -> bool:
    """True when ``e`` is a collective failing because another rank of the job ended."""
    return _peer_gone_phrase(e) is not None


def _peer_gone_phrase(e: BaseException) -> str | None:
    """Which of :data:`_PEER_GONE` the backend's message holds (its source path, addresses and
    advice left out: the user's line names what happened in its own words)."""
    text = str(e).lower()
    return next((s for s in _PEER_GONE if s in text), None) if isinstance(e, RuntimeError) else None


def continue_hint(run_dir: Path | None) -> str:
    """How to go on after a job ended early: the run folder's checkpoint a resume takes, read now.
    A job of several nodes (the user's torchrun on each) continues as the README says: the same
    torchrun command on every node, with ``resume RUN`` in place of the verb and its arguments
    (``zfctl resume RUN`` alone would relaunch on this node only)."""
    if run_dir is None:
        return "once that is fixed, continue from the newest checkpoint with `zfctl resume` on the run folder"
    from zfctl.train.checkpoint import resolve_checkpoint

    try:
        step = resolve_checkpoint(run_dir).step
    except UserError:
        return f"{run_dir} has no checkpoint yet: once that is fixed, start the run again"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1")) if under_torchrun() else 1
    if nodes > 1:
        per_node = os.environ.get("LOCAL_WORLD_SIZE", "N")
        return (f"once that is fixed, continue from its checkpoint of step {step} by running on every node the "
                f"torchrun command that started this job, with `-m zfctl resume {run_dir}` in place of its "
                f"`-m zfctl ...` part: `torchrun --nnodes {nodes} --node-rank R --nproc-per-node {per_node} "
                f"--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID -m zfctl resume {run_dir}`")
    return f"once that is fixed, continue from its checkpoint of step {step} with `zfctl resume {run_dir}`"


def timed_out(e: BaseException) -> bool:
    """True when ``e`` is a collective that waited longer than the process group's timeout."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text)


def unanswered_ranks(env: DistEnv, grace: float) -> list[int] | None:
    """The ranks that did not time out too: the ones the others were waiting for.

    Every rank whose collective timed out says so in the job's rendezvous store (torchrun's
    MASTER_ADDR/MASTER_PORT), waits ``grace`` seconds for the others to say the same, and reads
    who did not. None when the store cannot be reached.
    """
    try:
        import torch.distributed as dist

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=max(grace, 1.0)), wait_for_workers=False)
        run, attempt = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
        prefix = f"zfctl/timed-out/{run}/{attempt}/"
        store.set(f"{prefix}{env.rank}", "1")
        deadline = time.monotonic() + grace
        while True:
            said = {r for r in range(env.world_size) if store.check([f"{prefix}{r}"])}
            if len(said) == env.world_size or time.monotonic() >= deadline:
                return sorted(set(range(env.world_size)) - said)
            time.sleep(0.1)
    except (KeyError, ValueError, RuntimeError, OSError):  # no torchrun store, or it is gone
        return None


def rank_error(e: Exception, env: DistEnv, timeout: float | None = None, run_dir: Path | None = None) -> Exception:
    """What a rank reports for ``e`` when several processes run.

    A UserError gets ``rank R:`` in front (a plain UserError with the same exit code). A collective that
    failed because another rank ended first becomes one line (RunFailed, exit 1) instead of a
    traceback per survivor: the rank that failed printed its own error, or torchrun names the
    rank that was killed. A collective that waited ``timeout`` (distributed.timeout) for a rank
    that neither answered nor died becomes one line naming that rank (exit ``TIMEOUT_EXIT``).
    Anything else is returned as is (a bug keeps its traceback). The lines for a lost or hung
    peer end with the resume command for ``run_dir`` and the step it continues from.
    """
    if env.world_size <= 1:
        return e
    if timed_out(e) and not isinstance(e, UserError):
        limit = "distributed.timeout" + (f"={timeout:g} s" if timeout is not None else "")
        hung = unanswered_ranks(env, grace=min(5.0, timeout / 4) if timeout else 5.0)
        who = (f"rank {', '.join(map(str, hung))} did not answer" if hung
               else "a collective waited too long for another process")
        hang = RunFailed(f"rank {env.rank}: {who} within {limit} (it hangs, or works far slower than the "
                         f"others); the job was stopped; {continue_hint(run_dir)}")
        hang.exit_code = TIMEOUT_EXIT
        return hang
    if isinstance(e, UserError):
        out = UserError(f"rank {env.rank}: {e}")
        out.exit_code = e.exit_code  # a diverged run (RunFailed, 1) stays distinguishable from bad input (2)
        return out
    phrase = _peer_gone_phrase(e)
    if phrase is not None:
        from zfctl.train.signals import stop_received

        # torchrun SIGTERMs the survivors of a dead rank: this rank may have announced a stop
        # checkpoint that its peers can no longer write with it.
        what = ("the stop checkpoint was not written: another process of this job ended first" if stop_received()
                else "stopped because another process of this job ended")
        return RunFailed(f"rank {env.rank}: {what} (killed, or failed with its own error above; the "
                         f"collective reported: {phrase}); {continue_hint(run_dir)}")
    return e
