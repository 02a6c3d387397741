"""minibugs: a coding task set made from a seed. Each task is a small Python repository (one module and its
unittest file, from corpus/) in which one seeded mutation of the module makes at least one test fail; the agent
is asked to fix the module so that every test passes.

    python scripts/tasks/minibugs/make.py --seed 0 --out DIR

writes DIR/train.jsonl and DIR/heldout.jsonl (lcap task lines: id, prompt, workspace, split, and what the
verifier needs: module, tests, test_count), DIR/workspaces/ID/ (the buggy module and its tests, what the agent
starts from) and DIR/fixes.jsonl (each task's correct module and its mutation: for tests and analysis only, never
inside a workspace). The same seed gives the same bytes. Held-out tasks come from corpus functions no training
task uses. Every task is checked as it is made: the original module passes all its tests, the mutant fails at
least one and ends within a step budget (no mutant that hangs).

Grade episodes with `--verifier scripts/tasks/minibugs/verify.py:verify`.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import types
import unittest
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"
STEP_BUDGET = 200_000  # traced lines one test file may run before its mutant is taken for a hang
PROMPT = (
    "The Python module `{module}` in your working directory has a bug: some of the tests in `{tests}` fail. "
    "Run them with `python -m unittest` (or `python -m pytest`). Fix the bug in `{module}` so that every test "
    "passes. Do not edit `{tests}`: the original is put back before grading, and changing it scores 0."
)

_COMPARE_SWAPS = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "=="}
_COMPARE_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_BINOP_SWAPS = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "+"),
    ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "//"),
    ast.Mod: ("%", "//"),
    ast.BitAnd: ("&", "|"),
    ast.RShift: (">>", "<<"),
}
_AUG_SWAPS = {ast.Add: ("+=", "-="), ast.Sub: ("-=", "+="), ast.Mult: ("*=", "+=")}


@dataclass(frozen=True)
class Mutation:
    kind: str  # wrong_comparison, swapped_operator, off_by_one, wrong_constant, swapped_boolean, dropped_branch
    start: int  # character offsets in the module's text
    end: int
    new: str
    line: int

    def apply(self, text: str) -> str:
        return text[: self.start] + self.new + text[self.end :]


@dataclass(frozen=True)
class Outcome:
    total: int
    failed: list[str]  # ids of the tests that failed or errored
    hung: bool = False  # a test ran past the step budget
    broken: bool = False  # the module does not compile or import


def mutations(text: str) -> list[Mutation]:
    """Every single-site mutation this generator knows for the module `text`, in source order."""
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))

    def at(lineno: int, col: int) -> int:
        return offsets[lineno - 1] + col

    def between(node_a: ast.AST, node_b: ast.AST, old: str, new: str, kind: str) -> Mutation | None:
        lo = at(node_a.end_lineno, node_a.end_col_offset)
        hi = at(node_b.lineno, node_b.col_offset)
        gap = text[lo:hi]
        index = gap.find(old)
        if index < 0 or gap.count(old) != 1:
            return None
        return Mutation(kind, lo + index, lo + index + len(old), new, node_a.end_lineno)

    found: list[Mutation] = []
    tree = ast.parse(text)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.Module)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        mutation: Mutation | None = None
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_SWAPS:
            op = type(node.ops[0])
            mutation = between(
                node.left, node.comparators[0], _COMPARE_TEXT[op], _COMPARE_SWAPS[op], "wrong_comparison"
            )
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
            old, new = _BINOP_SWAPS[type(node.op)]
            mutation = between(node.left, node.right, old, new, "swapped_operator")
        elif isinstance(node, ast.AugAssign) and type(node.op) in _AUG_SWAPS:
            old, new = _AUG_SWAPS[type(node.op)]
            mutation = between(node.target, node.value, old, new, "swapped_operator")
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            mutation = between(node.values[0], node.values[1], old, new, "swapped_boolean")
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            start, end = at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset)
            if isinstance(node.value, bool):
                mutation = Mutation("wrong_constant", start, end, str(not node.value), node.lineno)
            elif isinstance(node.value, int) and text[start:end].isdigit():
                value = node.value + 1 if node.value in (0, 1) or node.value % 2 else node.value - 1
                kind = "off_by_one" if node.value in (0, 1) else "wrong_constant"
                mutation = Mutation(kind, start, end, str(value), node.lineno)
        elif isinstance(node, ast.If) and not node.orelse and node.col_offset > 0:
            # whole lines go; a branch that was its block's only statement leaves a mutant that does not compile
            start, end = at(node.lineno, 0), offsets[node.end_lineno]
            mutation = Mutation("dropped_branch", start, end, "", node.lineno)
        if mutation is not None:
            found.append(mutation)
    return sorted(found, key=lambda m: (m.start, m.end, m.new))


def run_tests(module_name: str, module_text: str, tests_name: str, tests_text: str) -> Outcome:
    """Run a test file against a module's text in this process, with a step budget on each test."""
    saved = sys.modules.get(module_name)
    module = types.ModuleType(module_name)
    try:
        try:
            exec(compile(module_text, f"{module_name}.py", "exec"), module.__dict__)
        except Exception:
            return Outcome(0, ["<import>"], broken=True)
        sys.modules[module_name] = module
        tests = types.ModuleType(tests_name)
        exec(compile(tests_text, f"{tests_name}.py", "exec"), tests.__dict__)
        suite = unittest.defaultTestLoader.loadTestsFromModule(tests)
        result = _BudgetResult()
        suite.run(result)
        failed = sorted({t.id() for t, _ in result.failures + result.errors + result.skipped})
        return Outcome(result.testsRun, failed, result.hung)
    finally:
        if saved is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = saved


class _OverBudget(Exception):
    pass


class _BudgetResult(unittest.TestResult):
    """A TestResult that traces each test's lines and stops one that runs past STEP_BUDGET."""

    hung = False

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        steps = 0

        def trace(frame, event, arg):
            nonlocal steps
            steps += 1
            if steps > STEP_BUDGET:
                self.hung = True
                raise _OverBudget
            return trace

        sys.settrace(trace)

    def stopTest(self, test: unittest.TestCase) -> None:
        sys.settrace(None)
        super().stopTest(test)


def make(seed: int, out: Path, *, per_function: int = 2, heldout_fraction: float = 0.2) -> dict[str, int]:
    """Write the task set for `seed` into `out` (which must be empty or absent); returns counts per split."""
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"make.py: {out} is not empty: give a new directory")
    names = sorted(p.stem for p in CORPUS.glob("*.py") if not p.stem.startswith("test_"))
    order = list(names)
    random.Random(f"minibugs:{seed}:split").shuffle(order)
    heldout = set(order[: max(1, round(len(order) * heldout_fraction))])
    lines: dict[str, list[str]] = {"train": [], "heldout": []}
    fixes: list[str] = []
    for name in names:
        module_file, tests_file = f"{name}.py", f"test_{name}.py"
        original = (CORPUS / module_file).read_text()
        tests_text = (CORPUS / tests_file).read_text()
        base = run_tests(name, original, f"test_{name}", tests_text)
        if base.failed or base.hung or base.broken:
            raise SystemExit(f"make.py: corpus/{module_file} fails its own tests: {base.failed}")
        candidates = mutations(original)
        random.Random(f"minibugs:{seed}:{name}").shuffle(candidates)
        chosen: list[tuple[Mutation, Outcome]] = []
        for mutation in candidates:
            outcome = run_tests(name, mutation.apply(original), f"test_{name}", tests_text)
            if outcome.failed and not (outcome.hung or outcome.broken):
                chosen.append((mutation, outcome))
                if len(chosen) == per_function:
                    break
        split = "heldout" if name in heldout else "train"
        for k, (mutation, outcome) in enumerate(chosen):
            task_id = f"{name}-{k}"
            workspace = Path("workspaces") / task_id
            (out / workspace).mkdir(parents=True)
            (out / workspace / module_file).write_text(mutation.apply(original))
            (out / workspace / tests_file).write_text(tests_text)
            task = {
                "id": task_id,
                "prompt": PROMPT.format(module=module_file, tests=tests_file),
                "workspace": workspace.as_posix(),
                "split": split,
                "module": module_file,
                "tests": {tests_file: tests_text},
                "test_count": base.total,
                "protected": [tests_file],
            }
            lines[split].append(json.dumps(task) + "\n")
            fix = {
                "id": task_id,
                "file": module_file,
                "original": original,
                "mutation": {"kind": mutation.kind, "line": mutation.line, "new": mutation.new},
                "failing": outcome.failed,
            }
            fixes.append(json.dumps(fix) + "\n")
    for split, rows in lines.items():
        (out / f"{split}.jsonl").write_text("".join(rows))
    (out / "fixes.jsonl").write_text("".join(fixes))
    return {split: len(rows) for split, rows in lines.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the seed: the same seed writes the same bytes")
    parser.add_argument("--out", type=Path, required=True, help="an empty or new directory to write the set into")
    parser.add_argument("--per-function", type=int, default=2, help="tasks (distinct bugs) per corpus function")
    parser.add_argument(
        "--heldout-fraction", type=float, default=0.2, help="share of corpus functions whose tasks are held out"
    )
    args = parser.parse_args(argv)
    counts = make(args.seed, args.out, per_function=args.per_function, heldout_fraction=args.heldout_fraction)
    print(f"minibugs seed {args.seed}: {counts['train']} train, {counts['heldout']} held-out tasks in {args.out}")


if __name__ == "__main__":
    main()
