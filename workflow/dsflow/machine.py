"""What this machine has: its GPUs, and which device and how many ranks a run gets on it."""

from __future__ import annotations

from dsflow.errors import UsageError


def resolve_device(train: dict) -> tuple[str, int]:
    """(device type, ranks per node); asking for GPUs that do not exist is an error."""
    import torch

    want, gpus = train["device"], train["gpus"]
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and visible == 0:
        raise UsageError(
            "train.device: cuda, but no CUDA GPU is visible (check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES, or set train.device: cpu)"
        )
    device = "cuda" if want == "cuda" or (want == "auto" and visible > 0) else "cpu"
    if gpus == "auto":
        return device, (visible if device == "cuda" else 1)
    if device == "cuda" and gpus > visible:
        raise UsageError(
            f"train.gpus: {gpus} GPUs requested but {visible} visible; set train.gpus: {visible} "
            "(or auto), and adjust grad_accum to keep the global batch"
        )
    return device, gpus
