"""fxmem: a torch.compile backend that cuts the memory of training steps without changing results.

    torch.compile(model, backend="fxmem", options={...})
"""

from .backend import fxmem_backend, register
from .compilation import Compilation, compilations
from .options import OptionError, Options, Rule, resolve
from .remat.budget import BudgetError
from .report import MemoryReport, explain, explain_layers, report
from .version import __version__

__all__ = ["BudgetError", "Compilation", "MemoryReport", "OptionError", "Options", "Rule", "compilations", "explain",
           "explain_layers",
           "fxmem_backend", "report", "resolve", "__version__"]

register()
