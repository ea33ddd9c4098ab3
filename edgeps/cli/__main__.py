"""``python -m edgeps.cli``: the edgeps command."""

import sys

from edgeps.cli import main

sys.exit(main())
