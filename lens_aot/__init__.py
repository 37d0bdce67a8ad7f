"""lens_aot: turn a TransformerLens model's MLP neurons into attention heads (Huben & Morris 2023).

>>> import lens_aot
>>> aot = lens_aot.convert(model)          # HookedTransformer (TL 3.x) or TransformerBridge (TL 3.9 / 4.x)
>>> logits, cache = aot.run_with_cache(tokens)
>>> ref = aot.neuron_heads(layer, neuron)[0]
>>> cache[f"{ref.name}.hook_pattern"][:, ref.head]   # that neuron's attention pattern
"""

import sys as _sys

from lens_aot import circuits, viz  # analysis tools: lens_aot.patching.patch_heads, …
from lens_aot.activations import ActivationFit, activation_fit
from lens_aot.analysis import patching
from lens_aot.convert import ConversionReport, convert
from lens_aot.errors import (
    AlreadyConvertedError,
    FaithfulnessError,
    InputError,
    InvalidWeightsError,
    LensAOTError,
    LoadError,
    UnsupportedActivationError,
    UnsupportedArchitectureError,
)
from lens_aot.io import load, save
from lens_aot.model import AOTConfig, AttentionOnlyTransformer, HeadOrigin, HeadRef
from lens_aot.revert import revert

# lens_aot.patching (and the former lens_aot.attribution / attribution_check, whose names it re-exports) is the
# analysis package lens_aot.analysis.patching: `import lens_aot.patching` and `from lens_aot.patching import X` work.
attribution = attribution_check = patching
for _old in ("patching", "attribution", "attribution_check"):
    _sys.modules[f"{__name__}.{_old}"] = patching
del _old

__version__ = "0.1.0"

__all__ = [
    "AOTConfig",
    "ActivationFit",
    "AlreadyConvertedError",
    "AttentionOnlyTransformer",
    "ConversionReport",
    "FaithfulnessError",
    "HeadOrigin",
    "HeadRef",
    "InputError",
    "InvalidWeightsError",
    "LensAOTError",
    "LoadError",
    "UnsupportedActivationError",
    "UnsupportedArchitectureError",
    "activation_fit",
    "circuits",
    "convert",
    "load",
    "patching",
    "revert",
    "save",
    "viz",
]
