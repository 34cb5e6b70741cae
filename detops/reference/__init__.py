"""Plain-PyTorch reference implementations of the detops ops.

Slow, simple and written from the definitions; the tests hold the compiled kernels to them.
Import the module of the op you need, e.g. `from detops.reference.nms import nms`.
"""
