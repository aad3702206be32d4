"""`python -m kvlab ...`: the command line lives in kvlab.cli (the `kvlab` console script calls kvlab.cli:main)."""

from .cli import main

if __name__ == "__main__":
    main()
