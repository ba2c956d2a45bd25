"""A parent for worker processes that has imported what they import, once.

Importing torch and transformers costs a worker about 3-6 s of a core before it can read its
Init; a run starts two workers, an eval or sft one more, a test suite hundreds. This process
(`python -m areal_aio.workers.zygote FD`, started by areal_aio.fleet.zygote) pays it once: it
imports both workers' modules, then forks a worker for each request, so a worker is ready as
soon as its model is loaded. Nothing here runs torch: a process is forked only while it has
one thread and no device, the state `import torch` leaves (CUDA starts in the child).

    controller --- SEQPACKET socket (FD) ---> zygote
      {"op": "fork", "role", "env", "cwd"}   ->  fork: the child takes the 3 fds sent with it
        + 3 fds                                 as its stdin (frames in), stdout (frames out)
                                                and stderr (its log), the request's environment
                                                and folder, a session of its own, and runs the
                                                role's worker main; the reply is {"pid"}
      {"op": "reap", "pid"}                  ->  waits for that child: {"code"}, its exit status
    stdin (the lifeline): its end means the controller's process is gone; the zygote exits at
    once, its children are reparented, and a worker whose pipe ended without a Shutdown removes
    the run's /dev/shm folder (workers/common.py).

The first message is {"ready": pid, "import_s": seconds} or {"refused": why} (a thread was
left running by an import, so a fork would copy a lock it cannot release); the controller then
spawns workers fresh.
"""

from __future__ import annotations

import importlib
import os
import select
import socket
import sys
import time
import traceback
from typing import Any

import orjson

PRELOAD = ("areal_aio.workers.rollout.worker", "areal_aio.workers.trainer.worker")
"""The workers' modules (each imports torch, transformers and what the role needs)."""
ON_LOAD = ("transformers.modeling_utils", "transformers.generation.utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2")
"""What loading a model imports on its first call (about a thousand modules: transformers'
modeling and tokenizer machinery, which pull torch.distributed, torch._dynamo and sympy): about
2 s of every fresh worker's load. Imported here, where present (a module another transformers
version lacks is skipped), a forked worker loads SmolLM2 in well under a second; a model of
another family imports its own modeling module in the worker, as before."""
ROLES = {"rollout": PRELOAD[0], "trainer": PRELOAD[1]}
MAX_REQUEST = 1 << 20
"""A request carries the worker's whole environment: well within this."""


def threads_running() -> int:
    """This process's OS threads (a library's pool counts, not only Python's threads)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def main(argv: list[str]) -> int:
    from areal_aio.workers.common import name_process

    name_process("areal-zygote")
    sock = socket.socket(fileno=int(argv[1]))
    t0 = time.perf_counter()
    for name in PRELOAD:
        if select.select([sys.stdin], [], [], 0)[0]:
            return 0  # the lifeline ended (or spoke) during the imports: nobody waits for us
        importlib.import_module(name)
    for name in ON_LOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if (threads := threads_running()) != 1:
        sock.send(orjson.dumps({"refused": f"{threads} threads after the imports: a fork could copy a held lock"}))
        return 0
    sock.send(orjson.dumps({"ready": os.getpid(), "import_s": round(time.perf_counter() - t0, 3)}))
    while True:
        ready, _, _ = select.select([sock, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return 0  # the lifeline ended: the controller's process is gone
        if sock in ready:
            data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 3)
            if not data:
                return 0
            sock.send(orjson.dumps(answer(orjson.loads(data), fds, sock)))


def answer(request: dict[str, Any], fds: list[int], sock: socket.socket) -> dict[str, Any]:
    """One request's reply (a forked child never returns from here)."""
    if request["op"] == "reap":
        try:
            _, status = os.waitpid(request["pid"], 0)
        except ChildProcessError:
            return {"code": None}  # not a child of ours (reaped already)
        return {"code": os.waitstatus_to_exitcode(status)}
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        become_worker(request, fds, sock)
    for fd in fds:
        os.close(fd)
    return {"pid": pid}


def become_worker(request: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    """In the child: the request's pipes on fds 0-2, its environment, a session of its own,
    then the role's main, and the process's end (never a return into the zygote's loop)."""
    code = 1
    try:
        sock.close()
        os.setsid()  # a Ctrl-C in the terminal reaches only the controller, as for a fresh spawn
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        code = sys.modules[ROLES[request["role"]]].main()
    except BaseException:  # noqa: BLE001 - the child's end is its exit code and its log
        traceback.print_exc()
    finally:
        from areal_aio.workers.common import exit_now

        exit_now(code)


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stderr.flush()
    os._exit(code)  # at once: unloading torch, transformers and sympy takes seconds, and a worker
    # whose controller died waits ORPHAN_WAIT_S for this process's end before it cleans up
