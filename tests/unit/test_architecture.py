"""Import directions from DESIGN.md, enforced by scanning the source, and a light package import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def offenders(folder: str, banned: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imports(path):
            if any(name == b or name.startswith(b + ".") for b in banned):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def test_pipelines_never_import_orchestrator() -> None:
    assert offenders("pipelines", ("orchestrator",)) == []


DRIVER = ("orchestrator.cli", "orchestrator.launch", "orchestrator.cluster", "orchestrator.trainer",
          "orchestrator.study", "orchestrator.trials", "orchestrator.search", "orchestrator.tracking",
          "orchestrator.runs", "orchestrator.cost", "orchestrator.doctor", "orchestrator.plots",
          "orchestrator.progress", "orchestrator.model_logging", "orchestrator.console")


def test_worker_side_imports_no_driver_sdks_or_modules() -> None:
    assert offenders("orchestrator/training", ("mlflow", "ray.tune", "boto3", *DRIVER)) == []


def test_config_is_a_leaf() -> None:
    # Loading a config imports no torch, no model zoo and no driver code (the search-space grammar is its own leaf).
    banned = ("torch", "ray", "mlflow", "orchestrator.models", "orchestrator.training", *DRIVER)
    for module in ("config.py", "space.py", "registry.py", "errors.py"):
        found = [o for o in offenders("orchestrator", banned) if o.startswith(f"orchestrator/{module} ")]
        assert found == [], found
    code = "import sys, orchestrator.config; print(','.join(m for m in ('torch', 'ray') if m in sys.modules))"
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
    code = ("import orchestrator.training.loop, orchestrator.study, orchestrator.launch\n"
            "from orchestrator import train, tune\n"
            "assert callable(train) and callable(tune), (train, tune)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)


def test_ingest_options_keep_order_and_use_no_deprecated_option() -> None:
    import warnings

    from orchestrator.trainer import ingest_options

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = ingest_options()
    assert options.preserve_order
    assert not [w for w in caught if "exclude_resources" in str(w.message)]
