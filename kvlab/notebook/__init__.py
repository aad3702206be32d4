"""What the notebooks share: each lesson's figures (`figures/`, one module per lesson, named after its notebook),
helpers for lessons 01-03, Colab set-up, and the tooling that stamps, executes and cleans them
(`python -m kvlab.notebook`)."""
