"""`python -m kvlab ...`: the command line lives in kvlab.lab.cli."""

from .lab.cli import main

main()
