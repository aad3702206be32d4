"""`python -m kvlab.sweep ...`, the same as `python -m kvlab sweep ...`."""

from .cli import main

main()
