"""The package's shape (docs/layout.md): no import circle among splicer's modules, packages that import only the
ones below them, and no stage outside splicer/formats/ and splicer/backends/ that chooses by a format's or a
backend's name. Read from the source with ast, every import counted (a function's own, under TYPE_CHECKING too)."""

import ast
import re
from pathlib import Path

from splicer.backends import BACKENDS, backend_type, results_wording
from splicer.backends.base import KL_EXACT, KL_OWN_TOP_K, ResultsWording
from splicer.formats.layouts import CT_FORMATS, LAYOUT
from splicer.formats.registry import registry

ROOT = Path(__file__).parents[1]
SPLICER = ROOT / "splicer"

# The stages from the bottom up, as docs/layout.md lists them: a module imports from its own package and those before.
ORDER = (
    "errors",
    "arch",
    "io",
    "formats",
    "checkpoint",
    "splice",
    "corpora",
    "backends",
    "plans",
    "analysis",
    "ablate",
    "budget",
    "tasks",
    "fixtures",
    "trained",
    "readme_blocks",
    "cli",
    "__main__",
)


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's __init__)."""
    out = {}
    for path in sorted(SPLICER.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _imports() -> dict[str, set[str]]:
    """Module -> the splicer modules it imports (a name imported from a package counts as the package, unless it is a
    submodule)."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {t for t in map(known, (t for t in targets if t.startswith("splicer"))) if t and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_cycle_among_splicer_modules():
    assert _cycles(_imports()) == []


def test_every_stage_is_in_the_order_and_docs_layout_lists_them_so():
    assert {_stage(m) for m in _modules()} - {"__init__"} == set(ORDER)
    tree = (ROOT / "docs" / "layout.md").read_text().split("```")[1]
    listed = [m.group(1) for m in re.finditer(r"^  (\w+)(?:/|\.py)", tree, re.M)]
    assert listed == [s for s in ORDER if s != "__main__"]


def test_packages_import_only_the_stages_below_them():
    upward = {
        (a, b)
        for a, targets in _imports().items()
        for b in targets
        if _stage(a) in ORDER and _stage(b) in ORDER and ORDER.index(_stage(b)) > ORDER.index(_stage(a))
    }
    assert upward == set()


# A format's names (quant_method, storage layout, compressed-tensors format, the loaders' aliases of them) and the
# backends' names. Outside splicer/formats/ and splicer/backends/ no code compares with them, looks them up inline or
# matches them: what differs by format or backend is asked of the format or the backend. Fixtures may name what they
# write (a config's quant_method, a build kind in their table of kinds); they do not branch on it either.
NAMES = {*registry(), *LAYOUT, *CT_FORMATS, *BACKENDS, "awq_marlin", "auto_awq", "gptq_marlin", "nvfp4"}


def _named(node) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_named(e) for e in node.elts)


def _choices_by_name(tree: ast.AST):
    """Lines that compare with a name, test a prefix or suffix with one, subscript by one, look one up in an inline
    dict ({name: ...}[x], {name: ...}.get(x)) or match one."""
    inline = {
        id(n.value if isinstance(n, ast.Subscript) else n.func.value)
        for n in ast.walk(tree)
        if (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Dict))
        or (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "get"
            and isinstance(n.func.value, ast.Dict)
        )
    }
    for n in ast.walk(tree):
        if (
            (isinstance(n, ast.Compare) and any(map(_named, [n.left, *n.comparators])))
            or (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("startswith", "endswith")
                and any(map(_named, n.args))
            )
            or (isinstance(n, ast.Subscript) and _named(n.slice))
            or (isinstance(n, ast.Dict) and id(n) in inline and any(k is not None and _named(k) for k in n.keys))
        ):
            yield n.lineno
        elif isinstance(n, ast.match_case) and isinstance(n.pattern, ast.MatchValue) and _named(n.pattern.value):
            yield n.pattern.lineno


def test_no_stage_outside_formats_and_backends_chooses_by_a_format_or_backend_name():
    found = []
    for path in sorted(SPLICER.rglob("*.py")):
        rel = path.relative_to(SPLICER)
        if rel.parts[0] in ("formats", "backends"):
            continue
        lines = path.read_text().splitlines()
        found += [f"{rel}:{n}: {lines[n - 1].strip()}" for n in sorted(set(_choices_by_name(ast.parse(path.read_text()))))]
    assert not found, "ask the format or the backend instead:\n" + "\n".join(found)


def test_the_name_check_sees_each_kind_of_choice():
    source = """
if fmt == "gptq": pass
if backend in ("torch", "x"): pass
if layout.name.startswith("ct-pack"): pass
LAYOUT["awq"]
words = {"fp8": "FP8"}.get(name)
match backend:
    case "vllm": pass
table = {"awq": 1}  # a table, not a choice
qc = {"quant_method": "gptq"}  # data a fixture writes
"""
    assert sorted(set(_choices_by_name(ast.parse(source)))) == [2, 3, 4, 5, 6, 8]


def test_every_backend_words_its_figures():
    for name in BACKENDS:
        cls = backend_type(name)
        wording = cls.results_wording
        assert isinstance(wording, ResultsWording)
        # a backend whose gathered log-probs are not always exact (exact_gather answered per engine, not a constant True)
        # says so in its KL caveat, and words its exact runs (kl_support "exact") apart where it has any
        always_exact = cls.exact_gather is True
        assert (wording.kl_bound == ResultsWording().kl_bound) == always_exact
        assert wording.kl_bound.format(top="top-20", k=20, kth="its 20th log-prob")
        exact = results_wording(name, KL_EXACT)
        assert exact.kl_bound == (wording.kl_exact or wording.kl_bound) and results_wording(name, KL_OWN_TOP_K) == wording
        assert always_exact or "exact log-probs at those ids" in exact.kl_bound.format(top="top-20", k=20, kth="")
        assert results_wording(name) == wording  # a file written before kl_support was recorded: worded as then
