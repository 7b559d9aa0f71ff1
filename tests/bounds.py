"""Tolerances the tests share, each with what it was measured from."""

# An item's embeddings encoded alone and in a batch with others (fp32, the tiny checkpoints, CPU): the tower's matrix
# products sum in an order that oneDNN / MKL choose by the number of rows in the batch, so one item's rows move by a
# few float32 ulps with its neighbours. Measured: at most 1.2e-6 (2026-12-04, on embeddings up to 2.8 in size) and
# 1.02e-6 where the expected value was near 0 (2026-12-05, an AVX-512 FP16 Xeon, where atol 1e-6 failed); a batching
# defect (another item's rows, a wrong grid) moves values by 1e-2 or more.
BATCH_BOUND = dict(atol=4e-6, rtol=1e-6)
