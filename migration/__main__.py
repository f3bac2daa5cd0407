"""`python -m migration`: the command line (migration/cli/)."""

import sys

from migration.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
