"""The number demo's warm start trains the tiny model on its corpus (the task, the verifier and the learning
targets: tests/unit/test_loop_demo.py)."""

from __future__ import annotations

from dataclasses import replace


def test_the_warm_start_learns_its_corpus(tiny_model_dir, tmp_path):
    """A few steps on the number task's corpus lower its loss, and the saved model is the trained one."""
    import shutil

    from lcap.loop.demo.runner import demo_task

    task = demo_task("number")
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)  # the warm start saves in place
    before = (model / "model.safetensors").read_bytes()
    settings = task.settings()
    short = task.warm_start(model, replace(settings, warm_steps=1, warm_examples=64))
    longer = task.warm_start(model, replace(settings, warm_steps=30, warm_examples=640))
    assert longer["loss"] < short["loss"] and longer["task"] == "number" and longer["warm_steps"] == 30
    assert (model / "model.safetensors").read_bytes() != before
