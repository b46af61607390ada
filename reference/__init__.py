"""Plain PyTorch twins of every op in ``dspark_kernels.ops``: same signature, same semantics, readable ground truth.

Installed as ``dspark_kernels.reference``; this is also the CPU execution path of every op.
"""
