"""The node agent for `engine: vllm`: one control surface over a pod's vLLM server.

`shardwise agent --engine vllm -- ARGS` is the worker container's command; ARGS are vLLM's arguments, derived by
the operator from the plan. The agent

- serves the same gRPC API as for the reference engine: Describe, Health, Configure (which starts vLLM for that
  world generation, after the checkpoint check), Drain and Stats; the operations vLLM cannot do in place
  (Prepare, Pause, Switch, Resume, MigrateExperts, UpdateExpertMap, StreamExpertLoad) answer UNIMPLEMENTED;
- supervises the vLLM process: its output goes to the pod log, its last error line is kept, its `/health` is
  the pod's readiness, and a crash restarts it with backoff (1 s doubling to 60 s), reported as DEGRADED with
  the exit code, the restart count and that line until it serves again;
- serves the pod's port 8000 in front of vLLM (which listens on `vllm.API_PORT`): `/healthz` says whether it
  serves, `/livez` that the supervisor runs; every other request is passed through (streams too) while it admits;
  a drain (the Drain call, or SIGTERM) stops admitting (503) and waits for the requests in flight before vLLM is
  stopped;
- exports vLLM's metrics (`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
  ...) on the metrics port, each series labelled with the deployment, next to the agent's own.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from shardwise.agents import openai_api as oai
from shardwise.agents.agent import Agent, CallError
from shardwise.agents.proto import agent_pb2 as pb

from shardwise import __version__, checkpoint, vllm

log = logging.getLogger("shardwise.agent")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
HEALTH_PERIOD_S = 1.0
#: a vLLM that served stays ready while its /health is merely slow (a busy API server on few cores answers late)
#: for up to this long; a definite non-200 answer or the process's exit ends readiness at once
HEALTH_GRACE_S = 15.0
#: how long an ended run's output is read on before its error line is taken
OUTPUT_DRAIN_S = 2.0
MAX_BODY = 16 << 20  # prompts as token ids can be long; vLLM checks the rest
UPSTREAM_TIMEOUT_S = 600.0
ERROR_LINE = re.compile(r"^([\w.]*(Error|Exception)(: .*)?|\S+: error: .*)$")
FRAME = re.compile(r'^File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
LOG_PREFIX = re.compile(r"^(\([^)]*\)\s*)?(ERROR|WARNING|INFO|DEBUG)?\s*(\d\d-\d\d \d\d:\d\d:\d\d\s*)?(\[[^]]*\]\s*)?")
TRACEBACK = "Traceback (most recent call last):"
#: the line that ends a Python traceback: the exception's class (CamelCase, perhaps dotted) and its message, such
#: as `KeyboardInterrupt` or `torch._dynamo.exc.Unsupported: ...` that ERROR_LINE does not know
RAISED = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(: .*)?$")
#: the interpreter's own refusal before any code runs, e.g. `/usr/bin/python3: Error while finding module
#: specification for 'vllm.entrypoints.openai.api_server' (ModuleNotFoundError: No module named 'vllm')`
INTERPRETER = re.compile(r"^(?:\S*/)?python[\d.]*: .+$")
#: pydantic's header (vLLM's configs are pydantic dataclasses): what is wrong is on the lines after it
VALIDATION = re.compile(r"\d+ validation errors? for \S+$")
#: vLLM's wrappers around a root cause it printed earlier: never the line worth reporting
WRAPPERS = ("root cause", "EngineDeadError", "Worker failed with error", "Engine core initialization failed")


class ErrorLines:
    """Reads vLLM's output line by line and keeps the error worth reporting, without vLLM's log prefix: the last
    exception, traceback end, argparse error or refusal of the interpreter that is not one of vLLM's wrappers.
    An exception with no message (a bare `NotImplementedError`) is named with the frame it was raised in; a
    pydantic validation error gets its detail (the field and the message, up to pydantic's `[type=...]`). `final`
    is that error, or when the process printed none, its last non-empty line (what it said last before it
    exited)."""

    DETAIL_LINES = 3  # the most lines after a validation error's header read as its detail

    def __init__(self) -> None:
        self.error = ""
        self.last = ""
        self._frame = ""
        self._in_traceback = False
        self._details = 0  # lines after a validation error's header still to read as its detail

    @property
    def final(self) -> str:
        return self.error or self.last[:500]

    def feed(self, line: str) -> str:
        text = LOG_PREFIX.sub("", line.strip(), count=1)
        if not text:
            return self.error
        self.last = text
        if self._details and not text.startswith("For further information"):
            detail, _, end = text.partition(" [type=")
            self._details = 0 if end else self._details - 1
            self.error = f"{self.error}: {detail}"[:500]
            return self.error
        self._details = 0
        if text.startswith(TRACEBACK):
            self._in_traceback = True
            return self.error
        frame = FRAME.match(text)
        if frame:
            self._frame = f"in {frame['func']}, {Path(frame['file']).name}:{frame['line']}"
            return self.error
        raised = self._in_traceback and RAISED.match(text) is not None
        if not (ERROR_LINE.match(text) or raised or INTERPRETER.match(text)):
            return self.error
        self._in_traceback = False
        if not any(w in text for w in WRAPPERS):
            if ":" not in text and self._frame:
                text = f"{text} ({self._frame})"
            self.error = text[:500]
            self._details = self.DETAIL_LINES if VALIDATION.search(text) else 0
        return self.error


def error_line(line: str) -> str | None:
    """The error one vLLM output line reports (see `ErrorLines`), or None."""
    found = ErrorLines().feed(line)
    return found or None


def engine_families(text: str, labels: dict[str, str]) -> list[Metric]:
    """vLLM's own families (`vllm:*`) of its /metrics text, each sample with `labels` added; the API server's
    process and HTTP series are left out."""
    try:
        families = [f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")]
    except ValueError as e:  # never fail a scrape on vLLM's text
        log.warning("vLLM's metrics could not be parsed: %s", e)
        return []
    for fam in families:
        fam.samples = [smp._replace(labels={**smp.labels, **labels}) for smp in fam.samples]
    return families


@dataclass
class EngineState:
    """What the supervisor knows of its vLLM process (read by Health, /healthz and the metrics)."""

    pid: int = 0
    running: bool = False
    healthy: bool = False
    restarts: int = 0
    exit_code: int | None = None
    last_error: str = ""
    next_start: float = 0.0  # monotonic time of the next start after a crash; 0 when none is due


class Supervisor:
    """Runs `python -m vllm.entrypoints.openai.api_server ARGS`, restarts it with backoff, polls `/health`."""

    def __init__(self, python: str, args: Sequence[str], *, host: str, port: int, env: dict[str, str] | None = None,
                 clock: Any = time.monotonic) -> None:
        self.python, self.args, self.host, self.port = python, list(args), host, port
        self.env = {**os.environ, **(env or {})}
        self.clock = clock
        self.state = EngineState()
        self.proc: subprocess.Popen[str] | None = None
        self._output: threading.Thread | None = None  # the reader of the current run's output
        self._errors = ErrorLines()  # what the current run printed
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # vLLM's `vllm:` families as last read and parsed by the watcher (about once a second): a scrape never
        # waits on a busy vLLM nor parses its text (tens of kB, slow in Python under load)
        self.families: list[Metric] = []
        self.labels: dict[str, str] = {}
        self._metrics_due = 0.0
        self._silent_since = 0.0

    @property
    def command(self) -> list[str]:
        return [self.python, *vllm.ENTRYPOINT, *self.args]

    def start(self) -> None:
        """Start vLLM and the thread that watches it (idempotent)."""
        with self.lock:
            if self._thread is not None:
                return
            self._spawn()
            self._thread = threading.Thread(target=self._watch, daemon=True, name="vllm-supervisor")
            self._thread.start()

    def _spawn(self) -> None:
        log.info("starting vLLM: %s", " ".join(self.command))
        try:
            proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", env=self.env, cwd="/", start_new_session=True, bufsize=1)
        except OSError as e:  # the interpreter is missing: a crash like any other, with the reason
            self.state.last_error = f"cannot start {self.python}: {e.strerror or e}"
            self.state.exit_code, self.state.running = 127, False
            self._schedule_restart()
            return
        self.proc = proc
        # the exit code and error of a crash stay until this run serves: a restart is degraded until then
        self.state.pid, self.state.running, self.state.healthy = proc.pid, True, False
        self.state.next_start = 0.0
        self._errors = ErrorLines()
        self._output = threading.Thread(target=self._read, args=(proc, self._errors), daemon=True,
                                        name="vllm-output")
        self._output.start()

    def _read(self, proc: subprocess.Popen[str], errors: ErrorLines) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            found = errors.feed(line)
            if found:
                self.state.last_error = found
        sys.stdout.flush()

    def _exited(self, proc: subprocess.Popen[str]) -> None:
        """A run ended: its error line once its output is read to the end (the last lines come after the exit is
        seen), else the last line it printed; then the restart is scheduled."""
        if self._output is not None:
            self._output.join(OUTPUT_DRAIN_S)  # vLLM's own children may hold the pipe open: not for long
        self.state.last_error = self._errors.final
        self.state.exit_code = proc.returncode
        self._schedule_restart()

    def _schedule_restart(self) -> None:
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** self.state.restarts)
        self.state.next_start = self.clock() + delay
        log.error("vLLM exited with code %s (%s); restart %d in %.0f s", self.state.exit_code,
                  self.state.last_error or "no error line", self.state.restarts + 1, delay)

    def _watch(self) -> None:
        while not self.stopping.wait(HEALTH_PERIOD_S / 2):
            with self.lock:
                proc = self.proc
                if proc is not None and proc.poll() is not None:
                    self.proc = None
                    self.state.running, self.state.healthy, self.state.pid = False, False, 0
                    self._exited(proc)
                elif proc is None and self.state.next_start and self.clock() >= self.state.next_start:
                    self.state.restarts += 1
                    self._spawn()
            if self.proc is not None:
                self._observe(self._probe())
                if self.state.healthy and self.clock() >= self._metrics_due:
                    self._metrics_due = self.clock() + HEALTH_PERIOD_S
                    text = self._fetch_metrics()
                    if text is not None:
                        self.families = engine_families(text, self.labels)
            else:
                self.families = []

    def _probe(self) -> bool | None:
        """True: /health answered 200; False: it answered something else or refused; None: no answer in time."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=2) as r:
                return bool(r.status == 200)
        except TimeoutError:
            return None
        except urllib.error.URLError as e:
            return None if isinstance(e.reason, TimeoutError) else False
        except (OSError, http.client.HTTPException):
            return False

    def _observe(self, answer: bool | None) -> None:
        now = self.clock()
        if answer:
            self.state.healthy, self._silent_since = True, 0.0
            self.state.exit_code, self.state.last_error = None, ""
        elif answer is None and self.state.healthy:
            self._silent_since = self._silent_since or now
            if now - self._silent_since > HEALTH_GRACE_S:
                self.state.healthy = False
        else:
            self.state.healthy, self._silent_since = False, 0.0

    def _fetch_metrics(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/metrics", timeout=5) as r:
                return str(r.read().decode(errors="replace"))
        except (OSError, http.client.HTTPException):
            return None  # a busy engine answers late: the last reading stands

    def stop(self, timeout: float) -> int | None:
        """SIGTERM vLLM's process group (vLLM drains for its --shutdown-timeout), SIGKILL after `timeout`."""
        self.stopping.set()
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return None
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(10)
        except ProcessLookupError:
            return proc.poll()
        finally:
            self.state.running, self.state.healthy = False, False


@dataclass
class Gate:
    """Admission in front of vLLM: requests in flight, and whether new ones are admitted."""

    admitting: bool = True
    in_flight: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def enter(self) -> bool:
        with self.cond:
            if not self.admitting:
                return False
            self.in_flight += 1
            return True

    def leave(self, outcome: str) -> None:
        with self.cond:
            self.in_flight -= 1
            self.finished[outcome] = self.finished.get(outcome, 0) + 1
            self.cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Stop admitting and wait up to `timeout` for the requests in flight; True when none is left."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.admitting = False
            while self.in_flight and time.monotonic() < deadline:
                self.cond.wait(max(0.0, min(1.0, deadline - time.monotonic())))
            return self.in_flight == 0


@dataclass(frozen=True)
class VllmConfig:
    deployment: str
    pod_index: int
    host: str
    python: str
    args: tuple[str, ...]
    drain_timeout_s: float = 120.0


class VllmAgent:
    """The state behind the gRPC servicer, the HTTP front and the metrics, for a pod running vLLM."""

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self.serves_api = "--headless" not in config.args
        self.supervisor = Supervisor(config.python, config.args, host=config.host, port=vllm.API_PORT)
        self.supervisor.labels = {"deployment": config.deployment}
        self.gate = Gate()
        self.lock = threading.Lock()
        self.active = 0
        self.table: list[pb.RankEntry] = []
        self.world_size = 0
        self.stopping = threading.Event()
        self.serving_url = ""

    # ------------------------------------------------------------------------------------ lifecycle
    def configure(self, req: pb.ConfigureRequest) -> pb.ConfigureResponse:
        """Record the world generation and start vLLM for it. vLLM forms its world once: a newer generation
        (a re-formed world) is given to new pods, never to a running vLLM."""
        with self.lock:
            local = sorted(e.rank for e in req.ranks if e.pod == self.config.pod_index)
            if req.generation == self.active:
                return pb.ConfigureResponse(generation=req.generation, local_ranks=local)
            if self.active:
                raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"vLLM runs world {self.active}; it cannot join world {req.generation} in place "
                                "(the operator re-forms vLLM worlds with new pods)")
            if req.weights_dir and checkpoint.is_checkpoint(Path(req.weights_dir)):
                Agent._architecture(req)  # the reference engine's checkpoint check: "checkpoint: ..." refusals
            self.active, self.table, self.world_size = req.generation, list(req.ranks), req.world_size
            self.supervisor.start()
            return pb.ConfigureResponse(generation=req.generation, local_ranks=local)

    def drain(self, req: pb.DrainRequest) -> pb.DrainResponse:
        self._require_active(req.generation)
        before = self.gate.in_flight
        ok = self.gate.drain(req.deadline_ms / 1000 if req.deadline_ms else self.config.drain_timeout_s)
        return pb.DrainResponse(generation=req.generation, finished=max(0, before - self.gate.in_flight),
                                remaining=self.gate.in_flight, timed_out=not ok)

    def shutdown(self) -> None:
        """SIGTERM: stop admitting, let the requests in flight finish (up to the drain timeout), stop vLLM."""
        self.stopping.set()
        left = 0 if self.gate.drain(self.config.drain_timeout_s) else self.gate.in_flight
        if left:
            log.warning("drain timed out with %d requests in flight; stopping vLLM", left)
        self.supervisor.stop(timeout=self.config.drain_timeout_s + 15)

    def _require_active(self, generation: int) -> None:
        if not self.active:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION, "not configured: call Configure first")
        if generation != self.active:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"generation {generation} is not active (active: {self.active})")

    def unsupported(self, operation: str) -> NoReturn:
        raise CallError(grpc.StatusCode.UNIMPLEMENTED,
                        f"engine vllm does not support {operation} in place: the operator re-forms the world")

    def prepare(self, req: pb.PrepareRequest) -> pb.PrepareResponse:
        return self.unsupported("Prepare")

    def pause(self, req: pb.PauseRequest) -> pb.PauseResponse:
        return self.unsupported("Pause")

    def switch(self, req: pb.SwitchRequest) -> pb.SwitchResponse:
        return self.unsupported("Switch")

    def resume(self, req: pb.ResumeRequest) -> pb.ResumeResponse:
        return self.unsupported("Resume")

    def migrate(self, req: pb.MigrateExpertsRequest) -> pb.MigrateExpertsResponse:
        return self.unsupported("MigrateExperts (vLLM's own EPLB moves its experts)")

    def update_map(self, req: pb.UpdateExpertMapRequest) -> pb.UpdateExpertMapResponse:
        return self.unsupported("UpdateExpertMap (vLLM's own EPLB moves its experts)")

    def abort(self, req: pb.AbortRequest) -> pb.AbortResponse:
        return self.unsupported("Abort by group (abort a request by closing its connection)")

    def restart_stuck(self, req: pb.RestartStuckRequest) -> pb.RestartStuckResponse:
        return self.unsupported("RestartStuck (vLLM's world is re-formed, not recovered from survivors)")

    def expert_load(self) -> pb.ExpertLoad:
        return self.unsupported("StreamExpertLoad (vLLM balances its experts itself)")

    # --------------------------------------------------------------------------------- observation
    def ready(self) -> tuple[bool, str]:
        """(serves, why not): the pod's readiness."""
        s = self.supervisor.state
        if not self.active:
            return False, "not configured"
        if not self.gate.admitting:
            return False, "draining"
        if s.healthy:
            return True, ""
        if not s.running:
            return False, f"vLLM exited ({s.exit_code}): {s.last_error or 'no error line'}"
        return False, "vLLM is starting"

    def describe(self) -> pb.DescribeResponse:
        local = [e for e in self.table if e.pod == self.config.pod_index]
        return pb.DescribeResponse(
            deployment=self.config.deployment, pod_index=self.config.pod_index, ranks=local,
            generation=self.active, serving_url=self.serving_url if self.serves_api else "",
            agent_version=__version__, world_size=self.world_size,
            # where the world meets: pod 0's data-parallel coordination (vLLM's own rendezvous)
            rendezvous_address=f"{self.config.host}:{vllm.RPC_PORT}")

    def health(self) -> pb.HealthResponse:
        if not self.active:
            return pb.HealthResponse(status=pb.AGENT_STATUS_UNCONFIGURED)
        s = self.supervisor.state
        if s.healthy:
            state, status = pb.RANK_STATE_SERVING, pb.AGENT_STATUS_SERVING
        elif s.running and s.exit_code is None:
            state, status = pb.RANK_STATE_STARTING, pb.AGENT_STATUS_STARTING
        elif s.running:  # restarted after a crash, not serving yet: degraded, with the crash's code and line
            state, status = pb.RANK_STATE_STARTING, pb.AGENT_STATUS_DEGRADED
        else:
            state, status = pb.RANK_STATE_CRASHED, pb.AGENT_STATUS_DEGRADED
        ranks = []
        for e in sorted(self.table, key=lambda e: e.rank):
            if e.pod != self.config.pod_index:
                continue
            h = pb.RankHealth(rank=e.rank, state=state, restarts=s.restarts, last_error=s.last_error, pid=s.pid)
            if s.exit_code is not None:
                h.exit_code = s.exit_code
            ranks.append(h)
        return pb.HealthResponse(status=status, ranks=ranks, generation=self.active)

    def engine_families(self) -> list[Metric]:
        return self.supervisor.families

    def stats(self) -> pb.StatsResponse:
        """The pod's load from vLLM's metrics, one group per data-parallel engine vLLM runs here."""
        values: dict[str, dict[str, float]] = {}
        for fam in self.engine_families():
            for s in fam.samples:
                if s.name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                              "vllm:generation_tokens_total"):
                    values.setdefault(s.labels.get("engine", "0"), {})[s.name] = s.value
        groups = [pb.DpaGroupStats(
            dpa_group=int(engine) if engine.isdigit() else 0,
            queue_depth=int(v.get("vllm:num_requests_waiting", 0)),
            running_requests=int(v.get("vllm:num_requests_running", 0)),
            kv_cache_usage=float(v.get("vllm:kv_cache_usage_perc", 0.0)),
            generated_tokens_total=int(v.get("vllm:generation_tokens_total", 0)),
            draining=not self.gate.admitting) for engine, v in sorted(values.items())]
        return pb.StatsResponse(
            queue_depth=sum(g.queue_depth for g in groups), running_requests=sum(g.running_requests for g in groups),
            kv_cache_usage=max((g.kv_cache_usage for g in groups), default=0.0),
            generated_tokens_total=sum(g.generated_tokens_total for g in groups), groups=groups,
            generation=self.active)

    def close(self) -> None:
        self.stopping.set()
        self.supervisor.stop(timeout=15)


# ------------------------------------------------------------------------------------------- HTTP
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
              "proxy-authenticate", "content-length", "host"}


def make_handler(agent: VllmAgent) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "shardwise-agent"
        timeout = 30  # a client that sends nothing for this long is disconnected

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http %s", format % args)

        def _json(self, status: int, body: dict[str, Any], retry_after: bool = False) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if retry_after:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, kind: str, retry_after: bool = False) -> None:
            self._json(status, oai.error_body(message, kind), retry_after)

        def do_GET(self) -> None:
            self._route()

        def do_POST(self) -> None:
            self._route()

        def do_DELETE(self) -> None:
            self._route()

        def _route(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/healthz", "/health"):
                ok, why = agent.ready()
                self._json(200 if ok else 503, {"status": "serving" if ok else why})
                return
            if path == "/livez":  # the supervisor answers (vLLM's own failures are /healthz's, and restarted)
                self._json(200, {"alive": True})
                return
            raw = self.headers.get("Content-Length")
            if self.command == "POST" and (raw is None or not raw.isdigit()):
                self._error(411 if raw is None else 400, "a request body needs a Content-Length "
                            "(a non-negative integer)", "invalid_request_error")
                return
            length = int(raw or 0)
            if length > MAX_BODY:
                oai.drain_refused_body(self.connection, self.rfile, length)
                self._error(413, f"the body is {length} bytes, more than {MAX_BODY}", "invalid_request_error")
                self.close_connection = True
                return
            body = self.rfile.read(length) if length else b""
            ok, why = agent.ready()
            if not ok:
                self._error(503, f"the pod does not serve: {why}", "service_unavailable", retry_after=True)
                return
            if not agent.gate.enter():
                self._error(503, "the pod is draining", "service_unavailable", retry_after=True)
                return
            outcome = "error"
            try:
                outcome = self._forward(body)
            finally:
                agent.gate.leave(outcome)

        def _forward(self, body: bytes) -> str:
            conn = http.client.HTTPConnection(agent.config.host, vllm.API_PORT, timeout=UPSTREAM_TIMEOUT_S)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            try:
                conn.request(self.command, self.path, body=body if self.command == "POST" else None,
                             headers={**headers, "Content-Length": str(len(body))} if self.command == "POST"
                             else headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._error(503, f"vLLM did not answer: {e}", "service_unavailable", retry_after=True)
                return "unreachable"
            try:
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP and k.lower() not in ("server", "date"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length")
                if length is not None:
                    data = resp.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:  # a stream: passed on as it comes, the end of the connection ends it
                    self.send_header("Connection", "close")
                    self.close_connection = True
                    self.end_headers()
                    while chunk := resp.read1(65536):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                return "ok" if resp.status < 400 else str(resp.status)
            except (OSError, http.client.HTTPException):
                self.close_connection = True
                return "cut"
            finally:
                conn.close()

    return Handler


def serve_http(agent: VllmAgent, host: str, port: int) -> ThreadingHTTPServer:
    server = oai.QuietServer((host, port), make_handler(agent))
    threading.Thread(target=server.serve_forever, daemon=True, name="http").start()
    return server


# ---------------------------------------------------------------------------------------- metrics
class VllmCollector(Collector):
    """The agent's own series and vLLM's, each of vLLM's labelled with the deployment."""

    def __init__(self, agent: VllmAgent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a, s = self.agent, self.agent.supervisor.state
        labels, base = ["deployment", "pod_index"], [a.config.deployment, str(a.config.pod_index)]
        up = GaugeMetricFamily("shardwise_engine_up", "1 while vLLM answers /health.", labels=labels)
        up.add_metric(base, 1.0 if s.healthy else 0.0)
        yield up
        c = CounterMetricFamily("shardwise_engine_restarts", "Times the agent restarted vLLM.", labels=labels)
        c.add_metric(base, float(s.restarts))
        yield c
        g = GaugeMetricFamily("shardwise_requests_in_flight", "Requests passed to vLLM and not finished.",
                              labels=labels)
        g.add_metric(base, float(a.gate.in_flight))
        yield g
        g = GaugeMetricFamily("shardwise_world_generation", "Active world generation.", labels=labels)
        g.add_metric(base, float(a.active))
        yield g
        yield from a.engine_families()


def serve_metrics(agent: VllmAgent, host: str, port: int) -> tuple[Any, int]:
    """The metrics server, always in Prometheus' text format: prometheus_client's OpenMetrics output (which
    Prometheus asks for first) rewrites `vllm:` sample names to `vllm_`, and the series must keep vLLM's names."""
    registry = CollectorRegistry()
    registry.register(VllmCollector(agent))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404)
                return
            data = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server, server.server_address[1]


def vllm_python() -> str:
    """The interpreter with vLLM: SHARDWISE_VLLM_PYTHON, else the image's python3. The local cluster sets the
    variable to the vLLM environment `make install` built, its stand-in for the image (devcluster/cluster.py)."""
    return os.environ.get("SHARDWISE_VLLM_PYTHON") or "python3"


def drain_timeout(args: Sequence[str], default: float = 120.0) -> float:
    """vLLM's --shutdown-timeout among its arguments: how long a drain may wait."""
    for i, a in enumerate(args):
        if a == "--shutdown-timeout" and i + 1 < len(args) and args[i + 1].isdigit():
            return float(args[i + 1])
        if a.startswith("--shutdown-timeout=") and a.split("=", 1)[1].isdigit():
            return float(a.split("=", 1)[1])
    return default
