"""pipelines.roles: the warpgroup layouts of the decode CTA. CPU: no GPU needed."""

import pytest

@pytest.mark.parametrize("transposer", [True, False])
def test_warpgroup_register_budgets_fit_the_register_file(transposer):
    """setmaxnreg budgets (multiples of 8 in [24, 256]) of every warpgroup of a CTA must fit
    Hopper's 65536 registers per SM (one CTA per SM): setmaxnreg.inc would otherwise wait
    forever for registers nobody releases."""
    from snapmla_cute.pipelines import roles

    lay = roles.layout(transposer)
    budgets = [roles.PRODUCER_REGS] + ([roles.TRANSPOSER_REGS] if transposer else [])
    budgets += [lay.consumer_regs] * roles.NUM_CONSUMER_WGS
    assert len(budgets) * roles.THREADS_PER_WG == lay.threads
    assert all(b % 8 == 0 and 24 <= b <= 256 for b in budgets)
    assert sum(b * roles.THREADS_PER_WG for b in budgets) <= 65536
    assert lay.first_consumer_wg == len(budgets) - roles.NUM_CONSUMER_WGS
    B = roles.Barrier
    pairs = (B.WG_SYNC, B.STATE, B.PFREE)  # the first of two ids each
    ids = [b + k for b in pairs for k in range(2)] + [b for b in B if b not in pairs]
    assert len(set(ids)) == len(ids) and all(1 <= i <= 15 for i in ids)  # 0 is __syncthreads
