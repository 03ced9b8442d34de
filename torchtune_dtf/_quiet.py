"""Silence messages that this project's commands print and that tell its users nothing.

Each filter names one exact message of the pinned dependency set (README, "Install") and why it is harmless;
everything else those libraries log or warn still shows. They are installed once, when ``torchtune_dtf`` is
imported, which is also why one of them cannot always act:

* torchao 0.14.1 logs "Skipping import of cpp extensions due to incompatible torch version …" when it is
  imported next to torch 2.13 (its C++ kernels serve quantization, which nothing here uses). The filter
  catches it when ``torchtune_dtf`` is imported before torchtune (``python -m torchtune_dtf.…``, the tests).
  ``tune run`` imports torchtune, and with it torchao, before it loads any recipe or config, so under
  ``tune run`` the line is printed before any code of this package runs; only a change to the environment
  (a ``.pth`` start-up hook) could reach it, and that would silence it for every program in the environment.
* torchdata's ``StatefulDataLoader`` (the recipe's data loader) calls ``torch.set_vital``, which torch 2.13
  deprecates: a ``UserWarning`` about torchdata's own code on every training run.
* lm-eval 0.4.9.1's ``HFLM`` passes ``torch_dtype=`` when torchtune's stock eval wrapper makes it load the
  ``gpt2`` stand-in (:mod:`torchtune_dtf.offline.lm_eval_standin`, thrown away right after); transformers 4.57
  answers with "`torch_dtype` is deprecated! Use `dtype` instead!".
"""

import logging
import warnings
from typing import Tuple

#: (logger name, start of the message) of each log record that is dropped.
DROPPED_LOG_MESSAGES: Tuple[Tuple[str, str], ...] = (
    ("torchao", "Skipping import of cpp extensions due to incompatible torch version"),
    ("transformers.configuration_utils", "`torch_dtype` is deprecated! Use `dtype` instead!"),
)


class DropMessages(logging.Filter):
    """A logging filter that drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


_logging_installed = False


def install() -> None:
    """Install the filters (idempotent)."""
    global _logging_installed
    if not _logging_installed:
        for name, prefix in DROPPED_LOG_MESSAGES:
            # A filter on the logger itself sees exactly the records logged there (these are module loggers that
            # log under their own name), not those of other libraries propagating through it.
            logging.getLogger(name).addFilter(DropMessages(prefix))
        _logging_installed = True
    # Re-added on every call (Python keeps one copy of an identical filter): code that runs inside
    # warnings.catch_warnings() (pytest's collection, for one) drops filters added there when it leaves.
    warnings.filterwarnings(
        "ignore", message="'set_vital' is deprecated", category=UserWarning, module=r"torchdata\.stateful_dataloader"
    )
