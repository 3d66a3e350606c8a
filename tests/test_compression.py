"""fp16 / bf16 compression halves the bytes on the wire and stays close to the exact run."""

from common import reference_train


def test_compression_halves_wire_bytes_and_bounds_the_error(optimizer_job):
    """bf16 through DistributedOptimizer (fp16: the DDP hook test below)."""
    # the same keys at the model's precision: what uncompressed runs send (every exactness test checks them)
    squeezed, full = optimizer_job.key_bytes("wfbp+bf16")
    # The test model is float64: 16-bit wire formats carry a quarter of its bytes.
    assert squeezed * 4 == full
    assert optimizer_job.key_bytes("wfbp") == (full, full)
    ref = reference_train("sgd", 6)
    got = optimizer_job.params["wfbp+bf16"]
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert 0 < diff <= 2e-2  # numerics change, by a bounded amount


def test_ddp_hook_compresses_with_the_same_bound(optimizer_job):
    squeezed, full = optimizer_job.key_bytes("wfbp+hook+fp16")
    assert squeezed * 4 == full
    assert optimizer_job.key_bytes("wfbp+hook") == (full, full)
    ref = reference_train("sgd", 6)
    got = optimizer_job.params["wfbp+hook+fp16"]
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert 0 < diff <= 2e-3
