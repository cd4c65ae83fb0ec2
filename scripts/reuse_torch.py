"""Let a fresh virtual environment see the torch of the Python that created it (``make demo`` / ``make test``).

Usage: ``PYTHON scripts/reuse_torch.py VENV_PYTHON``, run by the interpreter that created the venv.

When that interpreter imports torch (a GPU user's CUDA or ROCm build, a conda torch, a torch in an
outer virtual environment), this writes a ``.pth`` file into the venv's site-packages that adds the
directory holding torch, and the interpreter's other site directories, *behind* the venv's own ones:
the venv then imports that torch (and its triton, numpy ...) instead of installing the CPU wheel over
it, while anything the venv installs itself still wins. ``python -m venv --system-site-packages``
does not do this when the interpreter is itself a venv (it exposes the base installation's packages,
not the venv's), hence the ``.pth``. ``site.addsitedir`` (not a bare path line) also processes the
``.pth`` files of those directories, so editable installs there keep working.

Prints one line saying what it did; exits 0 when there is nothing to reuse, 1 when the venv still
cannot import the torch it was pointed at.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig

# Processed after the venv's own .pth files (alphabetical order), so its editable culmen is found first.
PTH_NAME = "zz-culmen-reuse-torch.pth"


def outer_site_dirs(torch_dir: str) -> list[str]:
    """``torch_dir`` first, then this interpreter's site-packages and user site, existing ones, no repeats."""
    dirs = [torch_dir, *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    dirs.append(sysconfig.get_paths()["purelib"])
    seen: list[str] = []
    for d in dirs:
        d = os.path.realpath(d)
        if os.path.isdir(d) and d not in seen:
            seen.append(d)
    return seen


def pth_text(dirs: list[str]) -> str:
    """The ``.pth`` body: one executed ``import site`` line per directory (``repr`` quotes any path)."""
    return "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    venv_python = argv[0]
    try:
        import torch
    except ImportError:
        print(f"reuse_torch: {sys.executable} has no torch; the venv installs the CPU build")
        return 0
    torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    target = subprocess.run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    dirs = [d for d in outer_site_dirs(torch_dir) if d != os.path.realpath(target)]
    with open(os.path.join(target, PTH_NAME), "w") as f:
        f.write(pth_text(dirs))
    probe = subprocess.run([venv_python, "-c", "import torch; print(torch.__version__, torch.__file__)"],
                           capture_output=True, text=True)
    seen = probe.stdout.split()
    if probe.returncode != 0 or not seen or seen[0] != torch.__version__:
        print(f"reuse_torch: the venv does not import torch {torch.__version__} from {torch_dir}: "
              f"{(probe.stderr.strip().splitlines() or seen or ['?'])[-1]}", file=sys.stderr)
        return 1
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (
        f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU")
    print(f"reuse_torch: the venv uses torch {torch.__version__} ({build}) from {torch_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
