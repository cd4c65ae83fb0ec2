"""``python -m culmen.parallel.multiproc``: one process per device through torchrun, Apex's rank arguments."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from culmen.parallel import multiproc


def test_launch_command():
    cmd = multiproc.launch_command(["--nproc", "3", "train.py", "--lr", "0.1"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=3" in cmd and cmd[-3:] == ["train.py", "--lr", "0.1"]
    # Workers run under the import alias (an Apex script's `import apex` works), then the worker mode.
    i = cmd.index("-m", 3)
    assert cmd[i:i + 4] == ["-m", "culmen.compat", "-m", "culmen.parallel.multiproc"] and "--worker" in cmd
    cmd = multiproc.launch_command(["--no-rank-args", "--no-log-files", "--nproc=2", "t.py"])
    assert "--no-rank-args" in cmd and "--no-log-files" in cmd and "--nproc_per_node=2" in cmd


def test_launch_two_workers(tmp_path):
    script = tmp_path / "train.py"
    # An Apex script: the workers run under culmen's import alias.
    script.write_text(textwrap.dedent("""
        import argparse, os, sys
        import apex
        import torch.distributed as dist
        ap = argparse.ArgumentParser()
        ap.add_argument("--lr", type=float)
        ap.add_argument("--world-size", type=int)
        ap.add_argument("--rank", type=int)
        a = ap.parse_args()
        dist.init_process_group("gloo")
        assert dist.get_rank() == a.rank == int(os.environ["RANK"]) and dist.get_world_size() == a.world_size == 2
        print(f"rank {a.rank} of {a.world_size} lr {a.lr} main={__name__} apex={apex.__name__}", flush=True)
        dist.destroy_process_group()
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "culmen.parallel.multiproc", "--nproc", "2", "--log-dir",
                           str(tmp_path), str(script), "--lr", "0.5"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 2 lr 0.5 main=__main__ apex=culmen" in proc.stdout
    assert "rank 1 of 2" not in proc.stdout  # Apex: ranks > 0 write GPU_<rank>.log
    assert "rank 1 of 2 lr 0.5 main=__main__ apex=culmen" in (tmp_path / "GPU_1.log").read_text()
    # A failing worker makes the launcher fail.
    script.write_text("raise SystemExit(7)\n")
    proc = subprocess.run([sys.executable, "-m", "culmen.parallel.multiproc", "--nproc", "2", "--no-rank-args",
                           str(script)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
