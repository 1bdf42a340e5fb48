"""`make bench-router`: the router in front of 4 DPA groups, and its own cost (figures go into the README).

- Policy: tiny-moe on 4 DPA groups (4 agents, one rank each) behind `shardwise router`, once with `--policy load`
  and once with `--policy round-robin`, the same skewed open-loop workload each time: a request every
  ARRIVAL_S, one in four long (a long prompt and LONG_TOKENS of output), the rest short, in an order that
  round-robin maps unevenly onto the groups (as a periodic batch job does); each group decodes MAX_RUNNING
  requests at once and queues the rest (an engine's batch limit). p50/p99 latency, throughput. Twice: one world
  of 4 groups (their ranks step together) and 4 independent one-group engines.
- Overhead: a minimal HTTP upstream that answers at once (so only the router's work is measured), sequential
  requests direct and through the router: the difference of the medians per request, and per streamed token
  (a stream of STREAM_EVENTS events).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import statistics
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from shardwise.agents.client import RouterClient
from shardwise.agents.localrun import LocalDeployment, shardwise_command

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "router.json"
TOKEN = "bench-router"
REQUESTS = 96
ARRIVAL_S = 0.15
LONG_TOKENS, SHORT_TOKENS = 64, 4
OVERHEAD_REQUESTS = 400
STREAM_EVENTS = 200
MAX_RUNNING = 2  # requests a group decodes at once (spec.serving.maxRunning): the rest wait in its queue


def start_router(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([*shardwise_command(), "router", "--port", "0", "--metrics-port", "0", *args],
                            env={**os.environ, "SHARDWISE_AGENT_TOKEN": TOKEN}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or []], daemon=True).start()
    return proc, lines.get(timeout=60).split()[4]


def stop(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)


def post(url: str, body: dict[str, Any]) -> tuple[int, float]:
    started = time.perf_counter()
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            code = r.status
    except urllib.error.HTTPError as e:
        code = e.code
    return code, time.perf_counter() - started


def workload() -> list[dict[str, Any]]:
    out = []
    for i in range(REQUESTS):
        if i % 4 == 0:
            out.append({"prompt": f"long request {i}: " + "a long document to read " * 8, "max_tokens": LONG_TOKENS})
        else:
            out.append({"prompt": f"short {i}", "max_tokens": SHORT_TOKENS})
    return [{"temperature": 0, **b} for b in out]


def run_policy(urls: list[str], policy: str) -> dict[str, Any]:
    proc, url = start_router("--policy", policy)
    try:
        RouterClient(url, TOKEN).put_routes({"groups": [{"group": i, "url": u} for i, u in enumerate(urls)]})
        post(url, {"prompt": "warm", "max_tokens": 2, "temperature": 0})
        results: list[tuple[int, float]] = []
        lock = threading.Lock()

        def one(body: dict[str, Any]) -> None:
            r = post(url, body)
            with lock:
                results.append(r)

        threads = []
        started = time.perf_counter()
        for i, body in enumerate(workload()):
            delay = started + i * ARRIVAL_S - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # the open-loop arrival schedule
            t = threading.Thread(target=one, args=(body,))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
    finally:
        stop(proc)
    lat = sorted(s for _, s in results)
    tokens = sum(b["max_tokens"] for b in workload())
    return {"ok": sum(c == 200 for c, _ in results), "requests": len(results),
            "p50_s": round(statistics.median(lat), 3), "p99_s": round(lat[int(0.99 * (len(lat) - 1))], 3),
            "mean_s": round(statistics.fmean(lat), 3), "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1)}


class Instant(BaseHTTPRequestHandler):
    """An upstream that answers at once: a fixed completion, or STREAM_EVENTS events of a stream."""

    protocol_version = "HTTP/1.1"
    ANSWER = json.dumps({"id": "x", "object": "text_completion", "choices": [
        {"index": 0, "text": "ok", "finish_reason": "length", "token_ids": [1]}]}).encode()
    EVENT = b'data: {"id": "x", "choices": [{"index": 0, "text": "t", "token_ids": [1]}]}\n\n'

    def log_message(self, *_: Any) -> None:
        return

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(STREAM_EVENTS):
                self.wfile.write(self.EVENT)
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.ANSWER)))
        self.end_headers()
        self.wfile.write(self.ANSWER)

    def do_GET(self) -> None:
        body = b'{"groups": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def overhead() -> dict[str, Any]:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Instant)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    direct = f"http://127.0.0.1:{upstream.server_address[1]}"
    proc, url = start_router()
    try:
        RouterClient(url, TOKEN).put_routes({"groups": [{"group": 0, "url": direct}]})

        def median(target: str, body: dict[str, Any], n: int) -> float:
            for _ in range(20):
                post(target, body)
            return statistics.median(post(target, body)[1] for _ in range(n))

        small = {"prompt": "x", "max_tokens": 1}
        d, r = median(direct, small, OVERHEAD_REQUESTS), median(url, small, OVERHEAD_REQUESTS)
        streamed = {"prompt": "x", "max_tokens": STREAM_EVENTS, "stream": True}
        ds, rs = median(direct, streamed, 50), median(url, streamed, 50)
    finally:
        stop(proc)
        upstream.shutdown()
    return {"direct_ms": round(d * 1000, 3), "via_router_ms": round(r * 1000, 3),
            "overhead_per_request_ms": round((r - d) * 1000, 3),
            "stream_direct_ms": round(ds * 1000, 2), "stream_via_router_ms": round(rs * 1000, 2),
            "overhead_per_streamed_token_us": round((rs - ds - (r - d)) / STREAM_EVENTS * 1e6, 2)}


def main() -> None:
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cpus",
                               "workload": f"{REQUESTS} requests, one every {ARRIVAL_S} s, every 4th long "
                                           f"({LONG_TOKENS} tokens out), the rest {SHORT_TOKENS} tokens",
                               "model": f"tiny-moe, float64, one rank per DPA group, maxRunning {MAX_RUNNING}"}
    results["overhead"] = overhead()
    print(json.dumps(results["overhead"], indent=2), flush=True)
    # one world of 4 DPA groups (their ranks step together: the MoE layers' all-to-all spans them), then 4
    # independent one-group engines (as vLLM replicas behind one address are)
    for setup, worlds in (("one_world", [dict(dpa=4, agents=4)]), ("independent", [dict(dpa=1, agents=1)] * 4)):
        deps = [LocalDeployment(model="tiny-moe", tp=1, pp=1, max_model_len=512, max_running=MAX_RUNNING,
                                log=lambda _: None, token=TOKEN, **w)  # the router's polls carry it
                for w in worlds]
        try:
            for dep in deps:
                dep.start()
            urls = [ap.http for dep in deps for ap in dep.procs]
            runs: dict[str, list[dict[str, Any]]] = {}
            for policy in ("round-robin", "load", "round-robin", "load"):  # twice each, interleaved: less drift
                r = run_policy(urls, policy)
                print(setup, policy, json.dumps(r), flush=True)
                runs.setdefault(policy.replace("-", "_"), []).append(r)
        finally:
            for dep in deps:
                dep.stop()
        out = {key: {k: round(statistics.fmean(r[k] for r in rs), 3) for k in rs[0]} for key, rs in runs.items()}
        out["p99_load_over_round_robin"] = round(out["load"]["p99_s"] / out["round_robin"]["p99_s"], 3)
        out["p50_load_over_round_robin"] = round(out["load"]["p50_s"] / out["round_robin"]["p50_s"], 3)
        results[setup] = out
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
