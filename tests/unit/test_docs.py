"""The documentation stays true to the repository: links resolve, config keys exist, example configs load.

Scanned: README.md, cluster/README.md and docs/*.md. Checked:
- every relative link points at an existing file, and every `#anchor` at a heading of the file it names;
- every repository file the text names without a link (`bench/sync.py`, `NOTES.md`) exists;
- README's table of contents lists every `##` section (so a new section is not left out of it);
- every config key the prose names in backticks (`section.key`, for the sections of orchestrator.config.Config), and
  every `--set section.key=...` in a command block, is a key of the config tree (`model.<option>` may also be an
  option of a built-in model or of a builder in examples/models.py);
- every examples/*.yaml loads with `orchestrator.config.load_config`.
The checkers themselves are tested on planted mistakes at the bottom, so a green run means something.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from orchestrator.config import Config, ModelConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "cluster" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

SECTIONS = ("model", "task", "data", "train", "optim", "scaling", "checkpoint", "storage", "failure", "tracking",
            "tune", "cost", "autopilot")
# Keys the docs name on purpose although they do not exist (an example of the error message for a typo).
DELIBERATELY_WRONG = {"optim.lrr"}
# MLflow names of an autopilot run that share the config section's prefix: its table artifact and the params of the
# settings it chose (`autopilot.<train key>`, autopilot_report.py).
AUTOPILOT_MLFLOW_NAMES = {"autopilot.json", "autopilot.micro_batch_size"}

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
KEY = re.compile(r"(?<![\w./\-])(" + "|".join(SECTIONS) + r")\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
MENTION = re.compile(r"(?<![\w./\-<])((?:orchestrator|pipelines|tests|bench|scripts|cluster|examples|docs)/[\w./\-]*\w"
                     r"|[A-Z][A-Z0-9_]*\.md)(?![\w/<*{])")
SET_KEY = re.compile(r"(?:--set|-s)[ =]+[\"']?([A-Za-z_][\w.]*)=")


# --------------------------------------------------------------------------- parsing


def prose(text: str) -> str:
    """The text without fenced code blocks (their lines blanked, so line numbers stay put)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def fenced(text: str) -> list[str]:
    return [m.group(0) for m in FENCE.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(prose(text)):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[str]:
    """Link targets in the prose (not in code blocks or code spans)."""
    return [m.group(1) for m in LINK.finditer(INLINE_CODE.sub("", prose(text)))]


def link_problems(path: Path, text: str) -> list[str]:
    problems = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}: link ({target})"
        if file_part and not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md":
            headings = anchors(dest.read_text(encoding="utf-8") if file_part else text)
            if anchor not in headings:
                problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return problems


def mentioned_files(text: str) -> list[str]:
    """Repository files the text names without linking them: paths under the top-level folders (`bench/sync.py`,
    `examples/cluster-gpu.yaml`) and upper-case Markdown names (`README.md`), wildcards and placeholders aside."""
    return sorted(set(MENTION.findall(text)))


def mention_problems(path: Path, text: str) -> list[str]:
    return [f"{path.relative_to(ROOT)} names {name}, which does not exist" for name in mentioned_files(text)
            if not (ROOT / name).exists() and not (path.parent / name).exists()]


def named_keys(text: str) -> list[str]:
    """Config keys named in code spans of the prose, and in `--set key=value` inside command blocks."""
    keys = [m.group(0) for span in INLINE_CODE.finditer(prose(text)) for m in KEY.finditer(span.group(2))]
    for block in fenced(text):
        keys += [m.group(1) for m in SET_KEY.finditer(block) if m.group(1).split(".")[0] in SECTIONS]
    return keys


# --------------------------------------------------------------------------- the config tree


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (X, X | None, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _is_mapping(annotation: Any) -> bool:
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    return any(typing.get_origin(a) is dict or a is dict for a in (annotation, *args))


@cache
def model_options() -> frozenset[str]:
    """Options a `model:` section may carry besides ModelConfig's fields: the keyword arguments of the built-in
    models (orchestrator/models/zoo.py) and of the example builders (examples/models.py)."""
    import importlib.util

    from orchestrator.models.zoo import MODELS

    # By its path: this test needs no particular working directory or sys.path.
    spec = importlib.util.spec_from_file_location("example_models", ROOT / "examples" / "models.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    builders = [MODELS.get(name) for name in MODELS.names()]
    builders += [f for _, f in inspect.getmembers(example, inspect.isfunction)
                 if f.__module__ == example.__name__ and not f.__name__.startswith("_")]
    return frozenset(p for b in builders for p in inspect.signature(b).parameters
                     if p not in ("self", "in_features", "num_classes"))


def key_problem(key: str) -> str | None:
    """None if `key` (dotted) is a key of the config tree, else why not."""
    if key in DELIBERATELY_WRONG or key in AUTOPILOT_MLFLOW_NAMES:
        return None
    parts = key.split(".")
    model: type[BaseModel] = Config
    for i, part in enumerate(parts):
        if part not in model.model_fields:
            if model is ModelConfig and i == 1 and part in model_options():
                return None if len(parts) == 2 else f"{key}: a model option has no sub-keys"
            return f"{key}: no key '{part}' in {'.'.join(parts[:i]) or 'the config'}"
        annotation = model.model_fields[part].annotation
        nested = _models_in(annotation)
        if i == len(parts) - 1:
            return None
        if nested:
            model = nested[0]
        elif _is_mapping(annotation):
            return None  # e.g. tune.space.<dotted key>: a free mapping
        else:
            return f"{key}: '{'.'.join(parts[: i + 1])}' is a value, it has no sub-keys"
    return None


# --------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(path: Path) -> None:
    problems = link_problems(path, path.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_the_docs_name_exist(path: Path) -> None:
    problems = mention_problems(path, path.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_readme_contents_lists_every_section() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = prose(text)
    contents = re.search(r"^## Contents\n(.*?)(?=^## )", body, re.S | re.M)
    assert contents, "README.md has no '## Contents' section"
    listed = {target[1:] for target in links(contents.group(1)) if target.startswith("#")}
    sections = [m.group(2) for m in HEADING.finditer(body) if m.group(1) == "##" and m.group(2) != "Contents"]
    missing = [s for s in sections if slug(s) not in listed]
    assert missing == [], f"add these sections to README's Contents: {missing}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_keys_named_in_docs_exist(path: Path) -> None:
    keys = named_keys(path.read_text(encoding="utf-8"))
    problems = sorted({p for k in keys if (p := key_problem(k))})
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    load_config(path)


def test_the_recipe_config_is_an_example() -> None:
    assert (ROOT / "examples" / "cluster-gpu.yaml") in EXAMPLES
    assert "examples/cluster-gpu.yaml" in (ROOT / "README.md").read_text(encoding="utf-8")


# --------------------------------------------------------------------------- the checkers catch planted mistakes


def test_link_check_catches_a_missing_file_and_a_missing_anchor() -> None:
    text = "# Title\n\n## Real section\n\nSee [x](docs/no-such-file.md), [y](#no-such-heading), [z](#real-section)," \
           " [ok](cluster/README.md#mlflow-tracking-server), [w](cluster/README.md#nope), [web](https://x.org/a).\n" \
           "```\n[in code](nowhere.md)\n```\n"
    problems = link_problems(ROOT / "README.md", text)
    assert len(problems) == 3, problems
    assert "docs/no-such-file.md does not exist" in problems[0]
    assert "no heading #no-such-heading" in problems[1]
    assert "no heading #nope in cluster/README.md" in problems[2]


def test_file_check_catches_a_missing_file() -> None:
    text = ("See RAY_2_60_NOTES.md, `bench/no_such_bench.py` and examples/nope.yaml; fine: README.md, "
            "`examples/cluster-gpu.yaml`, `orchestrator/*.py`, runs/<run>/config.yaml, docs/ray-notes.md.\n")
    problems = mention_problems(ROOT / "README.md", text)
    assert [p.split(" names ")[1].split(",")[0] for p in problems] == [
        "RAY_2_60_NOTES.md", "bench/no_such_bench.py", "examples/nope.yaml"]


def test_slugs_follow_github() -> None:
    assert slug("Reliability: resume, checkpoints, node loss, elastic scaling") == (
        "reliability-resume-checkpoints-node-loss-elastic-scaling")
    assert slug("`orchestrator doctor`: what to change") == "orchestrator-doctor-what-to-change"
    assert slug("A killed driver: `--resume`") == "a-killed-driver---resume"
    assert anchors("## Same\n\n## Same\n") == {"same", "same-1"}


def test_key_check_catches_unknown_keys() -> None:
    text = ("Set `optim.lr`, `data.s3.max_attempts`, `model.hidden`, `model.entrypoint`, `scaling.accelerator_type`,"
            " `tune.space` and `--set train.seed=1`; not `orchestrator/tracking.py` nor `ray.train.report`.\n"
            "Bad: `scaling.accelerator`, `model.no_such_option`, `data.s3.nope`, `train.seed.x`.\n"
            "```bash\norchestrator train --set optim.lr=1e-3 --set optim.learning_rate=1e-3\n```\n")
    keys = named_keys(text)
    assert "train.report" not in keys and "tracking.py" not in keys
    problems = sorted(p for k in keys if (p := key_problem(k)))
    assert [p.split(":")[0] for p in problems] == [
        "data.s3.nope", "model.no_such_option", "optim.learning_rate", "scaling.accelerator", "train.seed.x"]
