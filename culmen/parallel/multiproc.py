"""``python -m culmen.parallel.multiproc [options] script.py [script args]``: one process per GPU.

Apex's launcher started ``script.py args --world-size N --rank i`` once per GPU and sent the output of
ranks > 0 to ``GPU_<i>.log``. This one does the same through ``torchrun`` (``torch.distributed.run
--standalone``), so the workers also get torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``: ``init_process_group("nccl")`` works with no
arguments) and its failure handling (when one worker fails, the others are stopped and the launcher
exits non-zero).

Workers run under culmen's import alias (``culmen.compat``), so a script written for Apex
(``import apex``) runs unchanged, however the launcher was started: ``python -m culmen.parallel.multiproc``
or ``python -m culmen.compat -m apex.parallel.multiproc`` (a ``--force`` given to the latter reaches
the workers too).

Options (before the script):
    --nproc N         processes to start (default: the number of visible GPUs, 1 without GPUs)
    --no-rank-args    do not append ``--world-size N --rank i`` to the script's arguments
    --log-dir DIR     where ranks > 0 write ``GPU_<i>.log`` (default: the current directory)
    --no-log-files    leave every rank's output on the console
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

_USAGE = ("usage: python -m culmen.parallel.multiproc [--nproc N] [--no-rank-args] [--log-dir DIR] [--no-log-files] "
          "script.py [args ...]")


def docstring_hack() -> None:
    """Multiproc launcher: ``python -m apex.parallel.multiproc main.py ...`` starts one process per visible GPU
    (Apex keeps this function only to carry that text; it does nothing)."""


def _parse(argv: list[str]) -> tuple[dict, list[str]]:
    opts = {"nproc": None, "rank_args": True, "log_dir": ".", "log_files": True, "worker": False}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        a = argv[i]
        if a == "--nproc" and i + 1 < len(argv):
            opts["nproc"] = int(argv[i + 1])
            i += 2
            continue
        if a.startswith("--nproc="):
            opts["nproc"] = int(a.split("=", 1)[1])
        elif a == "--no-rank-args":
            opts["rank_args"] = False
        elif a == "--log-dir" and i + 1 < len(argv):
            opts["log_dir"] = argv[i + 1]
            i += 2
            continue
        elif a == "--no-log-files":
            opts["log_files"] = False
        elif a == "--worker":
            opts["worker"] = True
        elif a in ("-h", "--help"):
            raise SystemExit(_USAGE + "\n\n" + (__doc__ or ""))
        else:
            raise SystemExit(f"unknown option {a}\n{_USAGE}")
        i += 1
    if i >= len(argv):
        raise SystemExit(_USAGE)
    return opts, argv[i:]


def launch_command(argv: list[str]) -> list[str]:
    """The torchrun command line that ``main(argv)`` runs."""
    opts, rest = _parse(argv)
    nproc = opts["nproc"]
    if nproc is None:
        try:
            import torch

            nproc = torch.cuda.device_count() or 1
        except Exception:
            nproc = 1
    from culmen.compat import child_args

    worker = ["--worker"]
    if not opts["rank_args"]:
        worker.append("--no-rank-args")
    if opts["log_files"]:
        worker += ["--log-dir", os.path.abspath(opts["log_dir"])]
    else:
        worker.append("--no-log-files")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "culmen.compat", *child_args(), "-m", "culmen.parallel.multiproc", *worker, *rest]


def _worker(opts: dict, rest: list[str]) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    script, args = rest[0], rest[1:]
    if opts["rank_args"]:
        args = [*args, "--world-size", str(world), "--rank", str(rank)]
    if opts["log_files"] and rank > 0:
        os.makedirs(opts["log_dir"], exist_ok=True)
        log = open(os.path.join(opts["log_dir"], f"GPU_{rank}.log"), "w", buffering=1)  # noqa: SIM115
        os.dup2(log.fileno(), sys.stdout.fileno())
        sys.stdout = log
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    """Run the launcher (or, with ``--worker``, one worker) and return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, rest = _parse(argv)
    if opts["worker"]:
        _worker(opts, rest)
        return 0
    if not os.path.exists(rest[0]):
        print(f"python -m culmen.parallel.multiproc: can't open file {os.path.abspath(rest[0])!r}: no such file",
              file=sys.stderr)
        return 2
    return subprocess.call(launch_command(argv))


if __name__ == "__main__":
    sys.exit(main())
