"""``python -m culmen.compat SCRIPT.py ARGS...`` / ``python -m culmen.compat -m MODULE ARGS...``.

Installs the import aliases of ``culmen.compat`` and runs the script or module as ``__main__``
with ``sys.argv`` set as if Python had run it directly. A script that does not exist, or a module
that cannot be found, gives a one-line message on stderr and exit status 2 / 1 (as ``python`` itself
does), not a traceback. The module may be a peer name (``-m apex.parallel.multiproc``).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

from culmen.compat import install

_PROG = "python -m culmen.compat"


def _module_missing(module: str) -> str | None:
    """Why ``module`` cannot be run (a message), or None when it can be found. Only finding is
    checked here: errors raised while the module runs keep their traceback."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:  # a missing parent package, an empty or relative name
        return f"No module named {getattr(e, 'name', None) or module!r} ({e})"
    if spec is None:
        return f"No module named {module!r}"
    return None

USAGE = """usage: python -m culmen.compat [--force] SCRIPT.py [ARGS...]
       python -m culmen.compat [--force] -m MODULE [ARGS...]

Runs SCRIPT.py (or MODULE) with `import apex` / `import flash_attn` served by culmen.
--force  alias even where a real apex / flash_attn is installed."""


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), install the aliases and run the target."""
    args = list(sys.argv[1:] if argv is None else argv)
    force = False
    # Hand-parsed: everything after the script / module name belongs to it, options included.
    while args and args[0] in ("--force", "-h", "--help"):
        if args[0] == "--force":
            force = True
            args.pop(0)
        else:
            print(USAGE)
            return 0
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    install(force=force)
    if args[0] == "-m":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        module, rest = args[1], args[2:]
        why = _module_missing(module)
        if why is not None:
            print(f"{_PROG}: {why}", file=sys.stderr)
            return 1
        sys.argv = [module, *rest]  # run_module replaces argv[0] with the module's file path
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script, rest = args[0], args[1:]
    if not os.path.exists(script):
        if script.startswith("-"):
            print(f"{_PROG}: unknown option {script!r}\n{USAGE}", file=sys.stderr)
        else:
            print(f"{_PROG}: can't open file {os.path.abspath(script)!r}: no such file", file=sys.stderr)
        return 2
    sys.argv = [script, *rest]
    # Like `python script.py`: the script's folder, not the current one, heads sys.path.
    script_dir = os.path.dirname(os.path.abspath(script))
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
