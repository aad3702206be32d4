"""The Jupyter kernel that papermill runs kvlab's notebooks with."""

from __future__ import annotations

# `make lab` registers the project's environment under this name (never `python3`: the user's default kernel).
KERNEL = {"name": "kvlab", "display_name": "Python 3 (kvlab)", "language": "python"}
FALLBACK_KERNEL = "python3"  # jupyter_client's native kernel: the Python running papermill
# Every papermill call passes these: the kernel's own log lines (localhost TCP, shutdown) would reach our terminal.
QUIET_KERNEL = ["--IPKernelApp.log_level=CRITICAL"]


def kernel_name() -> str:
    """The kernel to execute a notebook with: `kvlab` where `make lab` registered it, else the native one."""
    from jupyter_client.kernelspec import KernelSpecManager

    return KERNEL["name"] if KERNEL["name"] in KernelSpecManager().find_kernel_specs() else FALLBACK_KERNEL
