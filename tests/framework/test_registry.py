import ast
from pathlib import Path

import pytest

from framework.core.registry import MOE, PARALLELISM, ROUTING, WORKLOAD, Registry, RegistryError

ROOT = Path(__file__).resolve().parents[2]


def test_register_get_and_build():
    reg = Registry("thing")

    @reg.register("a")
    class A:
        def __init__(self, x):
            self.x = x

    assert reg.get("a") is A
    assert reg.build("a", 3).x == 3
    assert "a" in reg and reg.keys() == ["a"]


def test_unknown_key_lists_known_keys():
    reg = Registry("thing")
    reg.register("alpha")(type("Alpha", (), {}))
    reg.register("beta")(type("Beta", (), {}))
    with pytest.raises(RegistryError, match=r"unknown thing plugin 'gamma'; known: alpha, beta"):
        reg.get("gamma")


def test_same_key_twice_by_different_objects_fails():
    reg = Registry("thing")

    class One: ...

    class Two: ...

    reg.register("k")(One)
    reg.register("k")(One)          # the same object again is fine (re-import)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("k")(Two)


def test_builtins_load_lazily_by_name():
    assert "reference" in MOE.keys() and "tp" in PARALLELISM.keys()
    assert MOE.get("reference").__module__ == "plugins.moe.reference"
    assert WORKLOAD.get("multi_turn").__name__ == "MultiTurn"
    assert "round_robin" in ROUTING.keys()


def test_entry_point_plugins_register(tmp_path, monkeypatch):
    """A third-party package (a real dist-info on sys.path) registers through `servelab.plugins` before a lookup
    misses, and its key is listed among the known ones."""
    import framework.core.registry as registry

    pkg = tmp_path / "servelab_thirdparty"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from framework.core.registry import MOE\n\n"
        "class ThirdParty:\n    pass\n\n"
        "def register():\n    MOE.register('third_party')(ThirdParty)\n")
    dist = tmp_path / "servelab_thirdparty-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: servelab-thirdparty\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[servelab.plugins]\nthirdparty = servelab_thirdparty:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        assert registry.MOE.get("third_party").__name__ == "ThirdParty"
        assert "third_party" in registry.MOE.keys()
    finally:
        registry.MOE._items.pop("third_party", None)
        monkeypatch.setattr(registry, "_entry_points_loaded", False)


def test_framework_imports_no_plugin_module():
    """framework/ meets plugins only through the registry: no `import plugins...` anywhere in it."""
    offenders = []
    for path in (ROOT / "framework").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "plugins" or n.startswith("plugins.")]
    assert not offenders, offenders


def test_a_plugin_cannot_take_a_built_in_key():
    """An out-of-tree class registered under a built-in's key would replace it silently in every lookup."""
    from framework.core.registry import PARALLELISM, RegistryError

    class Impostor:
        pass
    with pytest.raises(RegistryError, match="'tp' is a built-in's key"):
        PARALLELISM.register("tp")(Impostor)
    assert PARALLELISM.get("tp").__module__ == "plugins.parallelism.tp"
