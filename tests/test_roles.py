"""The decode CTA's roles: pipelines.roles' warpgroup layouts and budgets, the role objects of
kernels/decode and the one step signature. CPU: no GPU needed."""

def test_warpgroup_register_budgets_fit_the_register_file():
    """setmaxnreg budgets (multiples of 8 in [24, 256]) of every warpgroup of a CTA must fit
    Hopper's 65536 registers per SM (one CTA per SM): setmaxnreg.inc would otherwise wait
    forever for registers nobody releases."""
    from snapmla_cute.pipelines import roles

    lay = roles.LAYOUT
    budgets = [roles.PRODUCER_REGS, roles.TRANSPOSER_REGS]
    budgets += [lay.consumer_regs] * roles.NUM_CONSUMER_WGS
    assert len(budgets) * roles.THREADS_PER_WG == lay.threads
    assert all(b % 8 == 0 and 24 <= b <= 256 for b in budgets)
    assert sum(b * roles.THREADS_PER_WG for b in budgets) <= 65536
    assert lay.first_consumer_wg == len(budgets) - roles.NUM_CONSUMER_WGS
    assert lay.transposer_wg == 1
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
    assert (hints["epilogue"], hints["merger"]) == (epilogue.Epilogue, merge.Merger)


def test_decode_step_has_one_signature():
    """Every decode call (dense, sparse, visible counts, bf16 query, the accurate mode's q_lo)
    goes through one step class whose compiled entry takes ``launch.StepArgs``'s fields: the
    required ones, the stream, then the optional tensors; the kernel's own entry likewise
    takes ``launch.KernelArgs``'s."""
    import inspect

    from snapmla_cute.kernels.decode import kernel, launch, step

    steps = [c for _, c in inspect.getmembers(step, inspect.isclass)
             if c.__module__ == step.__name__ and "__call__" in vars(c)]
    assert steps == [step.DecodeStepKernel]
    for cls, bundle, optional in ((step.DecodeStepKernel, launch.StepArgs, ["visible", "q", "q_lo"]),
                                  (kernel.DecodeKernel, launch.KernelArgs, ["visible", "q_lo"])):
        params = list(inspect.signature(cls.__call__).parameters)
        assert params == ["self", *bundle._fields[:-len(optional)], "stream", *optional], cls
        assert list(bundle._field_defaults) == optional


def test_entry_arguments_round_trip():
    """``fake_call`` (what compile passes) and ``from_entry`` (what an entry receives) are
    each other's inverse, the stream between the required and the optional fields."""
    from snapmla_cute.kernels.decode.launch import StepArgs, fake_call, from_entry

    args = StepArgs(*range(15), visible="v", q="q", q_lo="lo")
    call = fake_call(args, "stream")
    assert call[15] == "stream" and call[16:] == ("v", "q", "lo")
    assert from_entry(StepArgs, call) == (args, "stream")
