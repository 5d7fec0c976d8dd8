"""The decode CTA's roles: pipelines.roles' warpgroup layouts and budgets, the role objects of
kernels/decode and the one step signature. CPU: no GPU needed."""

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


def test_decode_roles_are_objects_handed_their_bundles():
    """The decode kernel's roles are separate frozen objects, not mixins of the kernel: the
    kernel class has no base but ``object``, no role inherits from another, and a role
    reaches another only through a field typed with that role's class."""
    import dataclasses
    import typing

    from snapmla_cute.kernels.decode import consumer, epilogue, kernel, merge, plan, producer, transposer

    role_classes = (plan.Planner, producer.Producer, transposer.Transposer, consumer.Consumer, epilogue.Epilogue,
                    merge.Merger)
    assert kernel.DecodeKernel.__bases__ == (object,)
    for cls in role_classes:
        assert cls.__bases__ == (object,), cls
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        hints = typing.get_type_hints(cls)
        assert all(f.name in hints for f in dataclasses.fields(cls)), cls
    hints = typing.get_type_hints(consumer.Consumer)
    assert (hints["epilogue"], hints["merger"], hints["transposer"]) == (epilogue.Epilogue, merge.Merger,
                                                                         transposer.Transposer)


def test_decode_step_has_one_signature():
    """Every decode call (dense, sparse, visible counts, bf16 query, the accurate mode's q_lo)
    goes through one step class and one ``__call__`` signature; the optional tensors come last."""
    import inspect

    from snapmla_cute.kernels.decode import step

    steps = [c for _, c in inspect.getmembers(step, inspect.isclass)
             if c.__module__ == step.__name__ and "__call__" in vars(c)]
    assert steps == [step.DecodeStepKernel]
    params = list(inspect.signature(step.DecodeStepKernel.__call__).parameters)
    assert params[-5:] == ["scale_log2", "stream", "m_visible", "m_q", "m_q_lo"]
