"""What this machine computes fast: the compute dtype for ``dtype="auto"`` and the torch thread count.

bfloat16 is chosen only where the hardware has native bf16 arithmetic (x86 AVX512-BF16 or AMX, CUDA
devices that report bf16 support): elsewhere torch emulates it and it is slower than float32.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
THREADS_ENV = "SPECCACHE_THREADS"


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` computes bfloat16 natively (and so faster than float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)
    return False


def resolve_dtype(dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto"`` → bfloat16 where ``device`` computes it natively, else float32; names and dtypes pass through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto or one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype | str) -> str:
    """torch.bfloat16 → "bfloat16" (what vLLM's ``dtype=`` and the stats record)."""
    return str(resolve_dtype(dtype)).removeprefix("torch.")


def default_device() -> torch.device:
    """CUDA where there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device: str | torch.device | None) -> torch.device:
    """``device`` (None: ``default_device()``), refused with a clear error where this machine has no such device."""
    device = default_device() if device is None else torch.device(device)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"device {device} is not available here: {count} CUDA device(s) "
                             f"(torch {torch.__version__}{'' if torch.version.cuda else ', a CPU build'})")
    elif device.type not in ("cpu", "meta"):
        raise ValueError(f"unsupported device {device}: cpu or cuda[:N]")
    return device


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads: ``threads``, else $SPECCACHE_THREADS, else $OMP_NUM_THREADS, else the
    usable cores. Returns the number set."""
    if threads is None:
        for var in (THREADS_ENV, "OMP_NUM_THREADS"):
            value = os.environ.get(var, "").strip()
            if value:
                try:
                    threads = int(value)
                except ValueError:
                    raise ValueError(f"${var} must be a positive integer, got {value!r}") from None
                break
    threads = usable_cores() if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
