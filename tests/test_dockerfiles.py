"""The container images (docker/*.Dockerfile), checked without a container engine.

Parsed, not built (tests/images/ builds and runs them where podman works): every COPY
source exists and is in the build context (.dockerignore), the kvserve image installs
the project with README.md's install command after PyTorch from the CUDA index matching
its default base image, the building machine's pip settings reach only the build stages
and only as build arguments, a secret and build mounts, the entrypoints are real
console scripts, the final stages run as a non-root uid with no build tools and carry
the project's version, and the operator image installs exactly the third-party packages
that ``kvserve_operator`` imports (and not torch).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
KVSERVE = REPO / "docker" / "kvserve.Dockerfile"
OPERATOR = REPO / "docker" / "operator.Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
BUILD_TOOLS = {
    "gcc",
    "g++",
    "clang",
    "make",
    "cmake",
    "build-essential",
    "python3-dev",
    "python3-pip",
    "python3-venv",
    "git",
    "cuda-toolkit",
    "cuda-nvcc",
}


# ----------------------------------------------------------------------------- parsing


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, args)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        (stage,) = (s for s in self.stages if s.name == name)
        return stage

    def expand(self, text: str) -> str:
        def value(m: re.Match[str]) -> str:
            return self.global_args.get(m[1] or m[2], m[0])

        return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def parse(path: Path) -> Dockerfile:
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert instruction == "ARG", f"{path}: {instruction} before the first FROM"
            key, _, default = args.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append((instruction, args.strip()))
    return Dockerfile(global_args, stages)


def copy_sources(stage: Stage) -> list[str]:
    """Sources of the stage's COPY instructions that read the build context."""
    out = []
    for args in stage.args("COPY"):
        words = args.split()
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        out += words[:-1]
    return out


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + "$")


def dockerignore_excludes(path: str) -> bool:
    """Docker's .dockerignore rules (the last matching pattern wins; a pattern that
    matches a directory covers what is below it), enough for this repository's file."""
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").rstrip("/"))
        if any(regex.match(p) for p in prefixes):
            excluded = not negate
    return excluded


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dockerfile", [KVSERVE, OPERATOR], ids=lambda p: p.name)
def test_copy_sources_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    sources = [s for stage in parse(dockerfile).stages for s in copy_sources(stage)]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
        assert not dockerignore_excludes(source), f"{source} is excluded by .dockerignore"
    # setuptools reads the readme named in pyproject.toml: it must be copied too.
    assert PYPROJECT["project"]["readme"] in sources


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "charts/kvserve/Chart.yaml"):
        assert dockerignore_excludes(path), path
    for path in ("service/kvserve/cli.py", "operator/kvserve_operator/render.py", "pyproject.toml"):
        assert not dockerignore_excludes(path), path
    for path in ("service/kvserve/__pycache__/cli.cpython-311.pyc", "kvserve.egg-info/PKG-INFO"):
        assert dockerignore_excludes(path), path


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


KVSERVE_INSTALL = "pip install --no-deps --target /opt/kvserve/lib ."


def test_kvserve_image_installs_with_the_readmes_command_after_cuda_torch() -> None:
    df = parse(KVSERVE)
    runtime, build = df.stage("runtime"), df.stage("build")
    assert build.base == "runtime" and df.final.base == "runtime"
    runs = runtime.args("RUN")
    section = readme_section("Container images")
    assert any(
        re.search(rf"(^|&& ){re.escape(KVSERVE_INSTALL)}( |$)", r) for r in build.args("RUN")
    ), "the Dockerfile must RUN exactly the README's install command"
    assert re.search(rf"^\s*{re.escape(KVSERVE_INSTALL)}\s*$", section, re.M), (
        "README.md's 'Container images' section must show the install command on its own line"
    )
    torch = next(r for r in runs if re.search(r"\bpip install\b.*\btorch$", r))
    requirements = next(r for r in runs if "install --no-index -r /tmp/deps/requirements.txt" in r)
    assert runs.index(torch) < runs.index(requirements), "torch (CUDA build) must come first"
    assert '--index-url "$TORCH_INDEX_URL"' in torch
    index = df.global_args["TORCH_INDEX_URL"]
    assert index.startswith("https://download.pytorch.org/whl/cu")
    cuda = re.fullmatch(r"cu(\d+)(\d)", index.rsplit("/", 1)[1])
    assert cuda is not None
    base = df.expand(runtime.base)
    assert base.startswith("nvidia/cuda:"), base
    assert base.split(":")[1].startswith(f"{cuda[1]}.{cuda[2]}."), (base, index)
    assert df.expand(df.stage("pip").base) == base
    # The final image has the demo model at the path the chart's examples use.
    assert any("/opt/kvserve/demo-model" in r for r in build.args("RUN"))


def test_operator_image_installs_the_project_without_dependencies() -> None:
    df = parse(OPERATOR)
    runs = " && ".join(df.stage("build").args("RUN"))
    assert "pip install --no-deps ." in runs
    assert "torch" not in runs and "transformers" not in runs
    assert df.expand(df.stage("build").base).startswith("python:3.")
    assert "slim" in df.expand(df.stage("build").base)


# Build contexts docker/build passes (bind mounts of the build) and the secrets it passes.
BUILD_SCRIPT = REPO / "docker" / "build"


def final_chain(df: Dockerfile) -> list[Stage]:
    """The final stage and the stages it is built on (FROM a stage): the image's layers."""
    names = {s.name: s for s in df.stages if s.name}
    chain = [df.final]
    while chain[-1].base in names:
        chain.append(names[chain[-1].base])
    return chain


@pytest.mark.parametrize("dockerfile", [KVSERVE, OPERATOR], ids=lambda p: p.name)
def test_machine_settings_reach_no_layer_and_no_history(dockerfile: Path) -> None:
    df = parse(dockerfile)
    script = BUILD_SCRIPT.read_text()
    contexts = set(re.findall(r'--build-context "(\w[\w-]*)=', script))
    assert {"pip-cache", "find-links"} <= contexts
    assert '--secret "id=pip-cert,src=$PIP_CERT"' in script
    assert '--secret "id=pip-env,src=$env_file"' in script
    # Every build context the Dockerfile mounts has an empty stage of that name, so a
    # plain `docker build` without docker/build still works.
    empty = {s.name for s in df.stages if s.base == "scratch" and not s.instructions}
    stages = {s.name for s in df.stages if s.name} - empty
    for stage in df.stages:
        for run in stage.args("RUN"):
            mounted = set(re.findall(r"--mount=type=bind,from=([\w-]+)", run))
            assert mounted - stages <= empty & contexts, (stage.name, mounted)
            if re.search(r"\bpip (install|download)\b", run):
                assert {"pip-cache", "find-links"} <= mounted, run
                for secret in ("pip-cert", "pip-env"):
                    assert f"--mount=type=secret,id={secret}" in run, run
                assert ". /run/secrets/pip-env" in run, run
                assert "PIP_CERT=/run/secrets/pip-cert" in run, run
    # Build arguments are recorded in the history of the layers whose RUN uses them: no
    # pip setting is one. Nothing of the image's own stages is copied from the context
    # but the project (no CA file, no pip configuration).
    for stage in df.stages:
        for arg in stage.args("ARG"):
            assert not arg.startswith("PIP_"), (stage.name, arg)
        for env in stage.args("ENV"):
            assert not re.search(r"\bPIP_(INDEX|EXTRA|TRUSTED|FIND|CERT|CONFIG)", env), env
    for stage in final_chain(df):
        for copy in stage.args("COPY"):
            words = [w for w in copy.split() if not w.startswith("--")]
            if not copy.startswith("--from="):
                assert set(words[:-1]) <= {"pyproject.toml", "README.md", "service/", "operator/"}
    # pip is not in the final image: the kvserve image's environment is made without it
    # (its installs run pip from its wheel, then remove it); the operator's removes it.
    runs = " ".join(r for s in final_chain(df) for r in s.args("RUN"))
    if "venv --without-pip" in runs:
        assert re.search(r"rm -rf [^&]*/tmp/pip\b", runs), "pip's wheel must be removed"
    else:
        assert "pip uninstall --yes pip" in " ".join(df.stage("build").args("RUN"))


def operator_packages() -> dict[str, str]:
    """Distribution name (normalized) → version specifier, from the operator Dockerfile."""
    runs = " ".join(parse(OPERATOR).stage("build").args("RUN"))
    out = {}
    for spec in re.findall(r'"([A-Za-z0-9_.-]+[<>=!~][^"]*)"', runs):
        name = re.split(r"[<>=!~]", spec, maxsplit=1)[0]
        out[normalize(name)] = spec[len(name) :]
    return out


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PROBE = """
import ast, json, sys
import kvserve_operator.handlers, kvserve_operator.__main__
first = sorted(m for m in sys.modules if m.split(".")[0] in ("kvserve", "kvserve_operator"))
eager, lazy = set(), set()
for name in first:
    path = getattr(sys.modules[name], "__file__", None)
    if not path:
        continue
    tree = ast.parse(open(path).read())
    in_functions = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
    }
    type_checking_only = {  # `if TYPE_CHECKING:` blocks never run
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, ast.If) and "TYPE_CHECKING" in ast.unparse(f.test)
        for n in ast.walk(f)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if id(node) in type_checking_only:
            continue
        for n in names:
            top = n.split(".")[0]
            if top in sys.stdlib_module_names or top in ("kvserve", "kvserve_operator"):
                continue
            if top == "__future__":
                continue
            (lazy if id(node) in in_functions else eager).add(top)
print(json.dumps({"loaded": sorted({m.split(".")[0] for m in sys.modules}),
                  "eager": sorted(eager), "lazy": sorted(lazy - eager)}))
"""
# Imported only inside functions the operator never calls.
NOT_FOR_THE_OPERATOR = {
    "huggingface_hub": "kvserve.model.pull downloads hf:// sources in the engine pods' init "
    "container (the kvserve image); the operator only parses sources",
    "torch": "kvserve.config makes the engine's torch dtypes and devices; the operator only "
    "reads the engine's option schema from it",
}


def test_operator_image_has_exactly_the_packages_the_operator_imports() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    found = json.loads(proc.stdout)
    for heavy in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "fastapi"):
        assert heavy not in found["loaded"], f"importing the operator imports {heavy}"
    distributions = metadata.packages_distributions()
    imported: dict[str, str] = {}
    for module in found["eager"]:
        (dist,) = {normalize(d) for d in distributions[module]}
        imported[dist] = module
    packages = operator_packages()
    assert set(packages) == set(imported), (
        f"operator.Dockerfile installs {sorted(packages)}, kvserve_operator imports "
        f"{sorted(imported)} (modules {sorted(imported.values())})"
    )
    for module in found["lazy"]:
        dist = normalize(next(iter(distributions.get(module, [module]))))
        assert dist in packages or module in NOT_FOR_THE_OPERATOR, (
            f"{module} is imported lazily by the operator's code but not installed"
        )
    # The version bounds are the project's own.
    declared = {}
    for requirement in (
        PYPROJECT["project"]["dependencies"]
        + PYPROJECT["project"]["optional-dependencies"]["operator"]
    ):
        name = re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0]
        declared[normalize(name)] = requirement[len(name) :].split("#")[0].strip()
    for dist, spec in packages.items():
        if dist in declared:
            assert spec == declared[dist], (dist, spec, declared[dist])


def console_scripts() -> dict[str, str]:
    return dict(PYPROJECT["project"]["scripts"])


@pytest.mark.parametrize(
    ("dockerfile", "script"), [(KVSERVE, "kvserve"), (OPERATOR, "kvserve-operator")]
)
def test_entrypoints_are_console_scripts(dockerfile: Path, script: str) -> None:
    final = parse(dockerfile).final
    (entrypoint,) = final.args("ENTRYPOINT")
    assert json.loads(entrypoint) == [script]
    assert script in console_scripts()
    assert final.args("ENV") and any("/opt/venv/bin:$PATH" in e for e in final.args("ENV"))
    if dockerfile == KVSERVE:
        from kvserve.server.main import add_arguments

        (cmd,) = final.args("CMD")
        command, *args = json.loads(cmd)
        assert command == "serve"
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        assert parser.parse_args(args).host == "0.0.0.0"


@pytest.mark.parametrize("dockerfile", [KVSERVE, OPERATOR], ids=lambda p: p.name)
def test_final_stage_is_non_root_without_build_tools_and_labelled(dockerfile: Path) -> None:
    df = parse(dockerfile)
    assert len(df.stages) >= 2, "multi-stage: build, then a clean final stage"
    final = df.final
    assert final.args("USER") == ["1000:1000"], "a numeric non-root uid:gid (runAsNonRoot)"
    assert any(a.startswith("--from=build") for a in final.args("COPY"))
    chain = final_chain(df)
    for run in (r for stage in chain for r in stage.args("RUN")):
        if re.search(r"\bpip install\b", run):
            # Only pip run from its wheel, copied in for the install and removed after.
            assert "pip() { /opt/venv/bin/python /tmp/pip/pip.whl/pip" in run, run
        installed = set()
        for m in re.finditer(r"apt-get install ([^&;]*)", run):
            installed |= {w for w in m[1].split() if not w.startswith("-")}
        assert not installed & BUILD_TOOLS, installed & BUILD_TOOLS
    assert df.global_args["VERSION"] == VERSION
    assert "VERSION" in final.args("ARG")
    labels = " ".join(final.args("LABEL"))
    assert 'org.opencontainers.image.version="${VERSION}"' in labels
    assert "org.opencontainers.image.source=" in labels
    # The user the chart and the operator's engine pods run as.
    assert any("useradd --uid 1000 --gid 1000" in r for stage in chain for r in stage.args("RUN"))


def test_chart_defaults_are_the_images_these_build() -> None:
    values = yaml.safe_load((REPO / "charts" / "kvserve" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "kvserve" / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
    section = readme_section("Container images")
    for dockerfile, image in (
        (KVSERVE, values["images"]["kvserve"]),
        (OPERATOR, values["images"]["operator"]),
    ):
        assert image["tag"] in ("", VERSION)
        ref = f"{image['repository']}:{VERSION}"
        rel = dockerfile.relative_to(REPO)
        assert f"-f {rel} -t {ref} ." in section, f"README must show how {ref} is built"
        assert f"-t {ref} ." in dockerfile.read_text(), f"{rel}'s header names {ref}"
    from kvserve_operator.render import OperatorSettings

    assert (
        OperatorSettings().engine_image == f"{values['images']['kvserve']['repository']}:{VERSION}"
    )


# ------------------------------------------- what the images' commands import, installed


def closure(requirements: list[str]) -> set[str]:
    """The distributions ``pip install`` of these requirements brings (from the installed
    packages' metadata), normalized; extras are not followed."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [Requirement(r.split("#")[0].strip()) for r in requirements]
    while todo:
        req = todo.pop()
        name = normalize(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(req.name) or []]
    return seen


# Runs ``sys.argv[2]`` with every third-party package outside ``sys.argv[1]`` (JSON list of
# distributions) unimportable, like in the image; then imports, under the same rule, every
# third-party module that the loaded first-party code imports inside functions.
IN_IMAGE = r"""
import ast, importlib, importlib.abc, importlib.metadata as md, importlib.util, json, re, sys
allowed = set(json.loads(sys.argv[1]))
first_party = {"kvserve", "kvserve_operator"}
dists = md.packages_distributions()
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()

class NotInImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if path is not None or top in sys.stdlib_module_names or top in first_party:
            return None
        owners = {norm(d) for d in dists.get(top, [])}
        if owners and not owners & allowed:
            raise ModuleNotFoundError(f"No module named {top!r} ({sorted(owners)} not installed)")
        return None

sys.meta_path.insert(0, NotInImage())

# Libraries probe optional packages with importlib.util.find_spec (transformers does for
# accelerate); in the image that answers None for what is not installed, so it does here.
_find_spec = importlib.util.find_spec
def find_spec(name, package=None):
    top = name.split(".")[0]
    owners = {norm(d) for d in dists.get(top, [])}
    if top not in first_party and owners and not owners & allowed:
        return None
    return _find_spec(name, package)
importlib.util.find_spec = find_spec
exec(sys.argv[2])
lazy = set()
for name in [m for m in sys.modules if m.split(".")[0] in first_party]:
    path = getattr(sys.modules[name], "__file__", None)
    if not path:
        continue
    for f in ast.walk(ast.parse(open(path).read())):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(f):
                if isinstance(node, ast.Import):
                    lazy |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    lazy.add(node.module)
skip = set(json.loads(sys.argv[3]))
for module in sorted(lazy):
    top = module.split(".")[0]
    if top not in first_party and top != "__future__" and top not in skip:
        importlib.import_module(top)
print("ok")
"""

KVSERVE_COMMANDS = """
from kvserve.cli import build_parser
parser = build_parser()
parser.parse_args(["serve", "--host", "0.0.0.0"])
parser.parse_args(["gateway", "--config", "/etc/kvserve/gateway.yaml"])
parser.parse_args(["model", "pull", "hf://org/name", "/models/x"])
import kvserve.server.app, kvserve.gateway.app, kvserve.gateway.discovery, kvserve.model.pull
"""
OPERATOR_COMMANDS = """
from kvserve_operator.__main__ import build_parser
import kvserve_operator.handlers
build_parser().parse_args(["--engine-image", "x", "--log-format", "json"])
import kubernetes.client, kubernetes.config  # the chart's cleanup hook
"""
# Lazy imports of code paths an image does not run.
NOT_RUN_IN_THE_KVSERVE_IMAGE = {
    "httpx": "kvserve bench's HTTP clients (lazy imports), not what the image runs",
    "matplotlib": "kvserve bench suite's plots (lazy; skipped with a message when absent)",
}


def run_in_image(
    allowed: set[str], code: str, skip: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            IN_IMAGE,
            json.dumps(sorted(allowed)),
            code,
            json.dumps(sorted(skip)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_kvserve_image_runs_its_commands_with_only_the_projects_dependencies() -> None:
    allowed = closure(PYPROJECT["project"]["dependencies"]) | {"kvserve"}
    proc = run_in_image(allowed, KVSERVE_COMMANDS, NOT_RUN_IN_THE_KVSERVE_IMAGE)
    if "ModuleNotFoundError" in proc.stderr:
        raise ModuleNotFoundError(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_operator_image_runs_the_operator_with_only_its_packages() -> None:
    packages = operator_packages()
    allowed = closure([name + spec for name, spec in packages.items()]) | {"kvserve"}
    proc = run_in_image(allowed, OPERATOR_COMMANDS, NOT_FOR_THE_OPERATOR)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
