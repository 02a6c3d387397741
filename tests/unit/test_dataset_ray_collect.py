"""`lcap collect --ray`: episodes as Ray tasks on a real local cluster (`ray start` nodes on this machine, node IP
127.0.0.1), captured by a proxy on each node, their turns stored once by the driver's writer; a node lost mid-run.

The agents are real subprocesses calling a local fake upstream with the openai SDK through the node's capture
proxy. What an agent sees (its proxy, the node it ran on) goes to a log named by its task, which the tests read.
Ray's health checks are lowered on the head so that a killed node is seen as dead in seconds.
"""

from __future__ import annotations

import os


def test_a_node_proxy_that_cannot_start_says_why_in_one_line(tmp_path, monkeypatch, capture_home):
    """Whatever stops a node's capture proxy from starting (here a stand-in failure of the proxy's start) is what
    its episodes report, one line, instead of a dead actor's traceback."""
    from lcap.capture.options import ProxyOptions
    from lcap.capture.proxy.server import CaptureProxy
    from lcap.dataset.collect.on_ray import NodeConfig, NodeProxy

    monkeypatch.setenv("LCAP_HOME", str(capture_home))

    def refuse(self) -> None:
        raise RuntimeError("no room for listeners\nsecond line")

    monkeypatch.setattr(CaptureProxy, "start", refuse)
    node = NodeProxy(NodeConfig(ProxyOptions(upstream="http://127.0.0.1:9"), None, os.urandom(32), "t", 8))
    node.start()
    assert node.ready() == "RuntimeError: no room for listeners"
    assert node.stop(1.0) == 0
