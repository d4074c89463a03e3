"""The layout docs/layout.md describes: imports only go down, with no cycle and no project
module imported inside a function to dodge one."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The one project module a function may import: Triton kernels, loaded only for --fused_norm on
# a GPU (a CPU test sets TRITON_INTERPRET=1 before importing it; importing them at the top would
# fix the mode for every test).
LOADED_WHEN_ASKED = {"ddpm_train.networks.fused_norm"}


PACKAGE = "ddpm_train"


def project_modules():
    """name -> path: the root's commands, the package's modules as ddpm_train.ROOM.NAME, and bench/'s as bench.NAME."""
    found = {p.stem: p for p in ROOT.glob("*.py")}
    found |= {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / PACKAGE).rglob("*.py")
              if p.stem != "__init__"}  # fmt: skip
    found |= {f"bench.{p.stem}": p for p in (ROOT / "bench").glob("*.py") if p.stem not in ("__init__", "__main__")}
    return found


def module_name(path):
    return ".".join(path.relative_to(ROOT).with_suffix("").parts) if ROOT in path.parents else path.stem


def imports(path, modules):
    """(imported at the top, imported inside a function or class): the project modules `path` imports."""
    top, inner = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found = {name for name in names if name in modules} or {n.split(".")[0] for n in names} & set(modules)
        (top if node.col_offset == 0 else inner).update(found - {module_name(path)})
    return top, inner


def graph():
    modules = project_modules()
    return {name: imports(path, modules) for name, path in modules.items()}


def test_no_project_module_is_imported_inside_a_function():
    inside = {name: sorted(inner - LOADED_WHEN_ASKED) for name, (_, inner) in graph().items()}
    assert not {name: found for name, found in inside.items() if found}, "import these at the top (or break the cycle)"


def first_cycle(edges):
    """A list of modules that import each other in a circle, or None."""
    state = {}

    def visit(name, path):
        if state.get(name) == "open":
            return [*path[path.index(name):], name]
        if state.get(name) == "done":
            return None
        state[name] = "open"
        for other in sorted(edges.get(name, ())):
            cycle = visit(other, [*path, name])
            if cycle:
                return cycle
        state[name] = "done"
        return None

    return next((cycle for name in sorted(edges) if (cycle := visit(name, []))), None)


def test_no_import_cycle():
    cycle = first_cycle({name: top for name, (top, _) in graph().items()})
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def layers(text):
    """module -> its row in docs/layout.md's table of layers (0: the top row), from the backticked
    names of each row's modules column (`bench/speed.py` is bench.speed)."""
    table = text[text.index("| layer | modules |"):].split("\n\n")[0]  # the layers' table alone
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ") and "`" in line.split("|")[2]]
    found = {}
    for row, cell in enumerate(rows):
        for name in re.findall(r"`([\w/]+)\.py`", cell):
            found[name.replace("/", ".")] = row
    return found


def upward_imports(edges, rows):
    """'a (row i) imports b (row j < i)' for each import that goes up the table."""
    return [f"{a} (row {rows[a]}) imports {b} (row {rows[b]})" for a in sorted(edges) for b in sorted(edges[a])
            if rows[b] < rows[a]]  # fmt: skip


def test_imports_only_go_down_the_layers_of_docs_layout():
    rows = layers((ROOT / "docs" / "layout.md").read_text())
    edges = {name: top for name, (top, _) in graph().items()}
    assert set(edges) == set(rows), "docs/layout.md's table must name every module, once"
    assert not upward_imports(edges, rows), "move the import down, or the module up docs/layout.md's table"


def test_the_checker_finds_a_cycle_and_an_inner_import(tmp_path):
    """imports() sees both kinds, so the two tests above can fail."""
    (tmp_path / "a.py").write_text("import b\n\ndef f():\n    import c\n")
    top, inner = imports(tmp_path / "a.py", {"a": None, "b": None, "c": None})
    assert top == {"b"} and inner == {"c"}
    assert first_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert first_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    table = "| layer | modules |\n|---|---|\n| top | `a.py`, `bench/t.py` |\n| low | `b.py` |\n"
    assert layers(table) == {"a": 0, "bench.t": 0, "b": 1}
    assert upward_imports({"a": {"b"}, "b": {"a"}, "bench.t": set()}, layers(table)) == ["b (row 1) imports a (row 0)"]


def test_the_tools_live_in_bench():
    assert not [p.name for p in ROOT.glob("*.py") if p.stem in ("bench", "sweep", "quality")]


COMMANDS = {"train", "sample", "flops", "ema", "memory", "profiling"}


@pytest.mark.slow
def test_the_root_holds_the_commands_alone_and_each_answers_help():
    """`ls *.py` at the root lists what a user runs; every other module is the package's."""
    import subprocess
    import sys

    assert {p.stem for p in ROOT.glob("*.py")} == COMMANDS
    for name in sorted(COMMANDS - {"train", "sample"}):  # the two large ones' --help: test_train, test_sample
        done = subprocess.run([sys.executable, f"{name}.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage:" in done.stdout, (name, done.stderr[-500:])
    assert {"bench.speed", "bench.sweep", "bench.quality", "bench.trust"} <= set(project_modules())


def test_no_module_but_objectives_compares_an_objective_s_name():
    """objectives.py's promise: outside diffusion/ the code asks objectives.of(...) (or objectives.recorded), never
    `== "ddpm"` or `or "ddpm"` (samplers.py's "ddpm" is a sampler's name)."""
    compared = re.compile(r"""(==|!=|\bor\b|\bin\b)\s*\(?["'](ddpm|edm|flow)["']""")
    found = [f"{path.name}:{number}" for path in project_modules().values() if path.parent.name != "diffusion"
             for number, line in enumerate(path.read_text().splitlines(), 1) if compared.search(line)]  # fmt: skip
    assert not found
