"""The admin API's endpoints, one module per concern, found at start-up: a module adds endpoints by
adding a file here.

Every module exposes ``routes(backend) -> fastapi.APIRouter`` and declares, as a ``typing.Protocol``
of its own, exactly what it calls on the server (``kvdepot.admin.backend.AdminBackend`` is their union).
Modules whose name starts with ``_`` are helpers, not routes.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from fastapi import APIRouter


def route_modules() -> list[ModuleType]:
    """Every route module of this package, by name (so the order of the OpenAPI document is stable)."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if not callable(getattr(module, "routes", None)):
            raise TypeError(f"{module.__name__} has no routes(backend) -> APIRouter")
        found.append(module)
    return found


def routers(backend: object) -> list[APIRouter]:
    return [module.routes(backend) for module in route_modules()]
