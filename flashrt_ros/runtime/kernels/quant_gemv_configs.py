"""Launch configurations of the fused quantized GEMV (:mod:`.quant_gemv`), by device name.

Written by ``bench/tune_quant_gemv.py`` from a sweep on that device (candidates timed in CUDA graphs, each checked
against the reference); copy its ``--write-table`` output over this file. A configuration fixes the kernel's
K-reduction order, so this table is code, not a run-time choice.

``TABLE[device_name]``: ``configs``: (weight kind, N, K, rows bucket) -> (block_n, block_k, num_warps, num_stages,
splits); ``fused_max_rows``: weight kind -> the most rows that take the fused GEMV (more: dequantise + cuBLAS).
"""

DEFAULT_FUSED_MAX_ROWS = 16         # devices the table does not list: decode and the short suffix buckets

TABLE: dict[str, dict] = {}
