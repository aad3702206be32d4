"""`python -m kvlab.notebook ...`: stamp, run and check the committed notebooks (kvlab.notebook.tools)."""

from .tools import main

raise SystemExit(main())
