"""One small registry per plugin kind.

Built-in plugins are imported lazily by name (``plugins.<kind>.<key>``; subpackages such as ``lib/`` hold what
plugins of a kind share and are not plugins), so ``framework/`` never imports a plugin
module by name; third-party packages register through the ``servelab.plugins`` entry-point group, whose target is a
re-entrant ``register()`` callable run once per process before the first lookup.
"""
from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points
from typing import Any, Callable, Generic, TypeVar

from framework.core.errors import UserError

T = TypeVar("T")
ENTRY_POINT_GROUP = "servelab.plugins"
_entry_points_loaded = False


class RegistryError(UserError, KeyError):
    """An unknown or clashing plugin key: a UserError (one sentence) that callers may still catch as a KeyError."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def load_entry_points() -> None:
    """Run every third-party ``register()`` once per process."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()()


class Registry(Generic[T]):
    """String key -> plugin class (or factory). ``package`` is where built-ins live, one module per key."""

    def __init__(self, kind: str, package: str | None = None):
        self.kind = kind
        self.package = package
        self._items: dict[str, T] = {}

    def register(self, key: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            builtin = f"{self.package}.{key}"      # another class under a built-in's key would shadow it
            if self.package and getattr(obj, "__module__", builtin) != builtin and key in self._builtin_names():
                raise RegistryError(f"{self.kind} plugin {key!r} is a built-in's key ({builtin}); "
                                    f"{_qualname(obj)} must take another")
            old = self._items.get(key)
            if old is not None and old is not obj and _qualname(old) != _qualname(obj):
                raise RegistryError(
                    f"{self.kind} plugin {key!r} is already registered by {_qualname(old)}; "
                    f"{_qualname(obj)} cannot take the same key")
            self._items[key] = obj
            return obj
        return deco

    def get(self, key: str) -> T:
        if key not in self._items:
            self._import_builtin(key)
        if key not in self._items:
            load_entry_points()
        if key not in self._items:
            raise RegistryError(f"unknown {self.kind} plugin {key!r}; known: {', '.join(self.keys())}")
        return self._items[key]

    def keys(self) -> list[str]:
        """Every key: registered, built-in (not yet imported) and from entry points."""
        load_entry_points()
        return sorted(set(self._items) | set(self._builtin_names()))

    def build(self, key: str, *args: Any, **kwargs: Any) -> Any:
        return self.get(key)(*args, **kwargs)

    def __contains__(self, key: str) -> bool:
        return key in self.keys()

    def _builtin_names(self) -> list[str]:
        if self.package is None:
            return []
        pkg = importlib.import_module(self.package)
        return [m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_") and not m.ispkg]

    def _import_builtin(self, key: str) -> None:
        if self.package and key in self._builtin_names():
            importlib.import_module(f"{self.package}.{key}")


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


PARALLELISM: Registry = Registry("parallelism", "plugins.parallelism")
MOE: Registry = Registry("moe", "plugins.moe")
ROUTING: Registry = Registry("routing", "plugins.routing")
WORKLOAD: Registry = Registry("workload", "plugins.workload")
COST: Registry = Registry("sim cost", "plugins.cost")
