"""``python -m reproduction``: run from the root of a headlab checkout (see docs/reproduction.md)."""

import sys

from reproduction.cli import main

if __name__ == "__main__":
    sys.exit(main())
