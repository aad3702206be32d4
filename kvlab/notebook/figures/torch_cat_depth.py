"""Appendix A3's counter: the bytes every aten op writes (torch.cat's copies, counted)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

NO_WRITE = ("empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like")


class BytesWritten(TorchDispatchMode):
    """Sum of the bytes every aten op writes while active (our own: torch's counters count flops, not bytes).

    An op's output is a fresh tensor (written in full: `cat`, `clone`), an input it modified in place (`copy_`,
    `out=`: that tensor's or view's bytes) or a view (`slice`: nothing written); the op's schema says which.
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in NO_WRITE:
            return out
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        self.bytes += sum(
            leaf.numel() * leaf.element_size()
            for ret, value in zip(func._schema.returns, outputs)
            if ret.alias_info is None or ret.alias_info.is_write  # else a view: no bytes move
            for leaf in tree_leaves(value)
            if isinstance(leaf, torch.Tensor)
        )
        return out
