"""fxmem: a torch.compile backend that cuts the memory of training steps without changing results.

    torch.compile(model, backend="fxmem", options={...})
"""

from .backend import fxmem_backend, register
from .options import Options, Rule, resolve
from .report import MemoryReport, explain, report

__version__ = "0.1.0"
__all__ = ["MemoryReport", "Options", "Rule", "explain", "fxmem_backend", "report", "resolve", "__version__"]

register()
