"""The lab tools' and tests' entry to offline compilation: :mod:`fp4video.kernels.offline`."""

from fp4video.kernels.offline import WAN_480P_INTS, compile_kernel, launch_signature

__all__ = ["WAN_480P_INTS", "compile_kernel", "launch_signature"]
