"""pdserve's version, as installed (reported by /version and in heartbeats)."""

from __future__ import annotations


def package_version() -> str:
    """The installed distribution's version; the source tree's when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "0.1.0"
