"""How a torch.distributed worker process ends: the multi-gpu suites and the tests' two-process workers.

Ending a gloo run through the interpreter's normal shutdown now and then aborted one rank
after every check had passed (2 of 48 local runs of the multi-gpu-integrations suite; more
often on a busy 2-core CI machine): ``terminate called without an active exception``,
SIGABRT. The core dump: a gloo worker thread
(``ProcessGroupGloo::runLoop``) drops its last reference to a collective it has already
completed (``~AsyncAllgatherWork``: the last ``all_gather_object``) only after the caller
has been woken, and since torch keeps a tensor's Python object alive while C++ holds the
tensor, that drop takes the GIL (``decref_pyobject``). When the main thread is already in
``Py_FinalizeEx`` by then, ``take_gil`` ends the worker with ``pthread_exit`` inside a
noexcept destructor: ``std::terminate``.

``destroy_process_group()`` does not prevent it: it joins a gloo group's workers only when
the group's last reference goes, and DeviceMesh objects (kept by DTensor's redistribution
planner and mesh-topology caches) and further references inside torch still hold the world
group after it (torch 2.13), so its workers live on into the interpreter's shutdown.
Upstream: pytorch/pytorch#190489 (the same abort, open); pytorch/pytorch#179291 (an atexit destroy_process_group, abandoned:
it would not help here, destroy already ran).

So a worker leaves without the interpreter's shutdown: every rank reaches the end (a
barrier: no rank's exit cuts a collective its peer is still in), the group is destroyed
(NCCL's communicators are finalized), the output is flushed, and ``os._exit`` ends the
process with the caller's verdict. What that skips does not matter here: these
processes keep no open files or child processes at that point, and Lightning's atexit
``destroy_process_group`` (registered only when Lightning creates an NCCL group itself)
has been done.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

import torch.distributed as dist


def finish(code: int) -> NoReturn:
    """End this rank with exit status `code` (1 as well when the group cannot be left cleanly)."""
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # a group broken by an earlier error: the run has failed anyway
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
