"""Warp-specialized producer/consumer machinery (importable only as ``snapmla_cute.pipelines``).

Warp roles, register budgets, TMA/mbarrier stages, named barriers and the dual-warpgroup
schedule of the decode kernel live here; the one-warp-per-row fused kernels need none.
"""
