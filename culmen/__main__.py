"""``python -m culmen``: the ``culmen`` command (``info``, ``bench``, ``demo``)."""

import sys

from culmen.cli import main

if __name__ == "__main__":
    sys.exit(main())
