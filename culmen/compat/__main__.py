"""``python -m culmen.compat SCRIPT.py ARGS...`` / ``python -m culmen.compat -m MODULE ARGS...``.

Installs the import aliases of ``culmen.compat`` and runs the script or module as ``__main__``
with ``sys.argv`` set as if Python had run it directly.
"""

from __future__ import annotations

import os
import runpy
import sys

from culmen.compat import install

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
        sys.argv = [module, *rest]  # run_module replaces argv[0] with the module's file path
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script, rest = args[0], args[1:]
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
