"""The floating-point dtypes lens_aot treats alike: the half-precision ones (float16, bfloat16), read and converted
through float32 (docs/faithfulness.md, "Half precision")."""

from __future__ import annotations

import torch

__all__ = ["HALF_DTYPES"]

HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
