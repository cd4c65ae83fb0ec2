"""The README (and the architecture and examples documents) describe culmen as it is.

Checked: every dotted ``culmen.`` / ``apex.`` / ``flash_attn.`` name in a code span or an import line
resolves (``apex`` and ``flash_attn`` through the alias's prefix table); every name in the "names" column
of an API table is an attribute of that row's module; the benchmark table lists exactly the registered
benchmarks, and every ``culmen bench NAME`` exists; every ``--option`` of the Command line section is an
option of the ``culmen`` command; every repository path exists; the self-contained Python examples run.
"""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "docs" / "ARCHITECTURE.md", ROOT / "examples" / "README.md"]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w.])(culmen|apex|flash_attn)((?:\.[A-Za-z_]\w*)+)")
PREFIX = {"culmen": "culmen", "apex": "culmen", "flash_attn": "culmen.flash_attn"}


def _text(path: Path) -> str:
    return path.read_text()


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return FENCE.sub("", text)


def _spans(text: str) -> list[str]:
    return SPAN.findall(_prose(text))


def _blocks(text: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(text) if kind == lang]


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"README has no section '## {title}'"
    return m.group(1)


def resolve(name: str):
    """The object a dotted name stands for (``apex.x`` / ``flash_attn.x`` as the alias maps them): each part
    is an attribute of the previous object or, failing that, a submodule of it."""
    root, _, rest = name.partition(".")
    obj = importlib.import_module(PREFIX[root])
    for part in rest.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not isinstance(obj, types.ModuleType) or not hasattr(obj, "__path__"):
                raise
            obj = importlib.import_module(f"{obj.__name__}.{part}")
    return obj


def _not_there(text: str) -> set[str]:
    """Dotted names of the paragraphs that list what culmen lacks ("Not there ..."): exempt."""
    paras = [p for p in re.split(r"\n\s*\n", _prose(text)) if "Not there" in p]
    return {m.group(1) + m.group(2) for p in paras for span in SPAN.findall(p) for m in DOTTED.finditer(span)}


def _dotted_names(text: str) -> set[str]:
    names = {m.group(1) + m.group(2) for span in _spans(text) for m in DOTTED.finditer(span)}
    for block in _blocks(text, "python"):
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            m = re.match(r"from\s+([\w.]+)\s+import\s+(.+)", line)
            if m and DOTTED.match(m.group(1) + ".x"):
                names.update(f"{m.group(1)}.{n.split(' as ')[0].strip()}" for n in m.group(2).split(","))
            m = re.match(r"import\s+([\w.]+)", line)
            if m and "." in m.group(1) and DOTTED.match(m.group(1)):
                names.add(m.group(1))
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name if p.name != "README.md" else str(p.relative_to(ROOT)))
def test_every_dotted_name_resolves(doc):
    text = _text(doc)
    exempt = _not_there(text)
    names = _dotted_names(text)
    if doc == README:
        assert len(names) > 40  # the parser found the API overview
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            if name in exempt:
                continue
            missing.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not missing, f"{doc.name} lists names culmen does not have:\n" + "\n".join(missing)


def _api_rows(text: str) -> list[tuple[str, list[str]]]:
    """``(module, [names])`` for every table row whose first cell is one dotted culmen module."""
    rows = []
    for line in _prose(text).splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        first = SPAN.findall(cells[0])
        if len(first) == 1 and re.fullmatch(r"culmen(\.\w+)+", first[0]) and cells[0] == f"`{first[0]}`":
            rows.append((first[0], [s for s in SPAN.findall(cells[1]) if re.fullmatch(r"[A-Za-z_]\w*", s)]))
    return rows


def test_api_tables_list_attributes_of_their_module():
    rows = _api_rows(_text(README))
    modules = {m for m, _ in rows}
    assert {"culmen.amp", "culmen.optimizers", "culmen.parallel", "culmen.normalization", "culmen.flash_attn",
            "culmen.flash_attn.layers.rotary", "culmen.multi_tensor_apply.amp_C"} <= modules
    assert sum(len(names) for _, names in rows) > 150
    missing = []
    for module, names in rows:
        mod = importlib.import_module(module)
        missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    assert not missing, "README API tables list missing names: " + ", ".join(missing)


def test_api_table_of_amp_c_is_complete():
    """Names that are a closed set (Apex's amp_C ops) must all be listed, not only exist."""
    from culmen.multi_tensor_apply import amp_C

    rows = dict(_api_rows(_text(README)))
    public = {n for n in dir(amp_C) if not n.startswith("_") and callable(getattr(amp_C, n))}
    assert public <= set(rows["culmen.multi_tensor_apply.amp_C"])


def _registered_benchmarks():
    from culmen.bench import load_benchmarks, registered_benchmarks

    failed = load_benchmarks()
    assert not failed, failed
    return registered_benchmarks()


def test_benchmark_table_is_the_registry():
    table = _section(_text(README), "Benchmarks")
    rows = [ln for ln in table.splitlines() if ln.startswith("| `")]
    listed = {}
    for ln in rows:
        name_cell, family_cell = (c.strip() for c in ln.strip("|").split("|")[:2])
        listed[name_cell.strip("`")] = family_cell
    registered = {b.name: b.family for b in _registered_benchmarks()}
    assert sorted(listed) == sorted(registered), (
        f"not registered: {sorted(set(listed) - set(registered))}; "
        f"registered but not in the README: {sorted(set(registered) - set(listed))}")
    wrong = {n: (f, registered[n]) for n, f in listed.items() if registered[n] != f}
    assert not wrong, f"README family differs from the registry: {wrong}"


def test_culmen_bench_names_in_prose_exist():
    known = {b.name for b in _registered_benchmarks()} | {b.family for b in _registered_benchmarks()}
    text = _text(README)
    for span in _spans(text) + [ln for b in _blocks(text, "bash") for ln in b.splitlines()]:
        m = re.search(r"culmen bench ((?:[a-z_0-9]+ ?)+)", span)
        if m:
            for name in m.group(1).split():
                assert name in known, f"`{span}` names an unknown benchmark {name!r}"
    m = re.search(r"scripts/gpu-check ([a-z_0-9]+)", text)
    assert m and m.group(1) in known


def _cli_options() -> set[str]:
    import argparse

    from culmen.cli import build_parser

    parser = build_parser()
    opts = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                opts |= set(sub._option_string_actions)
    return opts


def test_command_line_section_options_exist():
    section = _section(_text(README), "Command line")
    used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", " ".join(SPAN.findall(section))))
    assert {"--json", "--plot", "--from-json", "--device", "--version", "--steps"} <= used
    unknown = used - _cli_options()
    assert not unknown, f"README's Command line section names options culmen lacks: {sorted(unknown)}"
    subcommands = set(re.findall(r"`culmen (\w+)", section))
    assert subcommands == {"info", "bench", "demo"}


def _repo_paths(text: str) -> set[str]:
    top = {p.name for p in ROOT.iterdir()}
    paths = set()
    for span in _spans(text):
        for token in span.split():
            token = token.strip("(),;:")
            if "/" in token and not token.startswith(("/", "$", "http")) and token.split("/")[0] in top:
                paths.add(token)
    return paths


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_exist(doc):
    paths = _repo_paths(_text(doc))
    assert paths, "the path parser found nothing"
    missing = []
    for p in sorted(paths):
        if "<" in p:  # a placeholder: what comes before it must exist
            p = p[: p.index("<")].rsplit("/", 1)[0]
        hits = list(ROOT.glob(p)) if "*" in p else [ROOT / p] if (ROOT / p).exists() else []
        if not hits:
            missing.append(p)
    assert not missing, f"{doc.name} points at paths the repository lacks: {missing}"


def test_readme_points_at_the_architecture_document_and_license():
    text = _text(README)
    assert "`docs/ARCHITECTURE.md`" in text and (ROOT / "docs" / "ARCHITECTURE.md").is_file()
    assert "DESIGN.md" not in text  # the old pointer to a file outside the repository
    assert (ROOT / "LICENSE").is_file() and "`LICENSE`" in text


def test_self_contained_python_examples_run():
    """README blocks that start with ``import torch`` are complete programs: run them (CPU)."""
    blocks = [b for b in _blocks(_text(README), "python") if b.startswith("import torch")]
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme_example"})


def test_every_python_block_compiles():
    for doc in DOCS:
        for block in _blocks(_text(doc), "python"):
            compile(block, str(doc), "exec")
