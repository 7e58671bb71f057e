"""The import rules of docs/layout.md, enforced by scanning the source: each folder's allow-list of
the product's own modules it may import (a new module is checked by the rule of its folder), the SDKs a side must
not load, no import cycle, and a light package import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("orchestrator", "pipelines")


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# Each rule: which files it covers (first match wins), the product modules they may import, the SDKs they may not.
LEAF = ("orchestrator.config", "orchestrator.errors", "pipelines.config", "pipelines.entrypoints")
WORKER = (*LEAF, "orchestrator.models", "orchestrator.training", "pipelines", "orchestrator.ray_internals")
DRIVER_SDKS_ONLY = ("mlflow", "ray.tune", "boto3")
RULES: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    # (files: a folder or a file under ROOT, allowed product imports, banned third-party imports)
    ("pipelines", ("pipelines",), ("mlflow", "ray.tune")),
    ("orchestrator/config", LEAF, ("torch", "ray", "mlflow")),
    ("orchestrator/errors.py", (), ("torch", "ray", "mlflow")),
    ("orchestrator/ray_internals.py", (), ("torch", "mlflow")),  # Ray's internals, and nothing else
    ("orchestrator/models/registry.py", LEAF, ("torch", "ray", "mlflow")),
    # Worker side: what Ray Train workers import. No driver module, no tracking or tuning SDK. The model package is
    # the workers' whole: its MLflow modules are tracking's (flavour, pyfunc, checkpoint_models), its driver checks
    # the plan's (run/model_checks.py).
    ("orchestrator/training", WORKER, DRIVER_SDKS_ONLY),
    ("orchestrator/models", WORKER, DRIVER_SDKS_ONLY),
    # Entry points: the CLI and the package's lazy attributes reach everything.
    ("orchestrator/cli.py", PRODUCT, ()),
    ("orchestrator/__init__.py", PRODUCT, ()),
    ("orchestrator/__main__.py", PRODUCT, ()),
    # The study is built on the driver's modules; they never reach back into it.
    ("orchestrator/tuning", ("orchestrator.config", "orchestrator.errors", "orchestrator.models.tasks",
                             "orchestrator.training", "orchestrator.tuning", "orchestrator.run.plan",
                             "orchestrator.run.model_checks", "orchestrator.cluster.local",
                             "orchestrator.report.console", "orchestrator.report.cost", "orchestrator.report.plots",
                             "orchestrator.run.place",
                             "orchestrator.tracking", "orchestrator.run.trainer", "orchestrator.report.autopilot",
                             "pipelines"), ()),
    # Every other module of orchestrator/ is driver side, a driver package's (run/, report/, cluster/, doctor/,
    # tracking/) too: anything but
    # the entry points and the study.
    ("orchestrator", tuple(f"orchestrator.{p.stem}" for p in (ROOT / "orchestrator").glob("*.py")
                           if p.stem not in ("cli", "__init__", "__main__"))
     + tuple(f"orchestrator.{p.parent.name}" for p in (ROOT / "orchestrator").glob("*/__init__.py")
             if p.parent.name != "tuning")
     + ("pipelines",), ()),
]


def rule_of(path: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    rel = path.relative_to(ROOT).as_posix()
    return next(r for r in RULES if rel == r[0] or rel.startswith(r[0] + "/"))


def broken_rules(folder: str) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        where, allowed, banned = rule_of(path)
        for name in sorted(imports(path)):
            if _under(name, PRODUCT) and not _under(name, allowed):
                found.append(f"{path.relative_to(ROOT)} imports {name} (not allowed under {where})")
            if _under(name, banned):
                found.append(f"{path.relative_to(ROOT)} imports {name} (banned under {where})")
    return found


def test_every_module_keeps_to_its_folders_rule() -> None:
    assert broken_rules("pipelines") + broken_rules("orchestrator") == []


def test_a_module_added_to_a_folder_is_held_to_its_rule() -> None:
    for folder in (r[0] for r in RULES if not r[0].endswith(".py")):
        assert rule_of(ROOT / folder / "zz_architecture_probe.py")[0] == folder
    # The worker side may not reach a driver module, nor the driver side the study, nor the config a model.
    assert not _under("orchestrator.tracking", rule_of(ROOT / "orchestrator/training/new.py")[1])
    assert not _under("orchestrator.run.launch", rule_of(ROOT / "orchestrator/models/zoo.py")[1])
    assert not _under("orchestrator.tuning.study", rule_of(ROOT / "orchestrator/new_driver.py")[1])
    assert not _under("orchestrator.tuning.study", rule_of(ROOT / "orchestrator/tracking/new.py")[1])
    assert _under("orchestrator.tracking.client", rule_of(ROOT / "orchestrator/new_driver.py")[1])
    # A driver package's modules are driver modules: held to the driver's rule, importable by the driver side.
    assert rule_of(ROOT / "orchestrator/doctor/rules/new_rule.py")[0] == "orchestrator"
    assert _under("orchestrator.doctor.rules.speed", rule_of(ROOT / "orchestrator/new_driver.py")[1])
    assert not _under("orchestrator.tuning.study", rule_of(ROOT / "orchestrator/doctor/new.py")[1])
    assert not _under("orchestrator.models", rule_of(ROOT / "orchestrator/config/new.py")[1])
    # The model package is worker side whole: a module added to it reaches neither tracking nor the plan.
    assert not _under("orchestrator.tracking.flavour", rule_of(ROOT / "orchestrator/models/new.py")[1])
    assert not _under("orchestrator.run.model_checks", rule_of(ROOT / "orchestrator/models/new.py")[1])


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports (anywhere in the file, functions included)."""
    files = {_module_name(p): p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            targets |= {r for n in names if _under(n, PRODUCT) and (r := resolve(n)) and r != module}
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each as the path that closes it (depth-first search)."""
    found, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_cycle_search_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_config_is_light() -> None:
    # Loading a config imports no torch and no Ray: `orchestrator train --help` and config refusals stay fast.
    code = "import sys, orchestrator.config; print(','.join(m for m in ('torch', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


def test_the_train_command_reaches_its_plan_without_torch_mlflow_or_ray() -> None:
    # The start-up line's `command` stage: `orchestrator train` up to its plan (the CLI, the config read, the run's
    # modules). torch is imported by the plan's model checks, Ray as it starts, Ray Data and Ray Train with the
    # datasets and the trainer, MLflow beside the worker group: each here would add its seconds to every command.
    heavy = ("torch", "mlflow", "ray", "ray.data", "ray.train", "ray.tune", "pandas")
    code = ("import sys\n"
            "import orchestrator.run.launch as launch\n"
            "def reached(*args, **kwargs):\n"
            f"    print(','.join(m for m in {heavy!r} if m in sys.modules))\n"
            "    raise SystemExit(0)\n"
            "launch.plan_run = reached\n"
            "from orchestrator.cli import main\n"
            "main(['train', '--set', 'train.max_steps=50'])\n"
            "print('the plan was not reached')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "", out.stdout + out.stderr


def test_workers_and_the_driver_import_fsdp_only_for_a_sharded_run() -> None:
    # torch's FSDP, DTensor and DCP modules cost each worker process (and the driver) about half a second of its
    # start; a DDP run never uses them. Deciding whether a model is sharded must not import them either.
    code = ("import sys, torch, orchestrator.training.worker, orchestrator.run.launch\n"
            "from orchestrator.training import fsdp\n"
            "assert not fsdp.is_sharded(torch.nn.Linear(2, 2)) and fsdp.local_tensor(torch.ones(1)).numel() == 1\n"
            "print(','.join(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor', "
            "'torch.distributed.checkpoint') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


def test_scan_finds_a_violation(tmp_path: Path) -> None:
    probe = tmp_path / "x.py"
    probe.write_text("from mlflow.tracking import MlflowClient\nimport ray.tune\n")
    assert imports(probe) == {"mlflow.tracking", "ray.tune"}


def test_package_import_is_light() -> None:
    code = ("import sys, orchestrator; heavy = [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


def test_exported_functions_are_not_shadowed_by_subpackages() -> None:
    # A subpackage named like an exported function replaces it once imported (orchestrator.train did).
    code = ("import orchestrator.training.loop, orchestrator.tuning.study, orchestrator.run.launch\n"
            "from orchestrator import train, tune\n"
            "assert callable(train) and callable(tune), (train, tune)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)


def test_ingest_options_keep_order_and_use_no_deprecated_option() -> None:
    import warnings

    from orchestrator.run.trainer import ingest_options

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = ingest_options()
    assert options.preserve_order
    assert not [w for w in caught if "exclude_resources" in str(w.message)]


# Size limits: a function (def line to its last line, decorators excluded) and a file a reader takes in at once.
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 450


def oversized() -> dict[str, int]:
    """Every file over MAX_FILE_LINES ('path') and function or method over MAX_FUNCTION_LINES ('path::Class.name',
    nested functions as 'outer.inner'), with its line count."""
    found: dict[str, int] = {}
    for path in sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")):
        rel, text = path.relative_to(ROOT).as_posix(), path.read_text()
        if (lines := len(text.splitlines())) > MAX_FILE_LINES:
            found[rel] = lines

        def visit(node: ast.AST, prefix: str, rel: str = rel) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    name = prefix + child.name
                    length = (child.end_lineno or child.lineno) - child.lineno + 1
                    if not isinstance(child, ast.ClassDef) and length > MAX_FUNCTION_LINES:
                        found[f"{rel}::{name}"] = length
                    visit(child, name + ".")
                else:
                    visit(child, prefix)

        visit(ast.parse(text), "")
    return found


def test_no_function_or_file_is_over_its_size_limit() -> None:
    over = oversized()
    named = ", ".join(f"{name} ({lines} lines)" for name, lines in sorted(over.items()))
    assert not over, f"split these (limits: {MAX_FUNCTION_LINES} lines a function, {MAX_FILE_LINES} a file): {named}"


MAX_LINE_COLUMNS = 100  # product code only (pyproject.toml's ruff line length; tests and scripts keep 120)


def test_no_product_line_is_over_100_columns() -> None:
    """Files are kept under their size by splitting them by role, not by packing lines: a long line is wrapped."""
    files = sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py"))
    long = [f"{path.relative_to(ROOT)}:{number}" for path in files
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > MAX_LINE_COLUMNS]
    assert not long, f"wrap these lines at {MAX_LINE_COLUMNS} columns: {long}"


MAX_PARAMETERS = 8  # self and cls not counted; *args and **kwargs count one each


def too_many_parameters() -> list[str]:
    """'path::name (n)' for every product function or method taking more than MAX_PARAMETERS."""
    found = []
    for path in sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                count = len([n for n in names if n.arg not in ("self", "cls")])
                if count > MAX_PARAMETERS:
                    found.append(f"{path.relative_to(ROOT)}::{node.name} ({count})")
    return found


def test_no_function_takes_more_than_8_parameters() -> None:
    """A function taking more is handed a group of them that belongs together (a plan, a spec, a dataclass)."""
    assert not too_many_parameters(), f"regroup their parameters: {too_many_parameters()}"


def test_the_parameter_count_sees_keyword_only_and_star_arguments(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "orchestrator" / "m.py").write_text(
        "def fits(a, b, c, d, e, f, g, h): ...\n"
        "def over(a, b, c, d, e, f, *args, g, **kwargs): ...\n"
        "class C:\n    def method(self, a, b, c, d, e, f, g, h): ...\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert too_many_parameters() == ["orchestrator/m.py::over (9)"]


def test_size_check_counts_from_the_def_to_the_end_and_names_each_offender(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def body(indent: int) -> str:  # one line short of the limit, with the def line
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))

    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "orchestrator" / "m.py").write_text(  # the decorator's line does not count
        f"@decorator\ndef fits():\n{body(4)}\n\nclass C:\n    def over(self):\n{body(8)}        def inner():\n"
        f"{body(12)}            y = 0\n")
    (tmp_path / "orchestrator" / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert oversized() == {"orchestrator/big.py": MAX_FILE_LINES + 1,
                           "orchestrator/m.py::C.over": 2 * MAX_FUNCTION_LINES + 1,
                           "orchestrator/m.py::C.over.inner": MAX_FUNCTION_LINES + 1}


def test_no_two_test_modules_share_a_name() -> None:
    # The test folders are not packages, so pytest imports each module by its basename: two files of one name make
    # `make test` (both folders in one session) fail at collection, while either folder alone passes.
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, f"rename one of each pair: {clashes}"
