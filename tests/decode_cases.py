"""Builders of decode test cases shared by the GPU tests and the debug script."""

import torch

from snapmla_cute import FP8KVCache, emulation
from snapmla_cute import reference as ref
from snapmla_cute.accuracy import make_inputs

HUGE = 2**30


def build_case(b, s_q, h, page_size, lens, *, dist="flashmla", seed=0, device="cuda"):
    """Random q and K, an FP8 cache with shuffled pages, NaN in every unused slot, and block
    table entries past each sequence set to a huge page id."""
    gen = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in lens]
    n_pages = [(L + page_size - 1) // page_size for L in lens]
    total = sum(n_pages) + 2
    if dist == "flashmla":
        k = (torch.randn(total * page_size, 576, generator=gen) / 10).clamp(-1, 1)
        q = torch.randn(b, s_q, h, 576, generator=gen)
    else:
        Lmax = max(max(lens), 1)
        q, kp, _, _ = make_inputs(dist, b, s_q, h, Lmax, page_size, gen)  # paper / realistic / stress
        k = kp.view(-1, 576).float()
        k = k.repeat((total * page_size + k.shape[0] - 1) // k.shape[0], 1)[: total * page_size]
        q = q.float()
    k_pages = k.to(torch.bfloat16).view(total, page_size, 576)
    q = q.to(torch.bfloat16)
    perm = torch.randperm(total, generator=gen)
    width = max(n_pages) + 3
    block_table = torch.full((b, width), HUGE, dtype=torch.int32)
    cache = FP8KVCache.allocate(total, page_size, device=device, fill_nan=True)
    kv, kv_scale = ref.quantize_kv_cache(k_pages)
    used = torch.zeros(total, page_size, dtype=torch.bool)
    pos = 0
    for i, n in enumerate(n_pages):
        pages = perm[pos : pos + n]
        pos += n
        block_table[i, :n] = pages.int()
        tok = torch.arange(n * page_size).view(n, page_size)
        used[pages] = tok < lens[i]
    used = used.to(device)
    cache.kv[used] = kv.to(device)[used]
    cache.kv_scale[used] = kv_scale.to(device)[used]
    return dict(
        q=q.to(device),
        k_pages=k_pages.to(device),
        cache=cache,
        block_table=block_table.to(device),
        cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
    )


def references(case, causal, softmax_scale=None):
    c = case
    exact = ref.mla_decode_exact(c["q"], c["k_pages"], c["block_table"], c["cache_seqlens"], causal=causal, softmax_scale=softmax_scale)
    emu = emulation.mla_decode_emulated(
        c["q"], (c["cache"].kv, c["cache"].kv_scale), c["block_table"], c["cache_seqlens"], causal=causal, softmax_scale=softmax_scale
    )
    return exact, emu


def host_syncs(call) -> list[str]:
    """The host-device synchronizations of one ``call()`` after a first one (compiled and
    loaded), as torch's sync debug mode reports them."""
    import warnings

    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]
