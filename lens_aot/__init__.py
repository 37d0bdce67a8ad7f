"""lens_aot: turn a TransformerLens model's MLP neurons into attention heads (Huben & Morris 2023).

>>> import lens_aot
>>> aot = lens_aot.convert(model)          # HookedTransformer (TL 3.x) or TransformerBridge (TL 3.9 / 4.x)
>>> logits, cache = aot.run_with_cache(tokens)
>>> ref = aot.neuron_heads(layer, neuron)[0]
>>> cache[f"{ref.name}.hook_pattern"][:, ref.head]   # that neuron's attention pattern
"""

import sys as _sys

import lens_aot.tl  # noqa: F401  (registers the TransformerLens layer the core calls: lens_aot.core.source_layer)
from lens_aot.analysis import circuits, patching, viz  # analysis tools: lens_aot.patching.patch_heads, …
from lens_aot.constructions import standard_mask
from lens_aot.core.convert import ConversionReport, convert
from lens_aot.core.fit.activations import ActivationFit, activation_fit
from lens_aot.core.runtime.model import AOTConfig, AttentionOnlyTransformer, HeadOrigin, HeadRef
from lens_aot.core.runtime.revert import revert
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
from lens_aot.tl.build import bridge_from_hf_module
from lens_aot.version import __version__ as __version__

# Modules whose home moved keep their public import paths: `import lens_aot.patching`, `from lens_aot.circuits import
# X` (lens_aot.analysis.*), `lens_aot.standard_mask` (lens_aot.constructions.standard_mask); lens_aot.attribution and
# lens_aot.attribution_check are lens_aot.patching, which re-exports their names.
attribution = attribution_check = patching
for _name, _module in {
    "patching": patching,
    "attribution": patching,
    "attribution_check": patching,
    "circuits": circuits,
    "viz": viz,
    "standard_mask": standard_mask,
}.items():
    _sys.modules[f"{__name__}.{_name}"] = _module
del _name, _module

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
    "bridge_from_hf_module",
    "circuits",
    "convert",
    "load",
    "patching",
    "revert",
    "save",
    "viz",
]
