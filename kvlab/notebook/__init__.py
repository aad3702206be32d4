"""What the notebooks share: plots, helpers for the lessons, Colab set-up, and the tooling that stamps,
executes and cleans them (`python -m kvlab.notebook`)."""
