"""``apex.contrib.gpu_direct_storage``: ``GDSFile``, tensors saved to and loaded from files with GPUDirect
Storage (cuFile: storage <-> GPU memory without a bounce through host memory).

Apex compiles its own cuFile binding; culmen uses PyTorch's, ``torch.cuda.gds.GdsFile``. Differences:

* Where cuFile cannot be used (no CUDA, a torch built without GDS, no ``libcufile`` / ``nvidia-fs``, a
  filesystem without ``O_DIRECT`` such as tmpfs, or a CPU tensor), modes ``"r"`` / ``"w"`` fall back to
  ordinary reads and writes through host memory, so the same script runs everywhere (Apex raises).
  ``GDSFile.uses_gds`` tells which path an open file took.
* Mode ``"w"`` truncates the file (Apex's leaves bytes past the tensor in place when it overwrites a
  longer file).
* Loading checks that the file holds at least ``tensor.nbytes`` bytes (a short file is a ``ValueError``,
  not a silently partial tensor); tensors must be contiguous.

Modes (Apex's): ``"r"`` / ``"w"`` read / write with GDS (``load_data`` / ``save_data``); ``"rn"`` / ``"wn"``
read / write without it (``load_data_no_gds`` / ``save_data_no_gds``, through host memory, as Apex's
benchmark baseline). A file holds one tensor's bytes at offset 0, no header: the reader supplies a tensor
of the right shape and dtype.
"""

from __future__ import annotations

import os
from types import TracebackType

import torch
from torch import Tensor

__all__ = ["GDSFile"]

_MODES = {"r": os.O_RDONLY, "w": os.O_CREAT | os.O_WRONLY | os.O_TRUNC,
          "rn": os.O_RDONLY, "wn": os.O_CREAT | os.O_WRONLY | os.O_TRUNC}


def _gds_file(filename: str, flags: int):
    """torch's cuFile handle for ``filename``, or ``None`` where GPUDirect Storage is not usable."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.cuda.gds import GdsFile

        return GdsFile(filename, flags)
    except (ImportError, OSError, RuntimeError, AttributeError):
        return None


def _bytes(t: Tensor) -> Tensor:
    """``t``'s bytes as a flat uint8 CPU tensor sharing memory with ``t`` (``t`` contiguous, on the CPU)."""
    return t.reshape(-1).view(torch.uint8)


class GDSFile:
    """A file opened for saving or loading tensors, with GPUDirect Storage where available.

    Usable as a context manager (Apex's form: ``with GDSFile(name, "w") as f: f.save_data(t)``), which
    closes the file on exit, or directly with ``close()``.

    Args:
        filename: the file's path (``str`` or ``os.PathLike``).
        mode: ``"r"`` / ``"w"`` (GDS, with the host fallback described in the module docstring) or
            ``"rn"`` / ``"wn"`` (always through host memory).
    """

    def __init__(self, filename: str | os.PathLike, mode: str) -> None:
        self.filename = ""
        self.mode = ""
        self.is_open = False
        self.uses_gds = False
        self._fd = -1
        self._gds = None
        self.open(filename, mode)

    def open(self, filename: str | os.PathLike, mode: str) -> None:
        """Open (or reopen after ``close()``) the file; the name and mode cannot change on reopening."""
        if not isinstance(filename, (str, os.PathLike)):
            raise TypeError(f"filename must be a str or os.PathLike, got {type(filename).__name__}")
        if not isinstance(mode, str) or mode not in _MODES:
            raise ValueError(f"mode must be one of 'r', 'w', 'rn', 'wn', got {mode!r}")
        filename = os.fspath(filename)
        if self.is_open:
            raise ValueError(f"file {self.filename} is already open with mode {self.mode!r}")
        if self.filename and (filename, mode) != (self.filename, self.mode):
            raise ValueError(f"this GDSFile was opened as ({self.filename!r}, {self.mode!r}); "
                             f"cannot reopen it as ({filename!r}, {mode!r})")
        flags = _MODES[mode]
        self._fd = os.open(filename, flags, 0o664)
        if mode in ("r", "w"):
            self._gds = _gds_file(filename, flags & ~os.O_TRUNC)
        self.filename, self.mode, self.is_open = filename, mode, True
        self.uses_gds = self._gds is not None

    def close(self) -> None:
        """Release the cuFile handle and close the file (a no-op when already closed)."""
        if not self.is_open:
            return
        gds, self._gds = self._gds, None
        if gds is not None:
            del gds  # torch's GdsFile deregisters its handle and closes its descriptor when collected
        os.close(self._fd)
        self._fd = -1
        self.is_open = False

    def __enter__(self) -> GDSFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _check(self, tensor: Tensor, modes: tuple[str, ...], what: str) -> None:
        if not self.is_open:
            raise ValueError(f"{what}: file {self.filename} is closed")
        if self.mode not in modes:
            raise ValueError(f"{what} needs the file opened with mode {' or '.join(map(repr, modes))}; "
                             f"{self.filename} was opened with mode {self.mode!r}")
        if not isinstance(tensor, Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError(f"tensor must be contiguous, got strides {tensor.stride()} for shape "
                             f"{tuple(tensor.shape)}")

    def _check_size(self, tensor: Tensor) -> None:
        size = os.fstat(self._fd).st_size
        if size < tensor.nbytes:
            raise ValueError(f"{self.filename} holds {size} bytes but tensor (shape {tuple(tensor.shape)}, "
                             f"{tensor.dtype}) needs {tensor.nbytes}")

    # -- GDS ------------------------------------------------------------------------------------------

    def save_data(self, tensor: Tensor) -> None:
        """Write ``tensor``'s bytes (any device, contiguous) at offset 0 of a file opened with ``"w"``."""
        self._check(tensor, ("w",), "save_data")
        if self._gds is not None and tensor.is_cuda:
            # cuFile's torch binding writes whole storages: a view is written from a compact copy.
            src = tensor if _whole_storage(tensor) else tensor.clone()
            try:
                with torch.cuda.device(tensor.device):
                    self._gds.save_storage(src.untyped_storage(), offset=0)
                return
            except RuntimeError:  # cuFile refused (driver or filesystem): host path from now on
                self._drop_gds()
        self._write_host(tensor)

    def load_data(self, tensor: Tensor) -> None:
        """Fill ``tensor`` (any device, contiguous) with the first ``tensor.nbytes`` bytes of a ``"r"`` file."""
        self._check(tensor, ("r",), "load_data")
        self._check_size(tensor)
        if self._gds is not None and tensor.is_cuda:
            try:
                with torch.cuda.device(tensor.device):
                    if _whole_storage(tensor):
                        self._gds.load_storage(tensor.untyped_storage(), offset=0)
                    else:  # cuFile reads whole storages: read into a fresh one, then copy into the view
                        tmp = torch.empty_like(tensor)
                        self._gds.load_storage(tmp.untyped_storage(), offset=0)
                        tensor.copy_(tmp)
                return
            except RuntimeError:  # cuFile refused (driver or filesystem): host path from now on
                self._drop_gds()
        self._read_host(tensor)

    def _drop_gds(self) -> None:
        self._gds = None
        self.uses_gds = False

    # -- through host memory --------------------------------------------------------------------------

    def save_data_no_gds(self, tensor: Tensor) -> None:
        """Write ``tensor``'s bytes through host memory (file opened with ``"wn"``)."""
        self._check(tensor, ("wn",), "save_data_no_gds")
        self._write_host(tensor)

    def load_data_no_gds(self, tensor: Tensor) -> None:
        """Fill ``tensor`` through host memory from a file opened with ``"rn"``."""
        self._check(tensor, ("rn",), "load_data_no_gds")
        self._check_size(tensor)
        self._read_host(tensor)

    def _write_host(self, tensor: Tensor) -> None:
        data = _bytes(tensor.detach().cpu()).numpy()
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], done)

    def _read_host(self, tensor: Tensor) -> None:
        on_cpu = tensor.device.type == "cpu"
        host = tensor.detach() if on_cpu else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                           pin_memory=torch.cuda.is_available())
        view = memoryview(_bytes(host).numpy())
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], done)
            if n == 0:
                raise ValueError(f"{self.filename} ended after {done} of {len(view)} bytes")
            done += n
        if not on_cpu:
            tensor.copy_(host)


def _whole_storage(t: Tensor) -> bool:
    """Whether ``t`` covers its whole storage (cuFile's torch binding reads and writes whole storages)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
