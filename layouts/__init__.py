"""Explicit CuTe layout objects of the decode kernel (importable only as ``snapmla_cute.layouts``).

Holds the Swizzle-128B SMEM atoms, the k-major V transposition and the P byte permutation,
each printable and testable as a mapping on the CPU. The fused memory-bound kernels of the
foundation need none of them; the decode kernel brings them.
"""
