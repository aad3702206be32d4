"""`python -m kvlab.notebook ...`: stamp, run and check the committed notebooks (kvlab.notebook.tools)."""

import sys

from .tools import main

sys.exit(main())
