"""Rank set-up that runs inside each engine: environment, process group, names in the cell namespace.

The client calls these with `apply`; each returns plain data so the client never needs torch.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any

from nbtrain import logs
from nbtrain.engine import torchrun

log = logging.getLogger(__name__)

# frames from these packages are the engine's own machinery, not the user's code
_MACHINERY = (
    "/ipykernel/",
    "/IPython/",
    "/ipyparallel/",
    "/tornado/",
    "/asyncio/",
    "/zmq/",
    "/threading.py",
    "/runpy.py",
    "<frozen runpy>",
    "/selectors.py",
    "/traitlets/",
    "/jupyter_client/",
    "/nbtrain/engine/setup.py",
    "/nbtrain/engine/boot.py",
)


def _user_ns() -> dict[str, Any]:
    from IPython import get_ipython

    ip = get_ipython()
    return ip.user_ns if ip is not None else {}


PINNED_ENV = "NBTRAIN_GPU_PINNED"  # set to "1" by a launcher that gives each engine its own GPUs


def cuda_count() -> int:
    # test hook: the GPU count a test wants the client's plan to see (tests/cluster/ranks/test_plan.py sets it in
    # the engines' environment); never set it otherwise
    fake = os.environ.get("NBTRAIN_TEST_GPU_COUNT")
    if fake is not None:
        return int(fake)
    # avoid importing torch just to say hello: the driver's proc entry answers without a CUDA context
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def hello() -> dict[str, Any]:
    """Who this engine is: host, pid, GPUs. Also installs the stack-dump handler."""
    os.environ["NBTRAIN_ENGINE"] = "1"
    torchrun.not_interactive()  # before the user's first cell imports any library that checks
    install_stack_handler()
    from nbtrain.engine import faults

    log_file = faults.install()["log"]
    try:
        import psutil

        children = [p.pid for p in psutil.Process().children(recursive=True)]
    except Exception:  # only a hint for teardown: the engine's own pid is enough
        children = []
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "children": children,
        "gpus": cuda_count(),
        # the launcher gave this engine its own GPU(s) and hid the rest (Ray sets
        # CUDA_VISIBLE_DEVICES per actor): the rank uses cuda:0, whatever its local rank
        "pinned": os.environ.get(PINNED_ENV) == "1",
        "python": sys.executable,
        "log": log_file,
        "allocator": allocator_in_use(),
    }


def allocator_in_use() -> str:
    """The malloc this process runs with: "tcmalloc", "jemalloc" or "system" (from its memory maps)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "system"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "system"


def free_port() -> int:
    """A TCP port that is free on this host now (the rendezvous port, when this is rank 0's host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_rank(env: dict[str, str], backend: str, device: str, timeout_s: float) -> dict[str, Any]:
    """Set this rank's torchrun environment (`topology.torchrun_env`), then join the process group.

    `backend` and `device` ("cuda:<local rank>" or "cpu") come from the client's plan
    (`nbtrain.cluster.ranks.plan`), the same decision for every rank: a rank never chooses alone.
    """
    os.environ.update(env)
    os.environ["NBTRAIN_ENGINE"] = "1"
    # the kernel's NBTRAIN_LOG, for a rank whose engine started before it was set (nbtrain.logs)
    logs.from_env()
    torchrun.not_interactive()
    # what nbtrain.finetune (and user code) reads instead of guessing from torch.cuda.is_available()
    os.environ["NBTRAIN_DEVICE"] = device
    import torch
    import torch.distributed as dist

    rank = int(env["RANK"])
    local_rank = int(env["LOCAL_RANK"])
    world_size = int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > 1 and "OMP_NUM_THREADS" not in os.environ:
        # as torchrun does: several ranks per host each using every core thrash the CPU
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local_world))
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # torch may have been imported before the variable was set (nbtrain.engine.boot warms it up
        # early; remote launchers set the environment late): make its thread pool agree, always
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    dev = torch.device(device)
    if dev.type == "cuda":
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= seen:
            host = socket.gethostname()
            msg = (
                f"rank {rank} on {host}: nbtrain planned {device} for this rank from the GPU count its "
                f"engine reported, but torch sees {seen} GPU(s) (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Check the driver and "
                "CUDA_VISIBLE_DEVICES on that host, or start with --backend gloo and hide the GPUs "
                "(CUDA_VISIBLE_DEVICES='')."
            )
            raise RuntimeError(msg)
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        torchrun.real("destroy")()
    from nbtrain.engine.faults import before_group  # NCCL env defaults; the new group's FR start

    before_group()
    # a local cluster meets through a file in its 0700 security folder: nothing listens on the network
    store_file = os.environ.get("NBTRAIN_STORE_FILE")
    torchrun.real("init")(
        backend=backend,
        init_method=f"file://{store_file}" if store_file else "env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if backend == "nccl" else None,
    )
    torchrun.install_shims()
    from nbtrain.engine.groups import GROUPS  # the client re-creates the named groups next

    _user_ns().update(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        device=dev,
        group=dist.group.WORLD,
        groups=GROUPS,
    )
    return {"backend": backend, "device": str(dev)}


def check_group() -> dict[str, Any]:
    """This rank's view of the process group after an interrupt: alive, and how many collectives ran."""
    try:
        import torch.distributed as dist
    except ImportError:
        return {"initialized": False, "seq": None}
    if not dist.is_initialized():
        return {"initialized": False, "seq": None}
    seq = None
    try:
        pg = dist.distributed_c10d._get_default_group()
        seq = int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except Exception:  # older torch, or a backend that does not count
        seq = None
    from nbtrain.engine.groups import sequence_numbers

    return {"initialized": True, "seq": seq, "groups": sequence_numbers()}


def shutdown_group() -> None:
    """Leave the process group cleanly (before the engine stops)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_initialized():
        torchrun.real("destroy")()


def format_stacks(all_threads: bool = True) -> dict[str, Any]:
    """Every thread's Python stack in this process, the user's frames only where we can tell."""
    import threading

    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        if not all_threads and ident != main_id:
            continue
        frames = traceback.extract_stack(frame)
        user = [f for f in frames if not any(m in f.filename for m in _MACHINERY)]
        # a thread with no user frame is engine machinery (heartbeat, iopub...): keep it short
        shown = user if user else frames[-1:]
        out.append(
            {
                "thread": names.get(ident, str(ident)),
                "main": ident == main_id,
                "user_frames": len(user),
                "stack": "".join(traceback.format_list(shown)),
            }
        )
    out.sort(key=lambda t: (not t["main"], -int(t["user_frames"])))  # type: ignore[call-overload]
    from nbtrain.engine.faults import collectives
    from nbtrain.engine.signals.interrupts import held_for

    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "threads": out,
        "collectives": collectives(),
        # seconds since a SIGINT this rank holds until its loop's next step (None: none held)
        "interrupt_held_s": held_for(),
    }


def install_stack_handler() -> None:
    """Answer `nbtrain_stack_request` on the control channel, which runs on its own thread.

    That is what lets the notebook see where a rank is while its main thread is busy or stuck in a
    collective, without signals and without files on the engine's host.
    """
    from IPython import get_ipython

    ip = get_ipython()
    kernel = getattr(ip, "kernel", None)
    if kernel is None or "nbtrain_stack_request" in kernel.control_handlers:
        return

    def handler(stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        all_threads = bool(parent.get("content", {}).get("all_threads", True))
        try:
            content = {"status": "ok", **format_stacks(all_threads)}
        except Exception as e:  # never let a diagnosis request hurt the engine
            content = {
                "status": "ok",
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "error": repr(e),
                "threads": [],
            }
        kernel.session.send(stream, "nbtrain_stack_reply", content, parent, ident)

    kernel.control_handlers["nbtrain_stack_request"] = handler
