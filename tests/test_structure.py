"""The package's shape (README "Architecture"): every import runs down the floors, none in a circle, no
module over 400 lines. Imports inside functions count too: a lazy import is still an arrow."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "speccache_rag"
MAX_LINES = 400

# Bottom to top. A module belongs to the first floor with a prefix that names it (or its package).
FLOORS = [
    ("values", ["config", "hardware", "prompt", "chat_prompt", "kv", "wire", "engines", "sampling", "chunking",
                "data"]),
    ("parts", ["layers", "runner", "store", "models", "output", "neighbors", "propagate", "offload"]),
    ("pipeline", ["selection", "gate", "blend", "contract", "remote_output"]),
    ("engines", ["engine", "remote", "vllm", "ray_precompute", "matching"]),
    ("surfaces", ["dropin", "cli", "bench", "__main__", ""]),      # "": the package's __init__
]


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods) -> set[str]:
    """The package modules ``name`` imports (``from . import x`` is an import of x, not of the package)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("speccache_rag")]
            targets = [t.removeprefix("speccache_rag").lstrip(".") for t in targets]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("speccache_rag"):
                module = node.module.removeprefix("speccache_rag").lstrip(".")
            else:
                continue
            subs = [f"{module}.{a.name}".lstrip(".") for a in node.names]
            targets = [s for s in subs if s in mods] or [module]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t != name:
                found.add(t)
    return found


def _floor(name: str) -> int:
    for i, (_, prefixes) in enumerate(FLOORS):
        if any(name == p or name.startswith(p + ".") for p in prefixes if p) or (name == "" and "" in prefixes):
            return i
    raise AssertionError(f"module {name!r} is on no floor: add it to FLOORS in {__file__}")


def test_every_import_runs_down_the_floors():
    mods = _modules()
    up = [f"{m or '__init__'} ({FLOORS[_floor(m)][0]}) → {t or '__init__'} ({FLOORS[_floor(t)][0]})"
          for m, path in mods.items() for t in _imports(m, path, mods) if _floor(t) > _floor(m)]
    assert not up, "imports running back up:\n" + "\n".join(sorted(up))


def test_no_import_circle():
    mods = _modules()
    graph = {m: _imports(m, p, mods) - {""} for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m, trail):
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " → ".join(trail[trail.index(t):] + [t]))
            if t not in state:
                visit(t, trail + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these (over {MAX_LINES} lines): {long}"
