"""Third-party output kept off the terminal unless asked for (``shifu --verbose``): what shifu prints is its own.

Without ``--verbose`` (or ``SHIFU_VERBOSE=1``) the command line calls :func:`configure` before any library is
imported, and then

- transformers' and huggingface_hub's progress bars ("Loading weights", "Writing model shards") are off,
  whatever ``progress`` says (that key is shifu's own bar), and so is every other library's plain ``tqdm`` bar
  (the GGUF converter's "Converting and de-quantizing GGUF tensors"): tqdm is imported with ``TQDM_DISABLE=1``,
  which makes ``disable`` default to true in this process (:func:`hide_library_bars`), and shifu's own bars
  (:func:`shifu.runs.tracking.progress`) pass it explicitly;
- transformers' and datasets' loggers show errors only (their warnings and load reports are not shown);
- Python warnings raised inside transformers, huggingface_hub, datasets, accelerate, peft and deepspeed
  (deprecations, "Setting fan_in_fan_out to True", ...) are ignored: those the warning machinery attributes to
  one of these libraries (a filter), and those raised by their code but attributed to the caller with
  ``stacklevel=2`` (a transformers ``FutureWarning`` about an argument): :func:`showwarning` looks at the frame
  that called ``warnings.warn``.

Environment variables the user set (``TRANSFORMERS_VERBOSITY``, ``HF_HUB_DISABLE_PROGRESS_BARS``, ...) win.

Independently of ``--verbose``, :func:`import_deepspeed_on_use` keeps DeepSpeed unimported in a run that does
not use it: ``transformers``' ``save_pretrained`` unwraps the model through ``accelerate``, which imports
DeepSpeed whenever it is installed, only to test ``isinstance(model, DeepSpeedEngine)``; the import costs
seconds and prints "Setting accelerator to CPU". A model can only be a ``DeepSpeedEngine`` once DeepSpeed was
imported (``shifu.parallel.deepspeed`` does that for ``distributed.strategy=deepspeed``), so the test is skipped while
it is not.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import os
import sys
import warnings
from collections.abc import Iterator

from shifu.errors import VERBOSE_ENV, verbose

# the libraries whose warnings are hidden (Python `warnings` issued from inside them)
LIBRARIES = ("transformers", "huggingface_hub", "datasets", "accelerate", "peft", "deepspeed")
# read by those libraries when they are imported
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DATASETS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def verbose_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """(whether ``--verbose`` is among ``argv`` before any ``--``, or ``SHIFU_VERBOSE`` is set; ``argv``
    without the flag). Any command takes the flag, anywhere among its arguments."""
    end = argv.index("--") if "--" in argv else len(argv)
    rest = [a for a in argv[:end] if a != "--verbose"] + argv[end:]
    return verbose() or len(rest) < len(argv), rest


@contextlib.contextmanager
def verbose_while(on: bool) -> Iterator[None]:
    """``SHIFU_VERBOSE=1`` while a command runs with ``--verbose`` (read by :func:`shifu.errors.verbose` and by
    the processes it starts), as it was before afterwards."""
    old = os.environ.get(VERBOSE_ENV)
    if on:
        os.environ[VERBOSE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(VERBOSE_ENV, None)
        else:
            os.environ[VERBOSE_ENV] = old


def configure(verbose: bool) -> None:
    """Silence third-party progress bars, logging and warnings unless ``verbose`` (see the module docstring).
    Call it before the libraries are imported; the ones already imported are switched too."""
    if verbose:
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    warnings.filterwarnings("ignore", module=rf"({'|'.join(LIBRARIES)})(\.|$)")
    hide_library_warnings()
    hide_library_bars()
    if "transformers" in sys.modules:  # imported before this call (e.g. by a caller in the same process)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "datasets" in sys.modules:
        import datasets

        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()


def raised_by_library(frame) -> bool:
    """Whether the code that called ``warnings.warn`` (the first frame outside the ``warnings`` module, from
    ``frame`` outwards) belongs to one of :data:`LIBRARIES`."""
    while frame is not None and frame.f_globals.get("__name__") in ("warnings", __name__):
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.split(".", 1)[0] in LIBRARIES


def hide_library_warnings() -> None:
    """Wrap ``warnings.showwarning`` so that a warning raised by the code of one of :data:`LIBRARIES` is not
    shown, whichever module it is attributed to (``stacklevel``). Idempotent."""
    shown = warnings.showwarning
    if getattr(shown, "shifu_quiet", False):
        return

    @functools.wraps(shown)
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not raised_by_library(sys._getframe(1)):
            shown(message, category, filename, lineno, file, line)

    showwarning.shifu_quiet = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


def hide_library_bars() -> None:
    """Import tqdm with ``TQDM_DISABLE=1``: tqdm reads its ``TQDM_*`` variables once, at import, as the
    defaults of its bars, so a bar that does not pass ``disable`` stays off in this process; the variable is
    removed again (child processes and the user's own programs do not inherit it). Nothing changes when the
    user set ``TQDM_DISABLE`` or tqdm was imported already."""
    if "tqdm" in sys.modules or "TQDM_DISABLE" in os.environ:
        return
    os.environ["TQDM_DISABLE"] = "1"
    try:
        import tqdm.auto  # noqa: F401  (tqdm.std's class, read by every tqdm front end)
    finally:
        del os.environ["TQDM_DISABLE"]


def import_deepspeed_on_use() -> None:
    """Make ``accelerate``'s model unwrapping test for a DeepSpeed engine only once DeepSpeed is imported
    (see the module docstring): now if accelerate is imported, else as soon as it is. Idempotent; imports
    nothing."""
    module = sys.modules.get(_UNWRAP_MODULE)
    if module is not None:
        _on_use(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


# where extract_model_from_parallel does `if is_deepspeed_available(): from deepspeed import ...`
_UNWRAP_MODULE = "accelerate.utils.other"


def _on_use(module) -> None:
    original = module.is_deepspeed_available
    if getattr(original, "shifu_on_use", False):
        return

    @functools.wraps(original)
    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and original()

    is_deepspeed_available.shifu_on_use = True  # type: ignore[attr-defined]
    module.is_deepspeed_available = is_deepspeed_available


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``accelerate.utils.other`` is about to be imported, it lets the other
    finders locate it and runs :func:`_on_use` on the module right after the module's own code."""

    def find_spec(self, name, path, target=None):
        if name != _UNWRAP_MODULE:
            return None
        sys.meta_path.remove(self)  # once: the finders below locate the real module
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module  # (a loader object of this one module: changing it is local)

        def exec_module(module) -> None:
            run(module)
            _on_use(module)

        spec.loader.exec_module = exec_module
        return spec


class _Tolerant:
    """A console stream whose reader may go away (``shifu ... 2>&1 | tee log`` and Ctrl-C kills tee too):
    once a write or flush fails with a closed pipe, further output is dropped instead of raising inside a
    training step, so a stop signal still ends in a checkpoint."""

    def __init__(self, stream) -> None:
        self._stream, self.closed_pipe = stream, False

    def write(self, text: str) -> int:
        if not self.closed_pipe:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ConnectionResetError, ValueError):  # ValueError: the file was closed
                self.closed_pipe = True
        return len(text)

    def flush(self) -> None:
        if not self.closed_pipe:
            try:
                self._stream.flush()
            except (BrokenPipeError, ConnectionResetError, ValueError):
                self.closed_pipe = True

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def tolerate_closed_console() -> None:
    """Keep shifu running when whatever reads its stdout/stderr exits (see :class:`_Tolerant`)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Tolerant):
            setattr(sys, name, _Tolerant(stream))
