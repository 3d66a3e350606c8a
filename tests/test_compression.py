"""fp16 / bf16 compression cuts the bytes on the wire and stays close to the exact run."""

import pytest
from common import reference_train


@pytest.mark.parametrize("plain,compressed,bound", [
    ("wfbp", "wfbp+bf16", 2e-2),  # DistributedOptimizer, bf16
    ("wfbp+hook", "wfbp+hook+fp16", 2e-3),  # the DDP hook, fp16
])
def test_compression_cuts_wire_bytes_and_bounds_the_error(optimizer_job, plain, compressed, bound):
    squeezed, full = optimizer_job.key_bytes(compressed)
    # The test model is float64: 16-bit wire formats carry a quarter of its bytes; the uncompressed
    # run sends the same keys at the model's precision (every exactness test checks its values).
    assert squeezed * 4 == full
    assert optimizer_job.key_bytes(plain) == (full, full)
    ref = reference_train("sgd", 6)
    got = optimizer_job.params[compressed]
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert 0 < diff <= bound  # numerics change, by a bounded amount
