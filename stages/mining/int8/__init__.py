"""hpm.engine.precision int8, in one package: its quantization and proven screen (q8.py), its layout
and routing GEMMs (routing.py), its C kernels (screen_int8.c, kernels.py) and its precision
object (precision.py), registered here. Deleting this folder leaves fp32 and bf16 working:
``precision: auto`` then resolves to fp32 and ``precision: int8`` is a ConfigError."""
from ..engine.precision import register
from .precision import Int8

register(Int8())
