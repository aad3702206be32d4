"""The one place that knows how the installed transformers names the cache.

transformers 5.24 renamed the forward argument and output field `past_key_values` to `cache` (the old
name is accepted with a FutureWarning until 5.40). kvlab supports 5.17 through the latest 5.x; everything
else it imports from transformers (`AttentionInterface`, `AttentionMaskInterface`, `sdpa_mask`,
`sdpa_attention_forward`, `repeat_kv`, `Cache`, `CacheLayerMixin`, `DynamicLayer`, `StaticCache`, the
logits warpers) exists with the same signatures in 5.17, so this name is the only difference to bridge.

The wrong name is not an error: 5.17 swallows `cache=` into the forward's `**kwargs` and runs without a
cache, which is why the name is looked up rather than guessed.
"""

import inspect

import torch
import transformers
from packaging.version import Version

CACHE_RENAMED_IN = "5.24"


def _installed_renames() -> bool:
    return Version(transformers.__version__).release >= Version(CACHE_RENAMED_IN).release


def cache_argument(model: torch.nn.Module) -> str:
    """Name of the keyword that carries the KV cache into `model.forward`.

    Read from the forward's signature; a forward that names neither (a wrapper taking only `**kwargs`)
    gets the installed transformers' name.
    """
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
