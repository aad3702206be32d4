"""Write the lines of transformers 4.40.1 and 4.42.4 that lesson 02 and appendix A4 diff, cut from the installed
releases (kvlab.releases.cut_excerpts; each installed once into its own folder), to the committed copy the lessons
read, so that a reader needs no old release installed. tests/test_reference.py fails when the copy drifts.

    python scripts/pr_excerpts.py
"""

import json
import os
import tempfile
from pathlib import Path

from kvlab.releases import ROOT, cut_excerpts

TARGET = ROOT / "data" / "reference" / "pr30536_excerpts.json"


def main():
    text = json.dumps(cut_excerpts(), indent=1) + "\n"
    # a temporary file of its own beside the target, renamed over it once complete
    handle, temporary = tempfile.mkstemp(dir=TARGET.parent, prefix=f".{TARGET.name}.")
    with os.fdopen(handle, "w") as out:
        out.write(text)
    os.replace(temporary, TARGET)
    print(f"wrote {Path(TARGET).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
