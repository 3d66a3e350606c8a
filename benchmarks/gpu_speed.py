"""Published GPU compute times for the benchmark profiles, and the time scale that replays a CPU
profile at that speed.

    python benchmarks/gpu_speed.py            # the table below, with each profile's time scale

The profiles (``benchmarks/profiles/<model>-cpu.json``, batch 8) were measured on a 2-core CPU, up to
a hundred times slower than the GPUs users train on, so a simulation that replays them as they are
is compute-bound everywhere. :func:`time_scale` is the factor for ``ClusterSpec(time_scale=...)``
(:func:`gpu_model` scales the layers themselves) that makes the profile's compute per iteration
(the sum of its layers' forward and backward times) equal the published GPU time below at the
profile's batch size. Where the batch sizes differ the time is scaled per sample, linearly
(``t * profile_batch / published_batch``): exact for a saturated GPU, an underestimate of a small
batch's time where kernels do not fill the GPU (batch 12 -> 8 here, so a small one).

======== ============= ====== ============= ===================================================
model    forward+back  batch  GPU           source
======== ============= ====== ============= ===================================================
resnet18 16.69 ms      12     Titan V       ryujaehun/pytorch-gpu-benchmark, README "Results"
                                            table, row "Training | TITAN V | single" (PyTorch,
                                            torchvision model, fp32; zero_grad + forward + loss +
                                            backward between two cuda synchronizes, no optimizer
                                            step, no communication; mean of 50 steps)
resnet50 50.54 ms      12     Titan V       same table and row
vgg16    72.85 ms      12     Titan V       same table and row
alexnet  3.54 ms       12     Titan V       derived: the table has no AlexNet. VGG-16's time
         (derived)                          divided by VGG-16's per-image time over AlexNet's on a
                                            V100: 5132.32 / 249.19 = 20.6 images/s (Lambda's
                                            tf_cnn_benchmarks logs, LambdaColdStorage/lambda-
                                            tensorflow-benchmark, logs/Platinum-Tesla_V100-SXM3-
                                            32GB_HP16_TF2_2.logs/syn-replicated-fp32-1gpus/
                                            {alexnet-1536,vgg16-192}/throughput/1, "total
                                            images/sec"; synthetic data, fp32, 1 GPU)
synthetic (assumed)                         not a real network (8 x 8 MiB float32 weights, CPU
                                            times chosen by hand): it gets the geometric mean of
                                            the four measured models' time scales, i.e. "the same
                                            host with the GPU above", keeping its chosen
                                            compute-to-communication ratio scaled like the others'
======== ============= ====== ============= ===================================================

The Titan V is the Volta GV100 chip of the V100 (80 SMs, 12 GB HBM2); Lambda's 2019 TensorFlow
benchmarks put its fp32 training throughput at about 0.83 of a V100's (the RTX 2080 Ti "96% as
fast as the Titan V, 80% as fast as the Tesla V100"). Cross-checks at large batch on a real V100:
ResNet-50 v1.5 fp32, 367 images/s at batch 112 (NVIDIA DeepLearningExamples, PyTorch/Classification/
ConvNets/resnet50v1.5/README.md, "Training performance: NVIDIA DGX-1 16GB (8x V100 16GB)", 1 GPU;
batch from ConvNets/configs.yml, DGX1V FP32) and 432 images/s at batch 192 (the Lambda logs above):
2.3-2.7 ms per image against 4.2 ms at batch 12 here, the difference a small batch's lower GPU
utilisation. Times at batch 12 are the closer reading of a batch-8 profile, so they are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from imerge_hooks.simulate import ModelSpec

PROFILES = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class GpuTime:
    """A published per-iteration compute time (forward + backward, no communication)."""

    seconds: float
    batch_size: int
    gpu: str
    source: str


# VGG-16's per-image time over AlexNet's on one V100 (Lambda's tf_cnn_benchmarks logs, see the table).
ALEXNET_PER_VGG16 = 249.19 / 5132.32

GPU_TIMES: dict[str, GpuTime] = {
    "resnet18": GpuTime(16.69e-3, 12, "Titan V (GV100)",
                        "ryujaehun/pytorch-gpu-benchmark README, row \"Training, TITAN V, single\""),
    "resnet50": GpuTime(50.54e-3, 12, "Titan V (GV100)",
                        "ryujaehun/pytorch-gpu-benchmark README, row \"Training, TITAN V, single\""),
    "vgg16": GpuTime(72.85e-3, 12, "Titan V (GV100)",
                     "ryujaehun/pytorch-gpu-benchmark README, row \"Training, TITAN V, single\""),
    "alexnet": GpuTime(72.85e-3 * ALEXNET_PER_VGG16, 12, "Titan V (GV100), derived",
                       "VGG-16's Titan V time x AlexNet/VGG-16 per-image time on a V100 (Lambda "
                       "tf_cnn_benchmarks logs, 249.19 / 5132.32 images/s)"),
}
MEASURED = ("alexnet", "resnet18", "resnet50", "vgg16")


def profile_path(model: str) -> Path:
    return PROFILES / f"{model}-cpu.json"


def compute_s(spec: ModelSpec) -> float:
    """The profile's compute per iteration: every layer's forward and backward."""
    return sum(layer.forward_s + layer.backward_s for layer in spec.layers)


def gpu_seconds(model: str, batch_size: int) -> float:
    """The published GPU time of ``model`` at ``batch_size``, scaled per sample from its own batch."""
    ref = GPU_TIMES[model]
    return ref.seconds * batch_size / ref.batch_size


def _measured_scale(model: str, spec: ModelSpec | None = None) -> float:
    spec = spec if spec is not None else ModelSpec.from_profile_json(profile_path(model))
    return gpu_seconds(model, spec.batch_size) / compute_s(spec)


def time_scale(model: str, spec: ModelSpec | None = None) -> float:
    """``ClusterSpec.time_scale`` that replays ``model``'s profile (``spec``: default, the
    ``benchmarks/profiles`` one) at the published GPU speed; ``synthetic`` (or any model without a
    published time) gets the geometric mean of the measured models' scales (see the module doc)."""
    if model in GPU_TIMES:
        return _measured_scale(model, spec)
    scales = [_measured_scale(m) for m in MEASURED]
    return math.exp(sum(math.log(s) for s in scales) / len(scales))


def gpu_model(model: str, spec: ModelSpec | None = None) -> ModelSpec:
    """``model``'s profile with every layer's times multiplied by :func:`time_scale`."""
    spec = spec if spec is not None else ModelSpec.from_profile_json(profile_path(model))
    scale = time_scale(model, spec)
    layers = [dataclasses.replace(layer, forward_s=layer.forward_s * scale, backward_s=layer.backward_s * scale)
              for layer in spec.layers]
    return ModelSpec(layers=layers, batch_size=spec.batch_size, name=spec.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    args = ap.parse_args()
    rows = []
    for model in (*MEASURED, "synthetic"):
        spec = ModelSpec.from_profile_json(profile_path(model))
        scale = time_scale(model, spec)
        rows.append({"model": model, "batch_size": spec.batch_size, "cpu_compute_s": compute_s(spec),
                     "gpu_compute_s": compute_s(spec) * scale, "time_scale": scale,
                     "source": GPU_TIMES[model].source if model in GPU_TIMES else "assumed: geometric mean scale"})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| model | batch | CPU compute s | GPU compute ms | time_scale | source |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch_size']} | {r['cpu_compute_s']:.3f} | {r['gpu_compute_s'] * 1e3:.2f} "
              f"| {r['time_scale']:.5f} | {r['source']} |")


if __name__ == "__main__":
    main()
