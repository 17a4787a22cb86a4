"""Global settings: ``gpuc.settings.device`` and the progress-bar switch."""

from __future__ import annotations

from dataclasses import dataclass

from gpuc._backend import DEVICES, Device


@dataclass
class _Settings:
    """Package-wide defaults.

    Attributes
    ----------
    device
        Default for every ``device=None`` argument: ``"auto"`` (GPU if usable, else CPU), ``"cpu"`` or ``"gpu"``.
    progress
        Show tqdm progress bars for long computations. Bars show only when this is True, Scanpy's verbosity is
        at its default (``warning``) or above, and the output is a terminal or a notebook; set it to False (or
        ``sc.settings.verbosity = 0``) to hide them.
    numba
        Run the CPU engines' numba-compiled kernels (default). ``False`` runs their array code instead, the code
        the GPU runs, on the CPU: slower, with the same results up to floating-point rounding. This is the one
        switch the tests use to compare the two.
    """

    _device: Device = "auto"
    progress: bool = True
    numba: bool = True

    @property
    def device(self) -> Device:
        """Default device: ``"auto"``, ``"cpu"`` or ``"gpu"``."""
        return self._device

    @device.setter
    def device(self, value: Device) -> None:
        if value not in DEVICES:
            msg = f"gpuc.settings.device must be one of {DEVICES}, got {value!r}."
            raise ValueError(msg)
        self._device = value

    def __repr__(self) -> str:
        return f"gpuc.settings(device={self._device!r}, progress={self.progress}, numba={self.numba})"


settings = _Settings()
