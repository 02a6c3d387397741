"""`lcap loop` with --eval-tasks promotes a round only on held-out evidence (loop/promotion.py, the rule `lcap loop
--live` follows too): the rule, and a refused round's bookkeeping (it deploys nothing, now or on a resume, and the
next round trains from the deployment that stays), for one adapter and for --per-role's adapters together. The policy server and the collects are stand-ins here (no vLLM
in the unit tier); tests/e2e/test_loop_promote.py runs the same rounds on the vLLM CPU server."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lcap.config import LcapError
from lcap.loop import promotion
from lcap.loop.options import LoopOptions
from lcap.loop.promotion import refusal, remember, roles_key, step_refusal
from lcap.loop.steps import LoopConfig, LoopState, RoundSummary, StepRunner, continued, promoted_reward, role_continued


def test_a_candidate_is_promoted_when_no_worse_than_the_current_by_more_than_the_margin():
    assert refusal(0.5, 0.5, 0.0) is None  # no worse
    assert refusal(0.45, 0.5, 0.1) is None  # worse, within the margin
    assert refusal(0.5, 0.5, -0.1) == "held-out reward 0.500 < 0.500 - margin -0.1"  # a gain demanded
    assert refusal(0.045, 0.344, 0.0) == "held-out reward 0.045 < 0.344 - margin 0"
    assert refusal(0.0, 1.0, 10.0) is None and refusal(1.0, 0.0, -10.0) is not None  # what the e2e test forces
    assert refusal(None, 0.5, 10.0) == "no held-out episode was rewarded (candidate)"
    assert refusal(0.5, None, 10.0) == "no held-out episode was rewarded (current)"


class Server:
    """The policy server as the loop sees it: the record (current, each role's own deployment, loaded adapters) and
    what was done to it."""

    def __init__(self, current: str, figures: dict[str, float]) -> None:
        self.current = current
        self.roles: dict[str, str] = {}
        self.loras: dict[str, str] = {}
        self.figures = figures  # deployment (--per-role: `roles_key` of every role's) -> its held-out reward
        self.evaluated: list[str] = []
        self.deployments: list[str] = []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(promotion, "read_policy", self.record)
        monkeypatch.setattr(promotion, "load_candidate", self.load)
        monkeypatch.setattr(promotion, "make_current", self.make_current)
        monkeypatch.setattr(promotion, "make_roles_current", self.make_roles_current)
        monkeypatch.setattr(promotion, "forget_candidate", lambda name: self.loras.pop(name))
        monkeypatch.setattr(promotion, "record_deployment", lambda s, r, name, *a, **k: self.deployments.append(name))
        monkeypatch.setattr(promotion, "collect_split", self.collect)

    def record(self) -> SimpleNamespace:
        roles = dict(self.roles)
        return SimpleNamespace(
            current=self.current,
            loras=dict(self.loras),
            roles=roles,
            deployment_of=lambda role: roles.get(role) or self.current,
        )

    def load(self, path: Path, *, round: int, role: str = "default") -> str:
        name = f"cand-{round}" if role == "default" else f"cand-{role}-{round}"
        self.loras[name] = str(path)
        return name

    def make_current(self, name: str) -> None:
        assert name in self.loras
        self.current = name

    def make_roles_current(self, names: dict[str, str]) -> None:
        assert all(name in self.loras for name in names.values())
        self.roles.update(names)

    def collect(
        self, store, config, n, split, tasks, group_size, node_proxies=None, model=None, role_models=None
    ) -> dict:
        served = model or self.current  # pinned by name, or the routed current deployment
        if role_models:  # each pinned role's calls served by its candidate, the others by their deployments
            served = roles_key(self.current, {**self.roles, **role_models})
        elif self.roles and model is None:
            served = roles_key(self.current, self.roles)
        self.evaluated.append(f"{n}:{split}:{served}")
        return {"mean_reward": self.figures[served], "rewarded": 1}


def _config(tmp_path: Path, margin: float = 0.0) -> LoopConfig:
    return LoopConfig(
        run=tmp_path / "run",
        rounds=3,
        tasks=tmp_path / "t.jsonl",
        command=["agent"],
        eval_tasks=tmp_path / "e.jsonl",
        options=LoopOptions(promote_margin=margin),
    )


def _round(step: StepRunner, config: LoopConfig, n: int, trained: dict, lines: list[str]) -> RoundSummary:
    from lcap.loop.rounds import _train_deploy_eval

    s = RoundSummary(round=n)
    said = _train_deploy_eval(step, config, None, s, lambda: trained, lines.append, None)
    lines.append(f"round {n}:{said}")
    return s


def test_a_refused_round_deploys_nothing_and_the_next_trains_from_the_deployment_that_stays(
    dstore, tmp_path, monkeypatch
):
    server = Server("base", {"base": 0.5, "cand-1": 0.75, "cand-2": 0.25})
    server.install(monkeypatch)
    config = _config(tmp_path)
    state = LoopState(config.run, config.key())
    remember(state, "base", 0.5, 0)  # round 0's held-out run of the base
    step = StepRunner(dstore, state, config.run)
    lines: list[str] = []

    first = _round(step, config, 1, {"output": "/run/round-1/adapter", "n_groups": 4}, lines)
    assert first.deployed == "cand-1" == server.current and server.deployments == ["cand-1"]
    assert lines[-1].startswith("round 1: | held-out 0.750 vs base 0.500 | promoted cand-1 | loss ")
    assert server.evaluated == ["1:eval:cand-1"]  # the candidate by name, before it served anything routed

    second = _round(step, config, 2, {"output": "/run/round-2/adapter", "n_groups": 4}, lines)
    assert second.deployed is None and second.refused == "held-out reward 0.250 < 0.750 - margin 0"
    assert server.current == "cand-1" and "cand-2" not in server.loras and server.deployments == ["cand-1"]
    assert (
        "held-out 0.250 vs cand-1 0.750 | refused: held-out reward 0.250 < 0.750 - margin 0; cand-1 stays"
        in (lines[-1])
    )
    assert server.evaluated == ["1:eval:cand-1", "2:eval:cand-2"]  # cand-1's figure kept, not measured again

    # What a resume reads: round 2 deployed nothing, round 3 trains from round 1's adapter.
    assert state.done(2, "deploy") is None and state.done(2, "promote")["promoted"] is False
    assert state.last_deployed() == {**state.done(1, "deploy")} and state.last_deployed()["name"] == "cand-1"
    assert continued(state, 3) == Path("/run/round-1/adapter")
    assert promoted_reward(state, 3) == 0.75  # --stop-when-solved compares with the deployment that stays

    # Resumed (after a deploy by hand of a deployment never measured): round 2 is its recorded verdict; nothing is
    # trained, loaded, evaluated or deployed again.
    server.current = "by-hand"
    resumed = StepRunner(dstore, LoopState(config.run, config.key()), config.run)
    again = _round(resumed, config, 2, {"output": "/elsewhere"}, lines)
    assert again.refused == second.refused and server.current == "by-hand"
    assert server.evaluated == ["1:eval:cand-1", "2:eval:cand-2"] and server.deployments == ["cand-1"]
    rows = dstore.fetchall("SELECT round, step FROM loop_steps ORDER BY created_at, round")
    assert rows == [(1, "train"), (1, "eval"), (1, "promote"), (1, "deploy"), (2, "train"), (2, "eval"), (2, "promote")]


def test_a_current_deployment_without_a_figure_is_measured_once(dstore, tmp_path, monkeypatch):
    """A deployment the loop never measured (deployed by hand, a store from before the rule): its held-out reward
    is measured once, as step `eval-current`, then kept."""
    server = Server("by-hand", {"by-hand": 0.5, "cand-1": 0.25, "cand-2": 0.5})
    server.install(monkeypatch)
    config = _config(tmp_path, margin=0.1)
    step = StepRunner(dstore, LoopState(config.run, config.key()), config.run)
    lines: list[str] = []
    assert _round(step, config, 1, {"output": "/a"}, lines).refused is not None  # 0.25 < 0.5 - 0.1
    assert _round(step, config, 2, {"output": "/b"}, lines).deployed == "cand-2"  # 0.5 >= 0.5 - 0.1
    assert server.evaluated == ["1:eval:cand-1", "1:eval-current:by-hand", "2:eval:cand-2"]
    assert step.state.data["scores"] == {
        "by-hand": {"mean_reward": 0.5, "round": 1},
        "cand-2": {"mean_reward": 0.5, "round": 2},
    }


def test_a_full_checkpoint_is_deployed_then_evaluated(dstore, tmp_path, monkeypatch):
    """--full cannot be served beside the policy: the round deploys as before, the held-out run follows."""
    from lcap.loop import rounds
    from lcap.train import TrainOptions

    server = Server("base", {"base": 0.5})
    server.install(monkeypatch)
    deployed = []
    monkeypatch.setattr(
        rounds, "deploy_step", lambda store, output, n, merge=False: deployed.append(output) or {"name": "full-1"}
    )
    config = _config(tmp_path)
    config.train = TrainOptions(full=True)
    step = StepRunner(dstore, LoopState(config.run, config.key()), config.run)
    collected = []
    collect_step = lambda n, split, tasks, size: collected.append(split) or {"mean_reward": 0.0}  # noqa: E731
    s = RoundSummary(round=1)
    said = rounds._train_deploy_eval(step, config, collect_step, s, lambda: {"output": "/ckpt"}, print, None)
    assert deployed == ["/ckpt"] and collected == ["eval"] and s.deployed == "full-1" and "deployed full-1" in said
    assert server.evaluated == []


def test_status_says_a_refused_round_with_its_reason(dstore, tmp_path):
    from lcap.loop.status import loop
    from lcap.status import View

    verdict = {"promoted": False, "reason": "held-out reward 0.045 < 0.344 - margin 0", "candidate": "c"}
    dstore.append(
        "loop_steps",
        [
            {
                "run": "/runs/a",
                "round": 1,
                "step": step,
                "mean_reward": 0.045,
                "details": json.dumps(details),
                "created_at": f"2026-01-01 00:0{i}:00+00",
            }
            for i, (step, details) in enumerate([("eval", {}), ("promote", verdict)])
        ],
    )
    section = loop(View(dstore.path, time.time()))
    assert section.rows[0][1] == "refused: held-out reward 0.045 < 0.344 - margin 0"


def _role_round(step: StepRunner, config: LoopConfig, n: int, roles: tuple[str, ...], lines: list[str], monkeypatch):
    """A round of --per-role whose training (loop/roles.py, tests/unit/test_loop_roles.py) trained `roles`."""
    from lcap.loop import rounds

    trained = {role: {"output": f"/run/round-{n}/role-{role}/adapter", "n_groups": 2} for role in roles}
    monkeypatch.setattr(rounds, "train_roles", lambda step, config, n, echo: trained)
    monkeypatch.setattr(rounds, "deploy_trained", lambda *a: pytest.fail("an ungated deploy"))  # the gate's absence
    s = RoundSummary(round=n)
    said = rounds._per_role(step, config, None, s, lines.append, None)
    lines.append(f"round {n}:{said}")
    return s


def test_per_role_adapters_are_promoted_together_or_refused_together(dstore, tmp_path, monkeypatch):
    """--per-role with --eval-tasks: a round's adapters (one per role it trained) are one candidate, evaluated with
    each trained role pinned to its adapter, compared with every role's current deployment at once (held-out success
    is an episode's), then made their roles' deployments in one write, or all refused: no `deploy` step, each
    candidate dropped, and the next round trains each role from the adapter that stays."""
    promoted_key = "base; planner=cand-planner-1, solver=cand-solver-1"
    refused_key = "base; planner=cand-planner-2, solver=cand-solver-1"
    server = Server("base", {"base": 0.5, promoted_key: 0.75, refused_key: 0.5})
    server.install(monkeypatch)
    config = _config(tmp_path, margin=0.1)
    config.options = LoopOptions(promote_margin=0.1, per_role=True)
    state = LoopState(config.run, config.key())
    remember(state, "base", 0.5, 0)
    step = StepRunner(dstore, state, config.run)
    lines: list[str] = []

    first = _role_round(step, config, 1, ("planner", "solver"), lines, monkeypatch)
    assert server.roles == {"planner": "cand-planner-1", "solver": "cand-solver-1"} and server.current == "base"
    assert first.roles == server.roles and first.deployed == "planner cand-planner-1, solver cand-solver-1"
    assert sorted(server.deployments) == ["cand-planner-1", "cand-solver-1"]
    assert lines[-1] == (
        "round 1: | held-out 0.750 vs base 0.500 | promoted planner cand-planner-1, solver cand-solver-1"
    )
    assert server.evaluated == [f"1:eval:{promoted_key}"]  # pinned before anything routed served them
    deployed = state.done(1, "deploy")["roles"]
    assert deployed["planner"] == {"name": "cand-planner-1", "path": "/run/round-1/role-planner/adapter", "round": 1}
    assert state.deployed_roles() == deployed  # what a restarted server gets deployed again

    # Round 2 trains the planner alone: its candidate is judged with the solver's deployment, and refused
    # (0.5 < 0.75 - 0.1): nothing deployed, the candidate dropped, each role keeps its adapter.
    second = _role_round(step, config, 2, ("planner",), lines, monkeypatch)
    assert second.refused == "held-out reward 0.500 < 0.750 - margin 0.1" and second.deployed is None
    assert server.roles == {"planner": "cand-planner-1", "solver": "cand-solver-1"}
    assert "cand-planner-2" not in server.loras and len(server.deployments) == 2
    assert (
        lines[-1]
        == f"round 2: | held-out 0.500 vs {promoted_key} 0.750 | refused: {second.refused}; {promoted_key} stays"
    )
    assert server.evaluated == [f"1:eval:{promoted_key}", f"2:eval:{refused_key}"]  # round 1's figure kept
    verdict = state.done(2, "promote")
    assert verdict["promoted"] is False and state.done(2, "deploy") is None
    assert verdict["roles"] == {
        "planner": {"name": "cand-planner-2", "path": "/run/round-2/role-planner/adapter", "round": 2}
    }  # each role's refused candidate, in loop_steps too
    rows = dstore.fetchall("SELECT step, details->>'promoted' FROM loop_steps WHERE round = 2 ORDER BY created_at")
    assert rows == [("eval", None), ("promote", "false")]

    # Round 3 trains each role from the adapter that stays, not the refused one; a resume of round 2 is its verdict.
    assert role_continued(state, 3, "planner") == Path("/run/round-1/role-planner/adapter")
    assert role_continued(state, 3, "solver") == Path("/run/round-1/role-solver/adapter")
    assert role_continued(state, 1, "planner") is None  # the base model
    resumed = StepRunner(dstore, LoopState(config.run, config.key()), config.run)
    again = _role_round(resumed, config, 2, ("planner",), lines, monkeypatch)
    assert again.refused == second.refused and len(server.evaluated) == 2 and len(server.deployments) == 2


def test_a_per_role_round_whose_deployments_changed_during_its_evaluation_is_refused(dstore, tmp_path, monkeypatch):
    """A role rolled back (or deployed by hand) while the deployments it is compared with were measured (step
    `eval-current`: a combination the loop never measured): what it was compared with no longer serves, so it is
    refused, as a single adapter is."""
    server = Server("base", {"base; planner=cand-planner-1, solver=s0": 0.9, "base; solver=s0": 0.5})
    server.roles = {"solver": "s0"}
    server.install(monkeypatch)
    collect = server.collect

    def collect_then_deploy(*args, **kwargs) -> dict:
        got = collect(*args, **kwargs)
        if args[3] == "eval-current":
            server.roles["solver"] = "by-hand"
        return got

    monkeypatch.setattr(promotion, "collect_split", collect_then_deploy)
    config = _config(tmp_path)
    config.options = LoopOptions(per_role=True)
    state = LoopState(config.run, config.key())
    s = _role_round(StepRunner(dstore, state, config.run), config, 1, ("planner",), [], monkeypatch)
    assert server.evaluated == ["1:eval:base; planner=cand-planner-1, solver=s0", "1:eval-current:base; solver=s0"]
    assert s.refused == "the current deployment changed to base; solver=by-hand during the evaluation (a rollback?)"
    assert server.roles == {"solver": "by-hand"} and "cand-planner-1" not in server.loras


def test_a_round_that_moved_the_policy_too_far_is_refused_by_its_step_kl():
    assert step_refusal({"output": "/a", "step_kl": 0.5}, 0.0) is None  # no limit
    assert step_refusal({"output": "/a", "step_kl": 0.05}, 0.1) is None and step_refusal({"output": "/a"}, 0.1) is None
    assert step_refusal({"output": "/a", "step_kl": 0.25}, 0.1) == (
        "training moved the policy by KL 0.25 per token, over --max-step-kl 0.1"
    )
    roles = {"planner": {"output": "/p", "step_kl": 0.3}, "solver": {"output": "/s", "step_kl": 0.9}}
    assert (
        step_refusal(roles, 0.2)
        == "role solver's training moved the policy by KL 0.9 per token, over --max-step-kl 0.2"
    )
    assert step_refusal(roles, 1.0) is None
    assert step_refusal({"output": {"output": "/o", "step_kl": 0.9}}, 0.2).startswith("role output's training")
    for diverged in (float("nan"), float("inf")):  # weights gone to NaN: the trained round scored nothing
        assert step_refusal({"output": "/a", "step_kl": diverged}, 0.1) is not None
    with pytest.raises(LcapError, match="--max-step-kl -1: 0"):
        LoopOptions(max_step_kl=-1)


def test_an_ungated_round_past_max_step_kl_deploys_nothing_and_the_next_trains_from_the_deployment_that_stays(
    dstore, tmp_path, monkeypatch
):
    """Without --eval-tasks (so with --full, --deploy-merge and an --async step) no held-out run vouches for a round
    before it serves: a round whose step KL is past --max-step-kl is refused, recorded once as step `promote`."""
    from lcap.loop import rounds
    from lcap.loop.overlap import _finished
    from lcap.train import TrainOptions

    server = Server("base", {})
    server.install(monkeypatch)
    deployed = []
    monkeypatch.setattr(
        rounds, "deploy_step", lambda store, output, n, merge=False: deployed.append(output) or {"name": f"d-{n}"}
    )
    config = _config(tmp_path)
    config.eval_tasks = None
    config.options = LoopOptions(max_step_kl=0.1)
    step = StepRunner(dstore, LoopState(config.run, config.key()), config.run)

    def round_(n: int, trained: dict) -> tuple[RoundSummary, str | None]:
        s = RoundSummary(round=n)
        return s, rounds._train_deploy_eval(step, config, None, s, lambda: trained, print, None)

    first, _ = round_(1, {"output": "/run/round-1/adapter", "n_groups": 4, "step_kl": 0.02})
    second, said = round_(2, {"output": "/run/round-2/adapter", "n_groups": 4, "step_kl": 0.4})
    assert first.deployed == "d-1" and second.deployed is None and deployed == ["/run/round-1/adapter"]
    assert second.refused == "training moved the policy by KL 0.4 per token, over --max-step-kl 0.1"
    assert said.startswith(f" | refused: {second.refused}; base stays | loss ")
    verdict = step.state.done(2, "promote")
    assert (verdict["promoted"], verdict["reason"], verdict["current"]) == (False, second.refused, "base")
    assert continued(step.state, 3) == Path("/run/round-1/adapter") and _finished(step.state, 2, "stats")

    # A resume reads the refusal, whatever the limit now: nothing is deployed. A round deployed before is never
    # refused after the fact by a lower limit.
    config.options = LoopOptions(max_step_kl=0.0)
    again, _ = round_(2, {"output": "/run/round-2/adapter", "n_groups": 4, "step_kl": 0.4})
    assert again.refused == second.refused and deployed == ["/run/round-1/adapter"]
    config.options = LoopOptions(max_step_kl=0.001)
    first_again, _ = round_(1, {"output": "/run/round-1/adapter", "n_groups": 4, "step_kl": 0.02})
    assert first_again.deployed == "d-1" and first_again.refused is None and step.state.done(1, "promote") is None

    # Resumed with a held-out gate (--eval-tasks, no --deploy-merge): the gate reads the refusal as its verdict.
    config.eval_tasks = tmp_path / "e.jsonl"
    gated_again, said = round_(2, {"output": "/run/round-2/adapter", "n_groups": 4, "step_kl": 0.4})
    assert gated_again.refused == second.refused and said.startswith(f" | refused: {second.refused}; base stays")
    assert server.evaluated == [] and deployed == ["/run/round-1/adapter"]
    with pytest.raises(LcapError, match="not with --step-kl-samples 0"):
        LoopConfig(
            run=config.run,
            rounds=1,
            tasks=config.tasks,
            command=["agent"],
            train=TrainOptions(step_kl_samples=0),
            options=LoopOptions(max_step_kl=0.1),
        )
