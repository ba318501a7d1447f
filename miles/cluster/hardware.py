"""Which GPUs does this node see? NVML (nvidia-ml-py) and amdsmi, each allowed to be absent or broken.

`import pynvml` works without a driver and `nvmlInit()` then raises; `import amdsmi` raises KeyError
(not ImportError) when the ROCm library is missing and prints to stdout while doing so. Every probe
therefore catches everything and reports why it found nothing, and `detect_profile` matches what was
found against each profile's `detect` rule.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

from miles.config.profile import known_profiles, load_profile


@dataclass(frozen=True)
class GpuInfo:
    """What one probe saw."""

    vendor: str
    names: tuple[str, ...]
    gfx: tuple[str, ...] = ()


def probe_nvidia() -> tuple[GpuInfo | None, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # absent library or driver: a normal case on CPU and AMD nodes
        return None, f"NVML unavailable ({type(e).__name__})"
    try:
        count = pynvml.nvmlDeviceGetCount()
        names = tuple(
            str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)
        )
    finally:
        pynvml.nvmlShutdown()
    return (GpuInfo("nvidia", names), f"NVML: {count} GPU(s)") if names else (None, "NVML: no GPUs")


def probe_amd() -> tuple[GpuInfo | None, str]:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import amdsmi

            amdsmi.amdsmi_init()
    except BaseException as e:  # KeyError without ROCm, ImportError without the package
        if isinstance(e, KeyboardInterrupt):
            raise
        return None, f"amdsmi unavailable ({type(e).__name__})"
    try:
        handles = amdsmi.amdsmi_get_processor_handles()
        names, gfx = [], []
        for h in handles:
            asic = amdsmi.amdsmi_get_gpu_asic_info(h)
            names.append(str(asic.get("market_name", "")))
            gfx.append(str(asic.get("target_graphics_version", "")))
    finally:
        amdsmi.amdsmi_shut_down()
    return (
        (GpuInfo("amd", tuple(names), tuple(gfx)), f"amdsmi: {len(names)} GPU(s)")
        if names
        else (None, "amdsmi: no GPUs")
    )


def match_profile(info: GpuInfo) -> str | None:
    """The first shipped profile whose detect rule matches the GPUs seen."""
    for name in known_profiles():
        rule = load_profile(name).detect
        if any(s.lower() in n.lower() for s in rule.name_contains for n in info.names):
            return name
        if any(g in info.gfx for g in rule.gfx):
            return name
    return None


def detect_profile() -> tuple[str | None, str]:
    """(profile name or None, the reason), trying NVML then amdsmi."""
    reasons = []
    for probe in (probe_nvidia, probe_amd):
        info, why = probe()
        reasons.append(why)
        if info is not None:
            name = match_profile(info)
            seen = ", ".join(sorted(set(info.names)))
            return name, f"{why} [{seen}]" + ("" if name else "; no profile matches: add a detect rule")
    return None, "; ".join(reasons) + " -> no GPUs seen (use --profile local for the CPU dev cluster)"
