"""``python -m headlab``: the same as the ``headlab`` command."""

import sys

try:
    from headlab.cli import main
except KeyboardInterrupt:  # Ctrl-C while the modules load: one line, as headlab.cli.main says it later
    print("headlab: interrupted while starting; nothing was done", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
