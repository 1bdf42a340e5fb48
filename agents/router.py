"""The router: one stable OpenAI endpoint per InferenceDeployment in front of its DPA groups (`shardwise router`).

    POST /v1/completions, /v1/chat/completions   forwarded to one DPA group's leader pod (X-Shardwise-Group: N)
    GET  /v1/models                               forwarded to a serving group
    GET  /healthz                                 200 while at least one group admits requests
    GET  /v1/router                               the route table and each group's state (JSON)
    PUT  /v1/router/routes                        the route table, from the operator (agent token)
    GET  /metrics                                 Prometheus, on --metrics-port, every series with a `group` label

The operator owns the route table: which DPA groups exist, the URL of each group's leader pod, and whether a
group admits new requests (a group that drains, leaves, joins or belongs to a lost pod does not). It pushes the
table on every change and before it starts draining a group, so the router stops sending to that group before
the group stops admitting. Between pushes the router polls every leader's `/v1/stats` (queue depth, running
requests, KV-cache use, whether the group admits) a few times a second.

Policy (`--policy`): `load` sends a request to the admitting group that can start it soonest: the least work
outstanding through this router (prompt and output tokens of its requests in flight, estimated before the
engine tokenizes), plus a penalty for requests the group reports waiting that this router did not send (its own
are in the work already) and for a KV cache close to full;
`round-robin` cycles through the admitting groups. With `--prefix-affinity` a request whose first AFFINITY_CHARS
prompt characters (about one KV-cache block) hash to a group goes there while that group has headroom (its load
within AFFINITY_HEADROOM_TOKENS of the least loaded), so an engine's prefix cache sees the same prefixes.

Delivery: a request refused before any group accepted it (connection refused, 503 while a group drains or
switches) is sent to another group, or waits for one, until `--retry-seconds`; a request a group accepted is never
sent twice: when the group's pod goes away with it the client gets a 502 with code `request_lost` (a stream ends
with an error event and `[DONE]`). On SIGTERM the router refuses new requests (503), lets the accepted ones finish
for up to `--drain-seconds`, then ends what is left explicitly: a 502 `request_lost` saying the router shut down,
or for a stream an error event.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import itertools
import json
import logging
import secrets
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from shardwise.agents import openai_api as oai
from shardwise.agents.auth import bearer_ok
from shardwise.agents.runtime.latency import Histogram

log = logging.getLogger("shardwise.router")

MAX_BODY = 1 << 20
CLIENT_TIMEOUT_S = 30
UPSTREAM_TIMEOUT_S = 600
POLL_S = 0.25
REFUSAL_BACKOFF_S = 0.1
UNAVAILABLE_MAX_S = 0.25  # the longest pause after a 503 (a refused connection: the group's Retry-After, 1 s)
STALE_S = 2.0  # polled state older than this is ignored
AFFINITY_CHARS = 64  # the prompt's first block: about 16 tokens, one KV-cache block; shorter prompts have no affinity
AFFINITY_HEADROOM_TOKENS = 512
QUEUE_PENALTY_TOKENS = 256  # a request the group says is waiting counts like this many tokens of work
KV_FULL = 0.9  # KV-cache use above which a group is penalised
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PROXIED_HEADERS = ("Content-Type", "X-Request-Id", "X-Shardwise-World", "Retry-After", "Cache-Control")


class NoGroup(Exception):
    """No group took the request before the deadline."""


@dataclass
class Group:
    """One DPA group: its leader's URL, what the operator says of it and what its agent last reported."""

    group: int
    url: str
    admitting: bool = True
    work: int = 0  # estimated tokens of the requests in flight through this router
    in_flight: int = 0
    queue_depth: int = 0
    running: int = 0
    kv_usage: float = 0.0
    reported_admitting: bool = True
    polled_at: float = 0.0
    refused_until: float = 0.0  # after a refusal (connection refused, 503): skipped until then
    refusals: int = 0  # refusals in a row: the pause before the next try doubles from REFUSAL_BACKOFF_S
    chosen: int = 0  # when it was last chosen (a sequence number): ties go to the group idle longest
    sent: int = 0  # requests this router has sent it, ever
    mine_at_poll: int = 0  # of the requests in its last report, how many may be this router's (counted in `work`)
    requests: dict[str, int] = field(default_factory=dict)  # answer code -> count

    def live_state(self, now: float) -> tuple[int, int, float, bool]:
        if now - self.polled_at > STALE_S:
            return 0, 0, 0.0, True
        return self.queue_depth, self.running, self.kv_usage, self.reported_admitting

    def load(self, now: float) -> float:
        queue, _running, kv, _ = self.live_state(now)
        others_waiting = max(0, queue - self.mine_at_poll)  # this router's own waiting requests are in `work`
        return self.work + QUEUE_PENALTY_TOKENS * others_waiting + (4096 * (kv - KV_FULL) if kv > KV_FULL else 0.0)

    def usable(self, now: float) -> bool:
        return self.admitting and self.refused_until <= now and self.live_state(now)[3]


@dataclass(frozen=True)
class Options:
    deployment: str = "local"
    token: str = ""  # the agent token: what PUT /v1/router/routes must carry
    api_key: str = ""  # when set, every API request must carry `Authorization: Bearer <api key>`
    policy: str = "load"  # or round-robin
    prefix_affinity: bool = False
    retry_s: float = 30.0
    drain_s: float = 25.0


def estimate_work(data: dict[str, Any]) -> tuple[int, str]:
    """(estimated tokens of prompt and output, the text that chooses a group under prefix affinity)."""
    if isinstance(data.get("messages"), list):
        text = "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in data["messages"])
    else:
        prompt = data.get("prompt", "")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            text, prompt_tokens = " ".join(map(str, prompt[:64])), len(prompt)
            out = data.get("max_tokens") or data.get("max_completion_tokens") or 16
            return prompt_tokens + int(out) if isinstance(out, int) else prompt_tokens + 16, text
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)[:4096]
    out = data.get("max_tokens") or data.get("max_completion_tokens") or 16
    n = int(data["n"]) if isinstance(data.get("n"), int) else 1
    return (len(text) // 4 + 1 + (int(out) if isinstance(out, int) else 16)) * max(1, n), text


class Router:
    """The route table, the groups' state and the choice of a group; thread-safe."""

    def __init__(self, options: Options, clock: Any = time.monotonic) -> None:
        self.options, self.clock = options, clock
        self.cond = threading.Condition()
        self.groups: dict[int, Group] = {}
        self.model = ""
        self.version = ""
        self.world = 0
        self.rr = itertools.count()
        self.picks = itertools.count(1)
        self.retries: dict[str, int] = {}
        self.latency: dict[int, Histogram] = {}  # group -> its answers' durations
        self.closing = False  # SIGTERM: no new requests
        self.cut_streams = False  # the drain time is over: requests still running end with an explicit error
        self.upstreams: set[http.client.HTTPConnection] = set()  # connections to groups, in use
        self.accepted = 0

    # ------------------------------------------------------------------------------------------ table
    def set_routes(self, table: dict[str, Any]) -> str:
        groups = table.get("groups")
        if not isinstance(groups, list):
            raise oai.bad('the table must be {"groups": [{"group": N, "url": "http://...", "admitting": bool}]}',
                          "groups")
        new: dict[int, tuple[str, bool]] = {}
        for g in groups:
            if not (isinstance(g, dict) and isinstance(g.get("group"), int) and isinstance(g.get("url"), str)
                    and _http_address(g["url"])):
                raise oai.bad(f"a group must have an integer group and an http:// url, got {json.dumps(g)[:200]}",
                              "groups")
            new[int(g["group"])] = (str(g["url"]).rstrip("/"), bool(g.get("admitting", True)))
        world = int(table.get("world") or 0)
        with self.cond:
            for gid in list(self.groups):
                if gid not in new or self.groups[gid].url != new[gid][0]:
                    old = self.groups.pop(gid)
                    if gid in new and old.in_flight:  # same group number on another pod (renumbered world)
                        log.info("group %d moved from %s to %s", gid, old.url, new[gid][0])
            for gid, (url, admitting) in new.items():
                g = self.groups.setdefault(gid, Group(gid, url))
                if admitting and (not g.admitting or world != self.world):
                    # the operator says it serves (a new world, or admitting again): the refusals and the report
                    # of the old state no longer hold, so the next request goes to it now, not after the backoff
                    g.refused_until, g.refusals, g.polled_at = 0.0, 0, 0.0
                g.admitting = admitting
            self.model = str(table.get("model") or self.model)
            self.world = world
            self.version = str(table.get("version") or _version(table))
            self.cond.notify_all()
        log.info("routes %s: %s", self.version, {g: (u, a) for g, (u, a) in sorted(new.items())})
        return self.version

    def describe(self) -> dict[str, Any]:
        now = self.clock()
        with self.cond:
            return {"version": self.version, "model": self.model, "world": self.world, "policy": self.options.policy,
                    "prefixAffinity": self.options.prefix_affinity, "closing": self.closing,
                    "groups": [{"group": g.group, "url": g.url, "admitting": g.admitting, "usable": g.usable(now),
                                "inFlight": g.in_flight, "work": g.work, "queueDepth": g.queue_depth,
                                "running": g.running, "kvCacheUsage": g.kv_usage,
                                "reportedAdmitting": g.reported_admitting, "requests": dict(g.requests)}
                               for g in sorted(self.groups.values(), key=lambda g: g.group)]}

    def serving(self) -> bool:
        with self.cond:
            return not self.closing and any(g.admitting for g in self.groups.values())

    # ------------------------------------------------------------------------------------------ choice
    def choose(self, tried: set[int], work: int, key: str) -> Group | None:
        """The group for a request not yet sent to `tried`; None when no group can take it now."""
        now = self.clock()
        with self.cond:
            usable = sorted((g for g in self.groups.values() if g.usable(now) and g.group not in tried),
                            key=lambda g: g.group)
            if not usable:
                return None
            if self.options.policy == "round-robin":
                pick = usable[next(self.rr) % len(usable)]
            else:
                best = min(usable, key=lambda g: (g.load(now), g.in_flight, g.chosen))
                pick = best
                if self.options.prefix_affinity and len(key) >= AFFINITY_CHARS:
                    sticky = max(usable, key=lambda g: _rendezvous(key[:AFFINITY_CHARS], g.group))
                    if sticky.load(now) <= best.load(now) + AFFINITY_HEADROOM_TOKENS:
                        pick = sticky
            pick.work += work
            pick.in_flight += 1
            pick.sent += 1
            pick.chosen = next(self.picks)
            return pick

    def release(self, g: Group, work: int, code: str, seconds: float) -> None:
        with self.cond:
            g.work -= work
            g.in_flight -= 1
            g.requests[code] = g.requests.get(code, 0) + 1
            if code not in ("refused", "503", "error"):
                g.refusals = 0  # it answered: the next refusal starts the backoff again
            self.latency.setdefault(g.group, Histogram(BUCKETS)).observe(seconds)
            self.cond.notify_all()

    def refused(self, g: Group, why: str, seconds: float = 1.0) -> None:
        """Skip `g` for a while: 0.1 s after a first refusal, doubling with each one in a row up to `seconds`,
        so that a group back from a recovery is tried again soon while one that stays down costs few tries."""
        with self.cond:
            g.refused_until = self.clock() + min(seconds, REFUSAL_BACKOFF_S * 2 ** min(g.refusals, 16))
            g.refusals += 1
            self.retries[why] = self.retries.get(why, 0) + 1

    def wait_for_change(self, timeout: float) -> None:
        with self.cond:
            self.cond.wait(timeout)

    # ------------------------------------------------------------------------------------------ polling
    def poll_once(self) -> None:
        with self.cond:
            urls = {g.url for g in self.groups.values()}
        for url in sorted(urls):
            with self.cond:  # what this router had there as the poll left: its report may hold these and any sent since
                before = {g.group: (g.in_flight, g.sent) for g in self.groups.values() if g.url == url}
            try:
                stats = _get_json(url + "/v1/stats", timeout=1.0, token=self.options.token)
            except (OSError, ValueError, http.client.HTTPException):
                continue
            now = self.clock()
            with self.cond:
                for s in stats.get("groups") or []:
                    gid = int(s.get("dpaGroup", 0))
                    g = self.groups.get(gid)
                    if g is None or g.url != url:
                        continue
                    g.queue_depth, g.running = int(s.get("queueDepth", 0)), int(s.get("runningRequests", 0))
                    g.kv_usage, g.reported_admitting = float(s.get("kvCacheUsage", 0.0)), not s.get("draining")
                    in_flight, sent = before.get(gid, (0, g.sent))
                    g.mine_at_poll = in_flight + g.sent - sent
                    g.polled_at = now
                self.cond.notify_all()

    def poll_forever(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            try:
                self.poll_once()
            except Exception:  # a poll must never end the loop
                log.exception("polling the groups failed")


def _http_address(url: str) -> bool:
    try:
        u = urllib.parse.urlsplit(url)
        return u.scheme == "http" and bool(u.hostname) and u.port is not None and u.path in ("", "/")
    except ValueError:
        return False


def _rendezvous(key: str, group: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{group}\0{key}".encode(), digest_size=8).digest(), "big")


def _version(table: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]


def _get_json(url: str, timeout: float, token: str = "") -> dict[str, Any]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=timeout)
    try:
        conn.request("GET", u.path, headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise ValueError(f"{url}: HTTP {r.status}")
        data = json.loads(body)
        return data if isinstance(data, dict) else {}
    finally:
        conn.close()


class _Sent(Exception):
    """The request reached a group, which then went away before answering in full."""


def make_handler(router: Router) -> type[BaseHTTPRequestHandler]:
    opts = router.options

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "shardwise-router"
        timeout = CLIENT_TIMEOUT_S

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _json(self, code: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _error(self, e: oai.ApiError) -> None:
            self._json(e.status, e.body(), e.headers)

        def _authorized(self, secret: str) -> bool:
            return bearer_ok(self.headers.get("Authorization"), secret)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            try:
                if path in ("/healthz", "/health"):
                    ok = router.serving()
                    self._json(200 if ok else 503, {"ok": ok, "routes": router.version})
                elif path == "/v1/router":
                    self._json(200, router.describe())
                elif path == "/v1/models":
                    self._check_key()
                    self._forward("GET", path, b"", 0, "", stream=False)
                else:
                    raise oai.ApiError(404, f"no route {self.path}", code="not_found")
            except oai.ApiError as e:
                self._error(e)

        def do_PUT(self) -> None:
            try:
                body = oai.read_body(self, MAX_BODY)
                if self.path.split("?")[0] != "/v1/router/routes":
                    raise oai.ApiError(404, f"no route {self.path}", code="not_found")
                if not self._authorized(opts.token):
                    raise oai.ApiError(401, "the route table must carry the deployment's agent token",
                                       code="invalid_token")
                version = router.set_routes(oai.parse_json(body))
                self._json(200, {"version": version})
            except oai.ApiError as e:
                self._error(e)

        def _check_key(self) -> None:
            if opts.api_key and not self._authorized(opts.api_key):
                raise oai.ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key")

        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            try:
                body = oai.read_body(self, MAX_BODY)
                if path not in ("/v1/completions", "/v1/chat/completions"):
                    raise oai.ApiError(404, f"no route {self.path}", code="not_found")
                self._check_key()
                data = oai.parse_json(body)
                if not isinstance(data, dict):
                    raise oai.bad("the body must be a JSON object")
                model = data.get("model")
                if router.model and model is not None and model != router.model:
                    raise oai.ApiError(404, f"the model {model!r} does not exist; this endpoint serves "
                                            f"{router.model!r}", param="model", code="model_not_found")
                if router.closing:
                    raise oai.ApiError(503, "the router is shutting down", headers={"Retry-After": "1"})
                work, key = estimate_work(data)
                self._forward("POST", path, body, work, key, stream=bool(data.get("stream")))
            except oai.ApiError as e:
                self._error(e)

        # -------------------------------------------------------------------------------- forwarding
        def _forward(self, method: str, path: str, body: bytes, work: int, key: str, *, stream: bool) -> None:
            deadline = time.monotonic() + opts.retry_s
            tried: set[int] = set()
            rid = self.headers.get("X-Request-Id") or secrets.token_hex(8)
            last = "no DPA group is serving"
            while True:
                g = router.choose(tried, work, key)
                if g is None:
                    if tried:
                        tried.clear()  # every group refused once: try them again as they come back
                    if time.monotonic() >= deadline:
                        raise oai.ApiError(503, f"no DPA group took the request within {opts.retry_s:g} s: {last}",
                                           headers={"Retry-After": "1"}, code="no_group")
                    router.wait_for_change(0.05)
                    continue
                start = time.monotonic()
                code = "error"
                try:
                    done, code, last = self._try(g, method, path, body, rid, stream=stream)
                    if done:
                        router.accepted += 1
                        return
                    tried.add(g.group)
                finally:
                    router.release(g, work, code, time.monotonic() - start)

        def _try(self, g: Group, method: str, path: str, body: bytes, rid: str, *,
                 stream: bool) -> tuple[bool, str, str]:
            """Send to one group: (answered, code, why not). Raises nothing for a refusal; a request the group
            accepted and then lost is answered here with an explicit error."""
            u = urllib.parse.urlsplit(g.url)
            conn = http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=UPSTREAM_TIMEOUT_S)
            headers = {"X-Shardwise-Group": str(g.group), "X-Request-Id": rid}
            if body or method == "POST":
                headers.update({"Content-Type": "application/json", "Content-Length": str(len(body))})
            if self.headers.get("Authorization"):
                headers["Authorization"] = self.headers["Authorization"]
            try:
                try:
                    conn.connect()
                    with router.cond:
                        router.upstreams.add(conn)
                    conn.request(method, path, body=body, headers=headers)
                except OSError as e:  # refused or reset before the body was in: the group never had it
                    why = f"group {g.group} ({g.url}) refused the connection: {e.strerror or e}"
                    router.refused(g, "connect")
                    return False, "refused", why
                try:
                    resp = conn.getresponse()
                except (OSError, http.client.HTTPException) as e:
                    self._lost(g, rid, e)
                    return True, "lost", ""
                if resp.status == 503:
                    text = resp.read()
                    retry_after = resp.getheader("Retry-After") or "1"
                    # a group that answers (recovering, switching, full) is tried again within a quarter second
                    router.refused(g, "unavailable", min(UNAVAILABLE_MAX_S, float(retry_after)
                                                         if retry_after.isdigit() else 1.0))
                    return False, "503", f"group {g.group} answered 503: {_message(text)}"
                self._relay(g, resp, rid)
                return True, str(resp.status), ""
            finally:
                with router.cond:
                    router.upstreams.discard(conn)
                conn.close()

        def _relay(self, g: Group, resp: http.client.HTTPResponse, rid: str) -> None:
            streaming = (resp.getheader("Content-Type") or "").startswith("text/event-stream")
            if not streaming:
                try:
                    payload = resp.read()
                except (OSError, http.client.HTTPException) as e:
                    self._lost(g, rid, e)
                    return
                self._relay_head(g, resp, ("Content-Length", str(len(payload))))
                self.wfile.write(payload)
                return
            self._relay_head(g, resp, ("Connection", "close"))
            self.close_connection = True
            ended = False
            try:
                for line in _lines(resp):
                    self.wfile.write(line)
                    if line == b"\n":
                        self.wfile.flush()
                    if line.startswith(b"data: [DONE]"):
                        ended = True
                    if router.cut_streams:
                        break
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return  # the client left; closing the upstream connection ends the request there
            except (OSError, http.client.HTTPException) as e:
                self._stream_error(g, rid, f"lost: group {g.group} ({g.url}) went away mid-stream: {e}")
                return
            if not ended:
                why = ("the router shut down before the stream ended" if router.closing
                       else f"lost: group {g.group} ({g.url}) ended the stream without [DONE]")
                self._stream_error(g, rid, why)

        def _relay_head(self, g: Group, resp: http.client.HTTPResponse, extra: tuple[str, str]) -> None:
            """The group's status and the headers passed on, which group answered, and `extra`."""
            self.send_response(resp.status)
            for h in PROXIED_HEADERS:
                if resp.getheader(h):
                    self.send_header(h, str(resp.getheader(h)))
            self.send_header("X-Shardwise-Group", str(g.group))
            self.send_header(*extra)
            self.end_headers()

        def _stream_error(self, g: Group, rid: str, message: str) -> None:
            try:
                event = oai.error_body(f"request {rid}: {message}", "server_error", code="request_lost")
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
                self.wfile.flush()
            except OSError:
                pass

        def _lost(self, g: Group, rid: str, e: BaseException) -> None:
            if router.cut_streams:
                message = (f"lost: the router shut down before group {g.group} ({g.url}) answered request {rid}; "
                           f"it was not retried, as it may have run")
            else:
                message = (f"lost: group {g.group} ({g.url}) went away with request {rid} after accepting it "
                           f"({type(e).__name__}: {e}); it was not retried, as it may have run")
            self._json(502, oai.error_body(message, "server_error", code="request_lost"), {"X-Request-Id": rid})

    return Handler


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


def _lines(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while True:
        line = resp.readline(1 << 20)
        if not line:
            return
        yield line


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        r = self.router
        d = r.options.deployment
        with r.cond:
            groups = sorted(r.groups.values(), key=lambda g: g.group)
            requests = CounterMetricFamily("shardwise_router_requests", "Requests answered, by group and code.",
                                           labels=["deployment", "group", "code"])
            gauges: dict[str, tuple[str, Callable[[Group], float]]] = {
                "in_flight": ("Requests in flight through the router.", lambda g: g.in_flight),
                "outstanding_tokens": ("Estimated tokens of the requests in flight.", lambda g: g.work),
                "group_queue_depth": ("Requests the group reports waiting.", lambda g: g.queue_depth),
                "group_running_requests": ("Requests the group reports running.", lambda g: g.running),
                "group_kv_cache_usage_ratio": ("KV-cache use the group reports.", lambda g: g.kv_usage),
                "group_admitting": ("1 while the operator lets the group take requests.",
                                    lambda g: 1.0 if g.admitting else 0.0),
            }
            out: list[Metric] = []
            for g in groups:
                for code, n in sorted(g.requests.items()):
                    requests.add_metric([d, str(g.group), code], float(n))
            out.append(requests)
            for name, (doc, get) in gauges.items():
                m = GaugeMetricFamily(f"shardwise_router_{name}", doc, labels=["deployment", "group"])
                for g in groups:
                    m.add_metric([d, str(g.group)], float(get(g)))
                out.append(m)
            retries = CounterMetricFamily("shardwise_router_retries",
                                          "Requests sent to another group after a refusal, by reason.",
                                          labels=["deployment", "reason"])
            for why, n in sorted(r.retries.items()):
                retries.add_metric([d, why], float(n))
            out.append(retries)
            hist = HistogramMetricFamily("shardwise_router_request_seconds",
                                         "Time from a group's choice to the end of its answer.",
                                         labels=["deployment", "group"])
            for gid, h in sorted(r.latency.items()):
                buckets, total = h.cumulative()
                hist.add_metric([d, str(gid)], buckets, total)
            out.append(hist)
        yield from out


@dataclass
class Running:
    router: Router
    server: ThreadingHTTPServer
    metrics: Any
    stop: threading.Event

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def metrics_port(self) -> int:
        return int(self.metrics.server_port) if self.metrics is not None else 0

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        if self.metrics is not None:
            self.metrics.shutdown()


def start(options: Options, host: str, port: int, metrics_port: int | None = None) -> Running:
    """Serve the router on host:port (and /metrics on metrics_port unless None); returns at once."""
    router = Router(options)
    server = oai.QuietServer((host, port), make_handler(router))
    stop = threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True, name="router-http").start()
    threading.Thread(target=router.poll_forever, args=(stop,), daemon=True, name="router-poll").start()
    metrics = None
    if metrics_port is not None:
        registry = CollectorRegistry()
        registry.register(RouterCollector(router))
        metrics, _ = start_http_server(metrics_port, addr=host, registry=registry)
    return Running(router, server, metrics, stop)


def run(options: Options, host: str, port: int, metrics_port: int) -> int:
    """`shardwise router`: serve until SIGTERM, then refuse new requests and let the accepted ones finish."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    running = start(options, host, port, metrics_port)
    print(f"router for {options.deployment} on http://{host}:{running.port} (policy {options.policy}) metrics "
          f"{running.metrics_port}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    r = running.router
    with r.cond:
        r.closing = True
    deadline = time.monotonic() + options.drain_s
    while time.monotonic() < deadline:
        with r.cond:
            busy = sum(g.in_flight for g in r.groups.values())
            if not busy:
                break
            r.cond.wait(0.1)
    with r.cond:
        r.cut_streams = True
        left = sum(g.in_flight for g in r.groups.values())
        for conn in list(r.upstreams):  # each waiting handler then answers its client with an explicit error
            with contextlib.suppress(OSError):
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)
    if left:
        log.warning("shutting down with %d requests in flight: each ends with an explicit error", left)
        end = time.monotonic() + 2
        while time.monotonic() < end and sum(g.in_flight for g in r.groups.values()) > 0:
            r.wait_for_change(0.1)
    running.close()
    return 0
