"""`python -m migration`: the command line (migration/cli/)."""

from migration.cli.commands import main
from migration.common import leave

if __name__ == "__main__":
    leave(main())
