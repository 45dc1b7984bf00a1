"""The layer map of docs/architecture.md, enforced on every import the code makes (in-function imports included):

- a framework module imports framework modules of its own layer or lower ones, and no plugin or kernel;
- a plugin imports framework's lower layers only (core, the L1 helpers, contracts) and its own kind's modules:
  plugins meet only through the registry;
- kernels import nothing from framework/ or plugins/;
- experiments and tests import no `_private` name (module or member) of another package;
- no import cycles between modules.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS = {
    "framework.core": 0,
    "framework.model": 1, "framework.dist": 1, "framework.kv_events": 1, "framework.gpu": 1,
    "framework.contracts": 2,
    "framework.engine": 3,
    "framework.instance": 4, "framework.routing": 4, "framework.load": 4,
    "framework.serving": 5, "framework.sim": 5,
    "framework.cluster": 6, "framework.runs": 6, "framework.report": 6, "framework.testing": 6,
    "framework.app": 7, "framework.config": 7, "framework.multirun": 7, "framework.overrides": 7,
    "framework.runlog": 7,
}
PLUGIN_MAX_LAYER = 2
ALLOWED: set[str] = set()          # "importer -> imported" pairs still to mend; empty: none


def modules(*roots: str) -> dict[str, Path]:
    out = {}
    for root in roots:
        for p in (ROOT / root).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


ALL = modules("framework", "plugins", "kernels", "experiments", "tests")


def layer(mod: str) -> int | None:
    for prefix, n in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if mod == prefix or mod.startswith(prefix + "."):
            return n
    return None


def imports(mod: str) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every import statement of `mod`."""
    path = ALL[mod]
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None) if sub in ALL else (base, a.name))
    return out


def own(target: str) -> str | None:
    """The project module an import names (the longest known prefix), or None for a third-party one."""
    while target and target not in ALL:
        target = target.rpartition(".")[0]
    return target or None


def edges() -> dict[str, set[str]]:
    return {m: {t for t, _ in map(lambda i: (own(i[0]), i[1]), imports(m)) if t and t != m} for m in ALL}


def violations() -> list[str]:
    bad = []
    for mod in ALL:
        top = mod.split(".")[0]
        for target, name in imports(mod):
            t = own(target)
            if t is None or t == mod:
                continue
            ttop = t.split(".")[0]
            if top == "framework":
                if ttop in ("plugins", "kernels"):
                    bad.append(f"{mod} -> {t}: framework imports no plugin and no kernel (plugins pick kernels)")
                elif ttop == "framework" and layer(t) > layer(mod):
                    bad.append(f"{mod} -> {t}: L{layer(mod)} imports L{layer(t)}")
                elif ttop == "framework" and (layer(t) is None or layer(mod) is None):
                    bad.append(f"{mod} -> {t}: a framework module outside the layer map")
            elif top == "plugins":
                if ttop == "framework" and layer(t) > PLUGIN_MAX_LAYER:
                    bad.append(f"{mod} -> {t}: plugins import framework's L0-L{PLUGIN_MAX_LAYER} only")
                elif ttop == "plugins" and t.split(".")[:2] != mod.split(".")[:2]:
                    bad.append(f"{mod} -> {t}: plugins meet only through the registry")
                elif ttop in ("experiments", "tests"):
                    bad.append(f"{mod} -> {t}")
            elif top == "kernels" and ttop != "kernels":
                bad.append(f"{mod} -> {t}: kernels import nothing from framework/ or plugins/")
            if top in ("experiments", "tests") and ttop not in ("experiments", "tests"):
                parts = t.split(".") + ([name] if name else [])
                if any(p.startswith("_") and not p.startswith("__") for p in parts):
                    bad.append(f"{mod} -> {'.'.join(parts)}: a private name of another package")
    return bad


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph, index, low, stack, on, found, n = edges(), {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = n; n += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = n; n += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_every_framework_package_has_a_layer():
    assert not [m for m in ALL if m.startswith("framework.") and layer(m) is None]


def test_imports_keep_to_the_layers():
    bad = [v for v in violations() if v.split(":")[0] not in ALLOWED]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    assert not cycles(), cycles()


def test_the_allow_list_holds_only_what_still_happens():
    current = {v.split(":")[0] for v in violations()}
    assert not ALLOWED - current, f"mended, drop from ALLOWED: {sorted(ALLOWED - current)}"
