"""``python -m lab.diagnose PATH [--from FORMAT] ...``: the ``lab diagnose`` command."""
import sys

from lab.diagnose.cli import main

sys.exit(main())
