"""What differs between the supported laplace-torch releases (0.2.3 and 0.3)."""

from __future__ import annotations

from importlib.metadata import version


def _release(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


#: Installed laplace-torch release, e.g. ``(0, 3)`` or ``(0, 2, 3)``.
LAPLACE_VERSION: tuple[int, ...] = _release(version("laplace-torch"))
