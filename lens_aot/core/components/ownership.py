"""Re-export of :mod:`lens_aot.core.ownership` (whether a new module copies the tensors it is built from), at the path
the components import it from."""

from lens_aot.core.ownership import (
    Field,
    adopting,
    borrowing,
    exported,
    exported_fields,
    one_table_per_model,
    own_parameters,
    parameter,
    shared,
    sharing,
    sharing_now,
    table,
    through_hook,
)

__all__ = [
    "Field",
    "adopting",
    "borrowing",
    "exported",
    "exported_fields",
    "one_table_per_model",
    "own_parameters",
    "parameter",
    "shared",
    "sharing",
    "sharing_now",
    "table",
    "through_hook",
]
