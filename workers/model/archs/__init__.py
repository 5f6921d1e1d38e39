"""The checkpoint architectures kvrt serves, one file per family, each a reading of its
config.json into the switches of the one model definition (features.py)."""
from __future__ import annotations

from kvrt.workers.model.archs import gemma, llama, phi3, qwen
from kvrt.workers.model.archs.features import Family

FAMILIES: dict[str, Family] = {**llama.FAMILIES, **qwen.FAMILIES, **gemma.FAMILIES, **phi3.FAMILIES}
ARCHITECTURES = tuple(FAMILIES)
