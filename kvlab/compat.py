"""The one place that knows how the installed transformers names the cache.

transformers 5.24 renamed the forward argument and output field `past_key_values` to `cache`; kvlab supports
5.17 through the latest 5.x, and everything else it imports has the same signatures across them. The wrong name
is no error (5.17 swallows `cache=` into `**kwargs` and runs without a cache), so the name is looked up.
"""

import inspect
from importlib.metadata import version

from packaging.version import Version

CACHE_RENAMED_IN = "5.24"
# From 5.18 generate() drops an attention mask of ones once it has made the position ids from it (its comment: "to
# make downstream attention mask creation and inference faster"); 5.17 passes it to every forward.
ONES_MASK_DROPPED_IN = "5.18"


def installed_transformers() -> str:
    """The installed transformers' version, read from its metadata: no need to import it (that takes seconds)."""
    return version("transformers")


def _installed_at_least(release: str) -> bool:
    return Version(installed_transformers()).release >= Version(release).release


def _installed_renames() -> bool:
    return _installed_at_least(CACHE_RENAMED_IN)


def generate_drops_ones_mask() -> bool:
    """Whether the installed generate() gives the forward no attention mask when it is all ones (no padding)."""
    return _installed_at_least(ONES_MASK_DROPPED_IN)


def cache_argument(model) -> str:
    """The keyword that carries the KV cache into `model.forward`, from its signature (the installed release's
    name for a forward that names neither)."""
    params = inspect.signature(type(model).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return "cache" if _installed_renames() else "past_key_values"


def cache_from_outputs(outputs):
    """The cache a forward handed back, whatever the output field is called."""
    for name in ("cache", "past_key_values"):
        if name in outputs:
            return outputs[name]
    return None
