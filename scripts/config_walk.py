"""Follow `config` through the driver's code, read statically, and count how often the walk goes back and forth.

Starting at a function (default `orchestrator.run.launch.train`) with one parameter followed (default `config`), the
walk reads the function's statements in order. A part of a followed value (`config.train`) is followed too, and so
is what a product function returns from a followed value when it returns a config (`-> Config`) or another form of
it (orchestrator.config's `to_dict`, `config_from_dict`); a call that
takes a followed value (as an argument, or as the object of a method) is entered when it resolves to a function of
the product (orchestrator/, pipelines/), and walked the same way (its body once; a later call is a short visit).

A *stay* is a stretch of the walk in one module (a package of orchestrator/ counts as one module, and so does the
data layer, pipelines/). Printed: the modules entered, the stays, the *climbs back up*
(stays reached by returning from a call rather than by calling), the *returns* (stays in a module the walk had
already left, by a call or a climb), and how often each module is *entered* (by a call).

    python scripts/config_walk.py [--trace] [--start orchestrator.run.launch.train] [--follow config]
"""

from __future__ import annotations

import argparse
import ast
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "pipelines")
Function = ast.FunctionDef | ast.AsyncFunctionDef
BUILTIN_TYPES = (dict, list, str, set, tuple, object, threading.Thread)


@dataclass
class Module:
    name: str
    tree: ast.Module
    functions: dict[str, Function] = field(default_factory=dict)  # "f" or "Class.method"
    classes: set[str] = field(default_factory=set)
    bindings: dict[str, str] = field(default_factory=dict)  # local name -> "module" or "module:attr"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def index() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            module = Module(name, ast.parse(path.read_text()))
            for node in module.tree.body:
                if isinstance(node, Function):
                    module.functions[node.name] = node
                elif isinstance(node, ast.ClassDef):
                    module.classes.add(node.name)
                    for item in node.body:
                        if isinstance(item, Function):
                            module.functions[f"{node.name}.{item.name}"] = item
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for alias in node.names:
                        module.bindings[alias.asname or alias.name] = f"{node.module}:{alias.name}"
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        module.bindings[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0])
            modules[name] = module
    return modules


class Walk:
    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        self.methods: dict[str, list[tuple[str, str]]] = {}  # method name -> [(module, "Class.method")]
        for module in modules.values():
            for qual in module.functions:
                if "." in qual:
                    self.methods.setdefault(qual.split(".")[1], []).append((module.name, qual))
        self.walked: set[tuple[str, str]] = set()
        self.stack: list[str] = []
        self.stays: list[tuple[str, bool, str]] = []  # (module, reached by a return, where)
        self._depth_at_last = 0

    # --- names ---------------------------------------------------------------------------------------------
    def resolve_binding(self, target: str, depth: int = 0) -> tuple[str, str] | None:
        """'module:attr' or 'module' -> (module, function) of the product, following re-exports."""
        if depth > 5:
            return None
        module_name, _, attr = target.partition(":")
        if not attr or module_name not in self.modules:
            return None
        if f"{module_name}.{attr}" in self.modules:
            return None  # a submodule, not a callable
        module = self.modules[module_name]
        if attr in module.functions:
            return module_name, attr
        if attr in module.classes:
            return (module_name, f"{attr}.__init__") if f"{attr}.__init__" in module.functions else None
        if attr in module.bindings:
            return self.resolve_binding(module.bindings[attr], depth + 1)
        return None

    def resolve_call(self, module: Module, cls: str | None, func: ast.expr, receiver_followed: bool
                     ) -> tuple[str, str] | None:
        if isinstance(func, ast.Name):
            if func.id in module.functions:
                return module.name, func.id
            if func.id in module.classes:
                init = f"{func.id}.__init__"
                return (module.name, init) if init in module.functions else None
            if func.id in module.bindings:
                return self.resolve_binding(module.bindings[func.id])
            return None
        if not isinstance(func, ast.Attribute):
            return None
        value = func.value
        if isinstance(value, ast.Name) and value.id in module.bindings and ":" not in module.bindings[value.id]:
            return self.resolve_binding(f"{module.bindings[value.id]}:{func.attr}")
        if isinstance(value, ast.Name) and value.id in module.bindings:  # `from pkg import module`
            whole = module.bindings[value.id].replace(":", ".")
            if whole in self.modules:
                return self.resolve_binding(f"{whole}:{func.attr}")
        if isinstance(value, ast.Name) and value.id == "self" and cls and f"{cls}.{func.attr}" in module.functions:
            return module.name, f"{cls}.{func.attr}"
        if receiver_followed and not any(hasattr(t, func.attr) for t in BUILTIN_TYPES):
            owners = self.methods.get(func.attr, [])  # a method of a followed value: the one class defining it
            return owners[0] if len(owners) == 1 else None
        return None

    def returns_config(self, module: Module, cls: str | None, node: ast.Call, followed: set[str]) -> bool:
        """A call on a followed value to a product function that returns a config (or a tuple holding one), or to
        orchestrator.config's own functions (the config as a dict, and back)."""
        if not _mentions(node, followed):
            return False
        receiver = isinstance(node.func, ast.Attribute) and _mentions(node.func.value, followed)
        target = self.resolve_call(module, cls, node.func, receiver)
        if target is None:
            return False
        if target[0].startswith("orchestrator.config"):
            return True  # a form of the config (to_dict, flatten) or one made from it
        returns = self.modules[target[0]].functions[target[1]].returns
        return returns is not None and "Config" in ast.unparse(returns)

    # --- the walk ----------------------------------------------------------------------------------------
    def stay(self, module: str, where: str) -> None:
        module = unit(module)
        returned = len(self.stack) < self._depth_at_last
        self._depth_at_last = len(self.stack)
        if not self.stays or self.stays[-1][0] != module:
            self.stays.append((module, returned, where))

    def enter(self, module_name: str, qual: str, followed: set[str]) -> None:
        self.stack.append(module_name)
        self.stay(module_name, qual)
        if (module_name, qual) not in self.walked:
            self.walked.add((module_name, qual))
            function = self.modules[module_name].functions[qual]
            cls = qual.split(".")[0] if "." in qual else None
            self.body(self.modules[module_name], cls, function.body, followed, qual)
        self.stack.pop()

    def body(self, module: Module, cls: str | None, statements: list[ast.stmt], followed: set[str],
             where: str) -> None:
        for statement in statements:
            for node in _in_order(statement):
                if isinstance(node, ast.Call):
                    self.call(module, cls, node, followed, where)
            for target, value in _assignments(statement):
                if isinstance(target, ast.Name) and value is not None and _part_of(value, followed):
                    followed.add(target.id)
                elif isinstance(value, ast.Call) and self.returns_config(module, cls, value, followed):
                    followed |= _names(target)

    def call(self, module: Module, cls: str | None, node: ast.Call, followed: set[str], where: str) -> None:
        receiver = isinstance(node.func, ast.Attribute) and _mentions(node.func.value, followed)
        positional = [_mentions(a, followed) for a in node.args]
        keywords = {k.arg: _mentions(k.value, followed) for k in node.keywords if k.arg}
        if not (receiver or any(positional) or any(keywords.values())):
            return
        target = self.resolve_call(module, cls, node.func, receiver)
        if target is None:
            return
        callee = self.modules[target[0]].functions[target[1]]
        params = [a.arg for a in callee.args.posonlyargs + callee.args.args + callee.args.kwonlyargs]
        if "." in target[1] and params[:1] in (["self"], ["cls"]):
            bound, params = params[0], params[1:]
        else:
            bound = None
        inner = {p for p, hit in zip(params, positional, strict=False) if hit}
        inner |= {k for k, hit in keywords.items() if hit and k in params}
        if receiver and bound:
            inner.add(bound)
        self.stay(module.name, where)
        self.enter(target[0], target[1], inner)
        self.stay(module.name, where)


def unit(module: str) -> str:
    """What a stay is counted in: a module of orchestrator/ (a package of it as one: config, tracking, doctor,
    training, tuning), and the data layer, pipelines/, as one."""
    parts = module.split(".")
    return parts[0] if parts[0] == "pipelines" else ".".join(parts[:2])


def _in_order(node: ast.AST) -> list[ast.AST]:
    """The nodes of a statement, children before their parent (a call's arguments are evaluated before it)."""
    out: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        out.extend(_in_order(child))
    out.append(node)
    return out


def _assignments(statement: ast.stmt) -> list[tuple[ast.expr, ast.expr | None]]:
    found: list[tuple[ast.expr, ast.expr | None]] = []
    for node in ast.walk(statement):
        if isinstance(node, ast.Assign):
            found += [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            found.append((node.target, node.value))
        elif isinstance(node, ast.NamedExpr):
            found.append((node.target, node.value))
        elif isinstance(node, ast.For | ast.comprehension):
            found.append((node.target, node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            found.append((node.optional_vars, node.context_expr))
    return found


def _part_of(node: ast.expr, followed: set[str]) -> bool:
    """The value is a followed name or a part of one (`config.train`, `tree["model"]`), or a choice between such."""
    if isinstance(node, ast.Name):
        return node.id in followed
    if isinstance(node, ast.Attribute | ast.Subscript):
        return _part_of(node.value, followed)
    if isinstance(node, ast.IfExp):
        return _part_of(node.body, followed) or _part_of(node.orelse, followed)
    if isinstance(node, ast.BoolOp):
        return any(_part_of(v, followed) for v in node.values)
    return False


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _mentions(node: ast.AST, followed: set[str]) -> bool:
    return bool(_names(node) & followed)


def walk(start: str, follow: str) -> Walk:
    module_name, _, qual = start.rpartition(".")
    w = Walk(index())
    w.enter(module_name, qual, {follow})
    return w


def counts(w: Walk) -> dict[str, int]:
    seen: set[str] = set()
    returns = 0
    for module, _, _ in w.stays:
        returns += module in seen
        seen.add(module)
    return {"modules": len(seen), "stays": len(w.stays), "climbs": sum(r for _, r, _ in w.stays),
            "returns": returns, "most_entries": max(entries(w).values())}


def entries(w: Walk) -> Counter[str]:
    """How often the walk enters each module by a call (a climb back up into it is a return, not an entry)."""
    return Counter(m for m, returned, _ in w.stays if not returned)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", default="orchestrator.run.launch.train")
    parser.add_argument("--follow", default="config")
    parser.add_argument("--trace", action="store_true", help="print every stay")
    args = parser.parse_args(argv)
    w = walk(args.start, args.follow)
    if args.trace:
        for module, returned, where in w.stays:
            print(f"{'<-' if returned else '->'} {module} ({where})")
    c = counts(w)
    print(f"from {args.start}, following '{args.follow}': {c['modules']} modules entered in {c['stays']} stays, "
          f"{c['climbs']} climbs back up, {c['returns']} returns to a module already left")
    print("entries per module: " + ", ".join(f"{m} {n}" for m, n in entries(w).most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
