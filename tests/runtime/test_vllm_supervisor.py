"""The agent's supervision of an engine process, on a real process standing in for a vLLM that fails to start:
its last error line is kept without vLLM's log prefix, it is restarted with a backoff that doubles to 60 s,
and Health reports it DEGRADED with the exit code; the admission gate drains before a stop."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from shardwise.agents import vllm_engine as engine
from shardwise.agents.client import world_request
from shardwise.agents.proto import agent_pb2 as pb


def failing_engine(tmp_path: Path) -> str:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n"
                      "echo '(APIServer pid=1) WARNING 12-01 10:00:00 [utils.py:1] Found ulimit of 20000: error'\n"
                      "echo '(Worker pid=2) ERROR 12-01 10:00:01 [executor.py:9] ValueError: max_model_len 9999 "
                      "is larger than the model allows'\n"
                      "echo 'RuntimeError: Engine core initialization failed. See root cause above.'\n"
                      "exit 3\n")
    script.chmod(0o755)
    return str(script)


def engine_without_vllm(tmp_path: Path) -> str:
    """A real interpreter that cannot import vllm (no site-packages): what a pod whose environment lacks vLLM
    runs."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    script.chmod(0o755)
    return str(script)


def wait(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_failing_engine_is_restarted_with_backoff_and_reported_with_its_error_line(tmp_path: Path) -> None:
    agent = engine.VllmAgent(engine.VllmConfig(deployment="d", pod_index=0, host="127.0.0.1",
                                               python=failing_engine(tmp_path), args=("--model", "/m")))
    try:
        assert agent.health().status == pb.AGENT_STATUS_UNCONFIGURED
        agent.configure(world_request(generation=1, model="", tp=1, dpa=1, pp=1, pods=[[0]],
                                      rendezvous="127.0.0.1:1"))
        wait(lambda: agent.supervisor.state.restarts >= 1 and agent.supervisor.state.exit_code == 3, 15,
             "a restart after the first exit")
        h = agent.health()  # restarted or waiting to: degraded either way, with the crash's code and line
        assert h.status == pb.AGENT_STATUS_DEGRADED and h.ranks[0].exit_code == 3 and h.ranks[0].restarts >= 1
        wait(lambda: not agent.supervisor.state.running, 15, "the restarted engine to exit")
        h = agent.health()
        assert h.status == pb.AGENT_STATUS_DEGRADED and h.ranks[0].exit_code == 3
        assert h.ranks[0].last_error == "ValueError: max_model_len 9999 is larger than the model allows"
        ok, why = agent.ready()
        assert not ok and "max_model_len 9999" in why
    finally:
        agent.close()
    s = engine.Supervisor("python3", [], host="127.0.0.1", port=1, clock=lambda: 100.0)
    delays = []
    for restarts in (0, 1, 2, 5, 6, 9):
        s.state.restarts = restarts
        s._schedule_restart()
        delays.append(s.state.next_start - 100.0)
    assert delays == [1, 2, 4, 32, 60, 60]


def test_a_configured_world_is_never_replaced_in_place(tmp_path: Path) -> None:
    agent = engine.VllmAgent(engine.VllmConfig(deployment="d", pod_index=0, host="127.0.0.1",
                                               python=failing_engine(tmp_path), args=()))
    try:
        first = world_request(generation=1, model="", tp=1, dpa=1, pp=1, pods=[[0]], rendezvous="127.0.0.1:1")
        assert list(agent.configure(first).local_ranks) == [0]
        assert list(agent.configure(first).local_ranks) == [0]  # a repeat is a no-op
        from shardwise.agents.agent import CallError

        with pytest.raises(CallError, match="cannot join world 2 in place"):
            agent.configure(world_request(generation=2, model="", tp=1, dpa=1, pp=1, pods=[[0]],
                                          rendezvous="127.0.0.1:1"))
        with pytest.raises(CallError, match="does not support Prepare"):
            agent.prepare(pb.PrepareRequest(generation=2))
    finally:
        agent.close()


def test_a_drain_stops_admitting_and_waits_for_the_requests_in_flight() -> None:
    gate = engine.Gate()
    assert gate.enter() and gate.enter()
    assert not gate.drain(0.05) and not gate.enter()  # two in flight: the drain times out, nothing new admitted
    done = threading.Event()

    def finish() -> None:
        gate.leave("ok")
        gate.leave("ok")
        done.set()

    threading.Timer(0.1, finish).start()
    assert gate.drain(10) and done.is_set() and gate.in_flight == 0 and gate.finished == {"ok": 2}


def test_a_busy_engine_stays_ready_through_slow_health_answers_but_not_through_errors() -> None:
    now = [0.0]
    s = engine.Supervisor("python3", [], host="127.0.0.1", port=1, clock=lambda: now[0])
    s._observe(True)
    for t in (1.0, 5.0, 14.0):  # /health does not answer in time while vLLM decodes on every core
        now[0] = t
        s._observe(None)
        assert s.state.healthy
    now[0] = 16.5
    s._observe(None)
    assert not s.state.healthy  # silent for longer than the grace: not ready
    s._observe(True)
    s._observe(False)  # a 503 (engine dead) or a refused connection ends readiness at once
    assert not s.state.healthy


def test_vllms_own_series_are_kept_with_the_deployment_label_and_its_process_series_dropped() -> None:
    text = ("# HELP vllm:num_requests_running Running requests.\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            "# HELP python_gc_objects_collected_total GC.\n# TYPE python_gc_objects_collected_total counter\n"
            'python_gc_objects_collected_total{generation="0"} 7.0\n')
    (fam,) = engine.engine_families(text, {"deployment": "web"})
    assert fam.name == "vllm:num_requests_running"
    assert [(s.labels, s.value) for s in fam.samples] == [({"engine": "0", "model_name": "m", "deployment": "web"},
                                                           3.0)]
    assert engine.engine_families("not metrics {{{", {}) == []


def test_the_metrics_port_keeps_vllms_names_whatever_format_the_scraper_asks_for() -> None:
    import urllib.request

    agent = engine.VllmAgent(engine.VllmConfig(deployment="web", pod_index=0, host="127.0.0.1", python="python3",
                                               args=()))
    agent.supervisor.families = engine.engine_families(
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 2.0\n', {"deployment": "web"})
    server, port = engine.serve_metrics(agent, "127.0.0.1", 0)
    try:
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"  # as Prometheus asks
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        assert 'vllm:num_requests_running{deployment="web",engine="0"} 2.0' in text
        assert 'shardwise_engine_up{deployment="web",pod_index="0"} 0.0' in text
    finally:
        server.shutdown()
        agent.close()


def test_the_reported_error_is_vllms_root_cause_not_its_wrappers() -> None:
    lines = ErrorLinesCase.LOG.splitlines()
    errors = engine.ErrorLines()
    for line in lines:
        errors.feed(line)
    assert errors.error == "NotImplementedError (in all_gatherv, base_device_communicator.py:296)"
    assert engine.error_line("api_server.py: error: unrecognized arguments: --bogus") == \
        "api_server.py: error: unrecognized arguments: --bogus"
    assert engine.error_line("(APIServer pid=1) WARNING 12-01 10:00:00 [x.py:1] Found ulimit: error") is None


class ErrorLinesCase:
    # the shape of what vLLM's CPU build prints when a data-parallel MoE step dies (abridged)
    LOG = """\
(Worker_DP0_EP0 pid=3) ERROR 12-01 14:28:27 [multiproc_executor.py:1063]   File "/v/all2all.py", line 148, in dispatch
(Worker_DP0_EP0 pid=3) ERROR 12-01 14:28:27 [multiproc_executor.py:1063]     gathered_tensors = dist_group.all_gatherv(
(Worker_DP0_EP0 pid=3) ERROR 12-01 14:28:27 [multiproc_executor.py:1063]   File "/v/base_device_communicator.py", \
line 296, in all_gatherv
(Worker_DP0_EP0 pid=3) ERROR 12-01 14:28:27 [multiproc_executor.py:1063]     raise NotImplementedError
(Worker_DP0_EP0 pid=3) ERROR 12-01 14:28:27 [multiproc_executor.py:1063] NotImplementedError
(EngineCore_DP1 pid=2) ERROR 12-01 14:28:27 [core.py:1512] RuntimeError: Worker failed with error '', please check the \
stack trace above for the root cause
(APIServer pid=1) ERROR 12-01 14:28:27 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore \
encountered an issue. See stack trace (above) for the root cause.
"""


def test_an_interpreter_without_vllm_is_reported_with_pythons_own_error(tmp_path: Path) -> None:
    python = engine_without_vllm(tmp_path)
    agent = engine.VllmAgent(engine.VllmConfig(deployment="d", pod_index=0, host="127.0.0.1", python=python,
                                               args=("--model", "/m")))
    try:
        agent.configure(world_request(generation=1, model="", tp=1, dpa=1, pp=1, pods=[[0]],
                                      rendezvous="127.0.0.1:1"))
        wait(lambda: agent.supervisor.state.exit_code == 1, 30, "the engine's first exit")
        h = agent.health()
        assert h.status == pb.AGENT_STATUS_DEGRADED and h.ranks[0].exit_code == 1
        assert h.ranks[0].last_error == (
            f"{sys.executable}: Error while finding module specification for 'vllm.entrypoints.openai.api_server' "
            "(ModuleNotFoundError: No module named 'vllm')")
        ok, why = agent.ready()
        assert not ok and "No module named 'vllm'" in why
    finally:
        agent.close()


# What vLLM 0.32's CPU build prints when --max-model-len passes the checkpoint's max_position_embeddings (its
# output for a 512-position checkpoint and --max-model-len 4096, frames abridged and lines cut at 400 characters).
VALIDATION_LOG = """\
/v/lib/python3.11/site-packages/vllm/entrypoints/openai/api_server.py:24: DeprecationWarning: \
`vllm.entrypoints.openai.api_server` is deprecated and will likely beunsupported in a future version.
  warnings.warn(
(APIServer pid=9715) INFO 12-07 21:19:29 [api_utils.py:286] non-default args: {'host': '127.0.0.1', 'port': 60241, \
'model': '/tmp/ckpt-vllm/qwen3-moe', 'dtype': 'float32', 'max_model_len': 4096, 'enforce_eager': True}
(APIServer pid=9715) WARNING 12-07 21:19:29 [system_utils.py:255] Found ulimit of 20000 and failed to \
automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like \
`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
(APIServer pid=9715) INFO 12-07 21:19:38 [model.py:733] Resolved architecture: Qwen3MoeForCausalLM
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/v/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 1955, in create_model_config
    return ModelConfig(
           ^^^^^^^^^^^^
  File "/v/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len \
(max_position_embeddings=512.0 or model_max_length=None in model's config.json). To allow overriding this \
maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. [type=value_error, input_value=ArgsKwargs((), \
{'model': '/tmp/ckpt-vllm/qwen3-moe'}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""

# A traceback whose exception is not named ...Error: torch.compile refusing an operation, then the engine's wrapper
DYNAMO_LOG = """\
(EngineCore_DP0 pid=2) ERROR 12-01 10:00:05 [core.py:842] Traceback (most recent call last):
(EngineCore_DP0 pid=2) ERROR 12-01 10:00:05 [core.py:842]   File "/v/vllm/v1/engine/core.py", line 833, in run
(EngineCore_DP0 pid=2) ERROR 12-01 10:00:05 [core.py:842]     yield
(EngineCore_DP0 pid=2) ERROR 12-01 10:00:05 [core.py:842]   File "/v/torch/_dynamo/exc.py", line 317, in unimplemented
(EngineCore_DP0 pid=2) ERROR 12-01 10:00:05 [core.py:842]     raise Unsupported(msg, case_name=case_name)
(EngineCore_DP0 pid=2) ERROR 12-01 10:00:05 [core.py:842] torch._dynamo.exc.Unsupported: Dynamic slicing with \
Tensor arguments
(APIServer pid=1) ERROR 12-01 10:00:06 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore \
encountered an issue. See stack trace (above) for the root cause.
"""


def errors_of(log: str) -> engine.ErrorLines:
    errors = engine.ErrorLines()
    for line in log.splitlines():
        errors.feed(line)
    return errors


@pytest.mark.parametrize("log,reported", [
    (VALIDATION_LOG, "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: Value error, "
                     "User-specified max_model_len (4096) is greater than the derived max_model_len "
                     "(max_position_embeddings=512.0 or model_max_length=None in model's config.json). To allow "
                     "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."),
    (DYNAMO_LOG, "torch._dynamo.exc.Unsupported: Dynamic slicing with Tensor arguments"),
    ("Traceback (most recent call last):\n  File \"/v/vllm/entrypoints/cli/main.py\", line 73, in main\n"
     "    args.dispatch_function(args)\nKeyboardInterrupt\n", "KeyboardInterrupt (in main, main.py:73)"),
    # a chained exception: the last one raised is what stopped the process
    ("Traceback (most recent call last):\nValueError: bad weights\n\nDuring handling of the above exception, "
     "another exception occurred:\n\nTraceback (most recent call last):\nSystemExit: 2\n", "SystemExit: 2"),
    ("/usr/bin/python3: No module named vllm\n", "/usr/bin/python3: No module named vllm"),
])
def test_the_reported_error_is_the_last_one_the_engine_printed_whatever_its_form(log: str, reported: str) -> None:
    assert errors_of(log).final == reported


def test_an_engine_that_printed_no_error_is_reported_with_the_last_line_it_printed() -> None:
    errors = errors_of("(APIServer pid=1) WARNING 12-01 10:00:00 [x.py:1] Found ulimit: error\n"
                       "(EngineCore_DP0 pid=2) INFO 12-01 10:00:03 [default_loader.py:308] Loading weights took "
                       "0.02 seconds\n\n")
    assert errors.error == "" and errors.final == "Loading weights took 0.02 seconds"
