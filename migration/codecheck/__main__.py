"""`python -m migration.codecheck PATH...`: the code check as a linter (migration/codecheck/lint.py)."""

import sys

from migration.codecheck.lint import main

if __name__ == "__main__":
    sys.exit(main())
