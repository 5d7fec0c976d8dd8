"""Constants of the SnapMLA FP8 KV-cache and query formats (no imports, shared by the kernels and the API).

``reference.py`` restates these values on purpose (it is the independent specification);
``tests/test_reference.py`` checks the two agree.
"""

CONTENT_DIM = 512  # latent c_KV dims, stored e4m3
ROPE_DIM = 64  # decoupled RoPE dims, stored bf16 pre-divided by the token's scale (Eq. 6)
HEAD_DIM = CONTENT_DIM + ROPE_DIM  # 576: the q/k head dim of absorbed MLA
V_DIM = CONTENT_DIM  # V = the content part
KV_ROW_BYTES = CONTENT_DIM + 2 * ROPE_DIM  # 640 bytes per token (+4 B fp32 scale elsewhere)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-6  # all-zero rows get scale AMAX_FLOOR/448, so every scale is finite and > 0
# the query's precision: its content as one e4m3 term, or as hi + lo e4m3 on one scale (the
# accurate mode); the API's ``q_precision``, the accuracy study's and the CLI's choices
Q_PRECISIONS = ("e4m3", "e4m3x2")
PAGE_SIZES = (16, 32, 64, 128)
DEFAULT_PAGE_SIZE = 64
