"""Warp-specialized producer/consumer machinery (importable only as ``snapmla_cute.pipelines``).

* ``roles`` — the CTA's warpgroups, their ``setmaxnreg`` budgets and the named barrier ids.
* ``kv_ring`` — stage and phase of the g-th KV block over the TMA/mbarrier pipeline, from the
  consumers' side and from the sparse decode's gathering producer threads'.
* ``handshakes`` — the transposer's per-stage mbarriers, the consumer warpgroups'
  exchange of P slots and softmax states, and the cluster merge's mbarriers across CTAs.

The one-warp-per-row fused kernels need none of it.
"""
