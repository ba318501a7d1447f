"""DiskTransport: write each version as safetensors under the run directory, engines reload it.

Layout: <root>/v<version>/model-00001.safetensors ... (one file per bucket), plus config and
tokenizer files copied from `template_dir` when given (a real SGLang server reloads a full HF
directory). A version directory is written under a temporary name and renamed when complete, so an
engine never reads a half-written version; the previous version is deleted after a successful push.

FP8 engines (`quantization` fp8_block / fp8_row) receive the FP8 contract's pairs as they are: the
float8_e4m3fn weight (safetensors dtype F8_E4M3) and its float32 `weight_scale_inv`, and the copied
config.json gets the `quantization_config` of an FP8 checkpoint in the SGLang/DeepSeek layout
(`weight_block_size: [128, 128]` for fp8_block, none for row-wise), so the directory is a loadable
FP8 checkpoint. Packed engines (a Scheme: int4, mxfp8, nvfp4) likewise get the format's parts and its
`quantization_config` (compressed-tensors pack-quantized for int4).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from miles.quant.formats import Scheme, engine_contract
from miles.quant.fp8 import LAYOUTS, quantization_config
from miles.weights.transport import Bucket, EngineAdmin, Site, check_pause_mode, pause_mode_of

_TEMPLATE_SUFFIXES = (".json", ".txt", ".model", ".jinja")


class DiskTransport:
    """Safetensors on a shared filesystem + /update_weights_from_disk on every engine."""

    checks_in_push = False

    def __init__(
        self,
        engines: Sequence[EngineAdmin],
        root: str | Path,
        *,
        template_dir: str | Path | None = None,
        pause_mode: str | None = "in_place",
        quantization: str | Scheme | None = None,
    ):
        check_pause_mode(pause_mode)
        if not (quantization is None or isinstance(quantization, Scheme) or quantization in LAYOUTS):
            raise ValueError(
                f"unknown quantization {quantization!r}; known: {', '.join(LAYOUTS)}, a packed Scheme or None"
            )
        self.quantization = quantization
        self.engines = list(engines)
        self.root = Path(root)
        self.template_dir = Path(template_dir) if template_dir else None
        self.pause_mode = pause_mode
        self.current: Path | None = None

    @classmethod
    def from_plan(cls, plan: Any, site: Site) -> DiskTransport:
        """Versions under RUN_DIR/weights, in the engines' weight contract, beside the model's files."""
        return cls(
            site.engines,
            site.run_dir / "weights",
            template_dir=plan.model.path,
            pause_mode=pause_mode_of(plan),
            quantization=engine_contract(plan),
        )

    async def setup(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def write(self, buckets: Iterable[Bucket], version: str) -> Path:
        """Write one version directory atomically; returns its final path."""
        final = self.root / f"v{version}"
        tmp = self.root / f".v{version}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.template_dir is not None:
            for f in self.template_dir.iterdir():
                if (
                    f.is_file()
                    and f.suffix in _TEMPLATE_SUFFIXES
                    and f.name != "model.safetensors.index.json"
                ):
                    shutil.copy2(f, tmp / f.name)
            if self.quantization is not None and (tmp / "config.json").exists():
                _mark_quantized(tmp / "config.json", self.quantization)
        for i, bucket in enumerate(buckets):
            tensors = {name: t.detach().to("cpu").contiguous() for name, t in bucket}
            save_file(tensors, str(tmp / f"model-{i + 1:05d}.safetensors"))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    async def push(self, buckets: Iterable[Bucket], version: str) -> None:
        path = await asyncio.to_thread(self.write, buckets, str(version))
        if self.pause_mode:
            await asyncio.gather(*(e.pause_generation(self.pause_mode) for e in self.engines))
        try:
            await asyncio.gather(
                *(e.update_weights_from_disk(str(path), weight_version=str(version)) for e in self.engines)
            )
        finally:
            if self.pause_mode:
                await asyncio.gather(*(e.continue_generation() for e in self.engines))
        if self.current is not None and self.current != path:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = path

    async def close(self) -> None:
        return None


def _mark_quantized(path: Path, contract: str | Scheme) -> None:
    config = json.loads(path.read_text())
    config["quantization_config"] = (
        contract.quantization_config() if isinstance(contract, Scheme) else quantization_config(contract)  # type: ignore[arg-type]
    )
    path.write_text(json.dumps(config, indent=2))
