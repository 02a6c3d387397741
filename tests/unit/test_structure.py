"""The shape of the code: imports flow one way, core <- capture <- dataset <- train/serve <- loop <- CLI; a stage
imports another only through that stage's face; modules share public names only; no two modules import each other,
however indirectly; every package says what it is."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

from lcap.faces import face_names

ROOT = Path(__file__).resolve().parents[2]
# A stage may import the core, itself and the stages of lower layers; train and serve are peers and
# import neither each other nor anything above them, and so are loop and ui.
LAYERS = {"core": 0, "capture": 1, "dataset": 2, "train": 3, "serve": 3, "loop": 4, "ui": 4, "cli": 5}
STAGES = ("capture", "dataset", "train", "serve", "loop", "ui")


def _package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in config.items()}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in _package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] == "vllm_plugin":  # runs inside vLLM's venv, not an lcap module
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def stage_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] in (["lcap", "cli"], ["lcap", "__main__"]):
        return "cli"
    if len(parts) > 1 and parts[1] in STAGES:
        return parts[1]
    return "core"


def face(stage: str) -> dict[str, tuple[str, str]]:
    """The names a stage shows other stages (its `__init__.pyi`), each with the module it comes from."""
    return face_names(_package_dirs()[f"lcap.{stage}"] / "__init__.pyi")


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every `lcap...` module a file imports, at the top or inside a function; a name taken from a stage's face
    counts as an import of the module the face takes it from."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "lcap")
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "lcap"
        ):
            named = {f"{node.module}.{a.name}" for a in node.names} & known  # `from lcap import cli` names a module
            shown = (
                face(node.module.split(".")[1])
                if node.module.count(".") == 1 and stage_of(node.module) in STAGES
                else {}
            )
            named |= {shown[a.name][0] for a in node.names if a.name in shown}
            found.update(named or {node.module})
    return found


def violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    known = set(_modules())
    for module, path in sorted(modules.items()):
        mine = stage_of(module)
        for target in sorted(imports_of(path, known)):
            theirs = stage_of(target)
            if theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    return bad


def test_imports_flow_one_way():
    modules = _modules()
    assert {stage_of(m) for m in modules} == set(LAYERS), "every layer has modules"
    assert violations(modules) == []


def test_the_check_sees_a_backward_import(tmp_path):
    """The check above would fail on the cycles the layout forbids (a stage importing the CLI, or a later stage)."""
    capture = tmp_path / "capture.py"
    capture.write_text("def f():\n    from lcap.dataset.build.builder import build_dataset\n")
    serve = tmp_path / "serve.py"
    serve.write_text("from lcap.train.grpo import TrainOptions\n")
    dataset = tmp_path / "dataset.py"
    dataset.write_text("from lcap import cli\nimport lcap.cli\n")
    found = violations({"lcap.capture.x": capture, "lcap.serve.x": serve, "lcap.dataset.x": dataset})
    assert found == [
        "lcap.capture.x (capture) imports lcap.dataset.build.builder (dataset)",
        "lcap.dataset.x (dataset) imports lcap.cli (cli)",
        "lcap.serve.x (serve) imports lcap.train.grpo (train)",
    ]


def private_imports(modules: dict[str, Path]) -> list[str]:
    """Every underscore name a module imports from another module (a module named with an underscore is no name)."""
    bad = []
    for module, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module != module):
                continue
            if node.module.split(".")[0] != "lcap":
                continue
            for alias in node.names:
                if alias.name.startswith("_") and f"{node.module}.{alias.name}" not in modules:
                    bad.append(f"{module} imports {alias.name} from {node.module}")
    return bad


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (every lcap import counts: at the
    top, inside a function, or for type checking only), each sorted."""
    known = set(modules)
    graph = {m: sorted((imports_of(path, known) & known) - {m}) for m, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def packages_without_docstring(modules: dict[str, Path]) -> list[str]:
    """Packages whose __init__.py does not open with a docstring (what the package owns and may import)."""
    return sorted(
        module
        for module, path in modules.items()
        if path.name == "__init__.py" and not ast.get_docstring(ast.parse(path.read_text(), str(path)))
    )


def test_modules_share_public_names_only():
    assert private_imports(_modules()) == []


def test_the_check_sees_a_private_import(tmp_path):
    (tmp_path / "a.py").write_text(
        "from lcap.x.b import _hidden, shown\nfrom lcap.x.a import _mine\nfrom lcap.x import _sub\n"
        "def f():\n    from lcap.x.c import _late\n"
    )
    (tmp_path / "b.py").write_text("_hidden = shown = 1\n")
    (tmp_path / "c.py").write_text("from json import _default_encoder\n")
    (tmp_path / "_sub.py").write_text("")
    modules = {f"lcap.x.{name}": tmp_path / f"{name}.py" for name in ("a", "b", "c", "_sub")}
    assert private_imports(modules) == [
        "lcap.x.a imports _hidden from lcap.x.b",
        "lcap.x.a imports _late from lcap.x.c",
    ]


def test_no_import_cycles():
    assert import_cycles(_modules()) == []


def test_the_check_sees_an_import_cycle(tmp_path):
    """A cycle counts however it is made: through a function's import, a third module, or type checking alone."""
    files = {
        "a": "from lcap.x.b import f\n",
        "b": "def f():\n    from lcap.x.a import g\n",
        "c": "import lcap.x.d\n",
        "d": "from lcap.x import e\n",
        "e": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lcap.x.c import C\n",
        "f": "from lcap.x.a import g\nfrom lcap.x.f import h\n",  # imports a cycle's member, and itself: no cycle
    }
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    modules = {f"lcap.x.{name}": tmp_path / f"{name}.py" for name in files}
    assert import_cycles(modules) == [["lcap.x.a", "lcap.x.b"], ["lcap.x.c", "lcap.x.d", "lcap.x.e"]]


def test_each_package_opens_with_a_docstring():
    modules = _modules()
    assert sum(path.name == "__init__.py" for path in modules.values()) > len(STAGES), "sub-packages are seen"
    assert packages_without_docstring(modules) == []


def test_the_check_sees_a_package_without_a_docstring(tmp_path):
    for name, text in {
        "said": '"""What it owns; what it may import."""\n',
        "bare": "",
        "late": 'x = 1\n"""Late."""\n',
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(text)
    (tmp_path / "said" / "mod.py").write_text("x = 1\n")
    modules = {f"lcap.{name}": tmp_path / name / "__init__.py" for name in ("said", "bare", "late")}
    modules["lcap.said.mod"] = tmp_path / "said" / "mod.py"
    assert packages_without_docstring(modules) == ["lcap.bare", "lcap.late"]


def record_writers(modules: dict[str, Path]) -> list[str]:
    """Every module but lcap.policy that names `write_policy`, the record's write without publish's wait."""
    return sorted(
        module
        for module, path in modules.items()
        if module != "lcap.policy"
        and any(
            (isinstance(node, ast.alias) and node.name == "write_policy")
            or (isinstance(node, ast.Attribute) and node.attr == "write_policy")
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
        )
    )


def test_the_policy_record_has_one_publisher():
    """Whatever changes the running policy calls lcap.policy.publish, which returns once every router routes by it."""
    assert record_writers(_modules()) == []


def test_the_check_sees_a_writer_of_the_record(tmp_path):
    files = {"a": "from lcap.policy import write_policy\n", "b": "import lcap.policy\nlcap.policy.write_policy(r)\n"}
    files["c"] = "from lcap.policy import publish\npublish(r)\n"
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    assert record_writers({f"lcap.x.{name}": tmp_path / f"{name}.py" for name in files}) == ["lcap.x.a", "lcap.x.b"]


def past_faces(modules: dict[str, Path]) -> list[str]:
    """Every import of another stage that does not go through its face: a module inside the stage, or a name its face
    does not list. The CLI alone imports a stage's `commands` module, to register it."""
    bad = []
    for module, path in sorted(modules.items()):
        mine = stage_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from lcap.x import module` imports that module
                targets = [
                    (f"{node.module}.{a.name}", None) if f"{node.module}.{a.name}" in modules else (node.module, a.name)
                    for a in node.names
                ]
            else:
                continue
            for target, name in targets:
                theirs = stage_of(target)
                if target.split(".")[0] != "lcap" or theirs not in STAGES or theirs == mine:
                    continue
                if mine == "cli" and target == f"lcap.{theirs}.commands":
                    continue
                if target != f"lcap.{theirs}" or name is None:
                    bad.append(f"{module} imports {target}{f'.{name}' if name else ''} past lcap.{theirs}'s face")
                elif name not in face(theirs):
                    bad.append(f"{module} imports {name}, which lcap.{theirs}'s face does not show")
    return bad


def test_stages_import_each_other_through_their_faces():
    assert past_faces(_modules()) == []


def test_the_check_sees_an_import_past_a_face(tmp_path):
    (tmp_path / "a.py").write_text(
        "from lcap.capture import ProxyOptions\nfrom lcap.capture.proxy.server import CaptureProxy\n"
        "import lcap.capture.sandbox\nfrom lcap.dataset.x import y\n"
        "def f():\n    from lcap.capture import _hidden_thing\n"
    )
    (tmp_path / "cli.py").write_text(
        "from lcap.capture import commands\nfrom lcap.ui.commands import register\nfrom lcap.serve.server import s\n"
    )
    (tmp_path / "commands.py").write_text("")
    modules = {"lcap.dataset.a": "a", "lcap.cli": "cli", "lcap.capture.commands": "commands"}
    found = past_faces({module: tmp_path / f"{name}.py" for module, name in modules.items()})
    assert found == [
        "lcap.cli imports lcap.serve.server.s past lcap.serve's face",
        "lcap.dataset.a imports lcap.capture.proxy.server.CaptureProxy past lcap.capture's face",
        "lcap.dataset.a imports lcap.capture.sandbox past lcap.capture's face",
        "lcap.dataset.a imports _hidden_thing, which lcap.capture's face does not show",
    ]


def test_each_stage_says_what_it_may_import_and_its_face_names_what_exists():
    for stage in STAGES:
        package = importlib.import_module(f"lcap.{stage}")
        assert "May import:" in (package.__doc__ or ""), stage
        folder = _package_dirs()[f"lcap.{stage}"]
        for name, (module, attribute) in face(stage).items():
            assert stage_of(module) == stage, (stage, name, module)
            # a face name that is also a sub-package's or module's name would be shadowed once that one is imported
            assert not (folder / name).is_dir() and not (folder / f"{name}.py").exists(), (stage, name)
            assert getattr(package, name) is getattr(importlib.import_module(module), attribute)
        assert set(face(stage)) <= set(dir(package))
