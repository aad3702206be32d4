"""The one place that knows how the installed transformers names the cache.

transformers 5.24 renamed the forward argument and output field `past_key_values` to `cache`
(the old name is accepted with a warning until 5.40). kvlab supports 5.17 through the latest 5.x.
"""

import inspect

import torch


def cache_argument(model: torch.nn.Module) -> str:
    """Name of the keyword that carries the KV cache into `model.forward`."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_from_outputs(outputs):
    """The cache a forward handed back, whatever the output field is called."""
    for name in ("cache", "past_key_values"):
        if name in outputs:
            return outputs[name]
    return None


