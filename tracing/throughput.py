"""Throughput figures of GPU work: achieved TFLOP/s, MFU against a device's peak, and
peak device memory per interval. The FLOPs per token come from the caller's model."""

from __future__ import annotations

from collections.abc import Callable

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendor's data sheets.
# Matched against the device name in this order: the first listed substring wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
)


def peak_tflops(device_name: str) -> float | None:
    """Peak bf16 TFLOP/s of a device named like torch.cuda.get_device_name(); None if unknown."""
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def achieved_tflops(flops_per_token: float, tokens_per_s: float) -> float:
    return flops_per_token * tokens_per_s / 1e12


def mfu(
    flops_per_token: float, tokens_per_s: float, peak: float | None, num_devices: int = 1
) -> float | None:
    """Model FLOPs utilization in [0, 1]: achieved over `num_devices` × peak TFLOP/s."""
    if peak is None or peak <= 0 or num_devices < 1:
        return None
    return achieved_tflops(flops_per_token, tokens_per_s) / (peak * num_devices)


def device_peak_tflops(device: object) -> float | None:
    """The peak of a torch device (None on CPU, or a GPU not in the table)."""
    import torch

    device = torch.device(device)  # type: ignore[arg-type]
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name(device))


def peak_memory_reader(device: object) -> Callable[[], float] | None:
    """A function returning the peak bytes allocated on `device` since its last call
    (each read starts the next interval); None where the device keeps no such figure."""
    import torch

    device = torch.device(device)  # type: ignore[arg-type]
    if device.type != "cuda" or not torch.cuda.is_available():
        return None

    def read() -> float:
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return float(peak)

    return read
