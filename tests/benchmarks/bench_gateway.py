"""Gateway overhead: CPU per request and per relayed stream chunk, added latency, throughput.

    python tests/benchmarks/bench_gateway.py                       # this checkout, 1 and 2 gateway processes
    python tests/benchmarks/bench_gateway.py --variant before=/tmp/old/.venv/bin/python --variant after=python

Three parts, as in issue #21:

- a mock OpenAI upstream (raw asyncio, no framework: it must cost next to nothing) answering
  ``/v1/completions`` with a small JSON body or a stream of ``--chunks`` content events (``--chunk-gap-ms``
  apart, as a worker spaces its tokens: with no gap the events would coalesce in the socket and the relay
  would see one read per stream);
- a load generator (raw asyncio HTTP/1.1 over keep-alive connections, one per simulated client) that checks
  every answer: status 200, and for streams every content event then ``[DONE]``;
- the direct baseline: the same load straight at the mock, to subtract from the gateway's latency.

The gateway (``PYTHON -m squeezeserve.service.cli gateway``, each ``--variant``'s interpreter) is pinned to
core 0 with ``--workers 1`` (to cores 0-1 with ``--workers 2``); the mock and the load generator share core
1. The gateway's CPU is read from ``/proc/PID/stat`` (user + system time of its process tree), so other load
on the machine does not inflate it; throughput and latency do suffer from such load, hence the load average
in every row. One row per (variant, workers, phase) is appended to ``results/gateway.csv``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "gateway.csv"
MODEL = "mock-model"
FIELDS = [
    "date",
    "variant",
    "target",
    "gateway_processes",
    "phase",
    "concurrency",
    "seconds",
    "requests",
    "errors",
    "incomplete_streams",
    "requests_per_s",
    "chunks_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "added_p50_ms",
    "added_p99_ms",
    "gateway_cpu_ms_per_request",
    "gateway_cpu_ms_per_chunk",
    "cpu_model",
    "cpu_flags",
    "loadavg_start",
    "loadavg_end",
]
GATEWAY_CORES = {1: {0}, 2: {0, 1}}
LOAD_CORES = {1}


# -- mock upstream -----------------------------------------------------------------------------------------


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _http(status: str, content_type: bytes, body: bytes) -> bytes:
    head = b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
        status.encode(),
        content_type,
        len(body),
    )
    return head + body


class Mock:
    """Canned answers; a stream is ``chunks`` content events, a finish event, the usage event when asked for
    (``stream_options.include_usage``) and ``[DONE]``, each written on its own."""

    def __init__(self, chunks: int, chunk_gap: float) -> None:
        common = {"id": "cmpl-mock", "object": "text_completion", "created": 0, "model": MODEL}
        usage = {"prompt_tokens": 4, "completion_tokens": chunks, "total_tokens": 4 + chunks}
        choice = {"index": 0, "text": "tok ", "finish_reason": None, "logprobs": None}
        self.content = _chunked(_event({**common, "choices": [choice]}))
        self.finish = _chunked(
            _event({**common, "choices": [{**choice, "text": "", "finish_reason": "length"}]})
        )
        self.usage = _chunked(_event({**common, "choices": [], "usage": usage}))
        self.done = _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        choice = {"index": 0, "text": "tok " * chunks, "finish_reason": "length", "logprobs": None}
        answer = json.dumps({**common, "choices": [choice], "usage": usage}).encode()
        self.json = _http("200 OK", b"application/json", answer)
        cards = {
            "object": "list",
            "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "mock"}],
        }
        self.models = _http("200 OK", b"application/json", json.dumps(cards).encode())
        self.health = _http("200 OK", b"application/json", b"{}")
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        self.chunks = chunks
        self.chunk_gap = chunk_gap

    async def stream(self, transport: asyncio.Transport, include_usage: bool) -> None:
        transport.write(self.stream_head)
        for _ in range(self.chunks):
            await asyncio.sleep(self.chunk_gap)
            if transport.is_closing():
                return
            transport.write(self.content)
        transport.write(self.finish)
        if include_usage:
            transport.write(self.usage)
        transport.write(self.done)


class MockProtocol(asyncio.Protocol):
    transport: asyncio.Transport

    def __init__(self, mock: Mock) -> None:
        self.mock = mock
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            length = 0
            if (at := head.find(b"content-length:")) >= 0:
                length = int(head[at + 15 :].split(b"\r\n", 1)[0])
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self.answer(head.split(b" ", 2)[1], body)

    def answer(self, path: bytes, body: bytes) -> None:
        if path == b"/health":
            self.transport.write(self.mock.health)
        elif path == b"/v1/models":
            self.transport.write(self.mock.models)
        else:
            request = json.loads(body)
            if request.get("stream"):
                include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
                asyncio.ensure_future(self.mock.stream(self.transport, include_usage))
            else:
                self.transport.write(self.mock.json)


def serve_mock(port: int, chunks: int, chunk_gap: float) -> None:
    import uvloop

    async def main() -> None:
        mock = Mock(chunks, chunk_gap)
        server = await asyncio.get_running_loop().create_server(
            lambda: MockProtocol(mock), "127.0.0.1", port, backlog=1024
        )
        await server.serve_forever()

    uvloop.run(main())


# -- load generator ----------------------------------------------------------------------------------------


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    incomplete: int = 0
    chunks: int = 0


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    if (at := lower.find(b"content-length:")) >= 0:
        return status, await reader.readexactly(int(lower[at + 15 :].split(b"\r\n", 1)[0]))
    if b"transfer-encoding: chunked" not in lower:
        return status, await reader.read()  # ends with the connection
    parts = []
    while size := int((await reader.readline()).split(b";", 1)[0], 16):
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
    await reader.readline()  # the blank line after the last chunk
    return status, b"".join(parts)


async def _client(port: int, request: bytes, stream: bool, chunks: int, until: float, tally: Tally) -> None:
    reader = writer = None
    while time.perf_counter() < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert reader is not None
            started = time.perf_counter()
            writer.write(request)
            status, body = await _read_response(reader)
            tally.latencies.append(time.perf_counter() - started)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            tally.errors += 1
            writer = None
            await asyncio.sleep(0.01)
            continue
        if status != 200:
            tally.errors += 1
        elif stream:
            delivered = body.count(b'"text":"tok "')
            tally.chunks += delivered
            if delivered != chunks or not body.endswith(b"data: [DONE]\n\n") or b'"error"' in body:
                tally.incomplete += 1
    if writer is not None:
        writer.close()


def _request(port: int, stream: bool) -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "Say something fast", "max_tokens": 16, "stream": stream})
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n{body}"
    ).encode()


def run_load(port: int, concurrency: int, seconds: float, stream: bool, chunks: int) -> Tally:
    import uvloop

    async def main() -> Tally:
        tally = Tally()
        request = _request(port, stream)
        until = time.perf_counter() + seconds
        await asyncio.gather(
            *(_client(port, request, stream, chunks, until, tally) for _ in range(concurrency))
        )
        return tally

    return uvloop.run(main())


# -- measuring ---------------------------------------------------------------------------------------------


def _tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its live descendants."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _cpu_info() -> tuple[str, str]:
    model = flags = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = value.strip()
    return model, flags


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url_port: int, path: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    request = f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", url_port), timeout=2) as sock:
                sock.sendall(request)
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing ready on port {url_port}{path} after {timeout:.0f} s")


def _pinned(cores: set[int]):
    return lambda: os.sched_setaffinity(0, cores)


@dataclass
class Phase:
    name: str
    concurrency: int
    stream: bool


PHASES = [Phase("json c=1", 1, False), Phase("json c=64", 64, False), Phase("stream c=64", 64, True)]


def measure(
    args: argparse.Namespace,
    variant: str,
    target: str,
    processes: int,
    port: int,
    pid: int | None,
    direct: dict[str, Tally],
) -> list[dict]:
    model, flags = _cpu_info()
    rows = []
    for phase in PHASES:
        run_load(port, phase.concurrency, min(1.0, args.seconds / 4), phase.stream, args.chunks)  # warm up
        load_start = _loadavg()
        cpu_start = _tree_cpu_seconds(pid) if pid else 0.0
        started = time.perf_counter()
        tally = run_load(port, phase.concurrency, args.seconds, phase.stream, args.chunks)
        elapsed = time.perf_counter() - started
        cpu = _tree_cpu_seconds(pid) - cpu_start if pid else 0.0
        n = len(tally.latencies)
        p50, p99 = (statistics.quantiles(tally.latencies, n=100)[i] * 1e3 for i in (49, 98))
        row = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "variant": variant,
            "target": target,
            "gateway_processes": processes if pid else 0,
            "phase": phase.name,
            "concurrency": phase.concurrency,
            "seconds": f"{elapsed:.1f}",
            "requests": n,
            "errors": tally.errors,
            "incomplete_streams": tally.incomplete if phase.stream else "",
            "requests_per_s": f"{n / elapsed:.0f}",
            "chunks_per_s": f"{tally.chunks / elapsed:.0f}" if phase.stream else "",
            "latency_p50_ms": f"{p50:.3f}",
            "latency_p99_ms": f"{p99:.3f}",
            "added_p50_ms": "",
            "added_p99_ms": "",
            "gateway_cpu_ms_per_request": f"{cpu * 1e3 / n:.3f}" if pid else "",
            "gateway_cpu_ms_per_chunk": f"{cpu * 1e3 / max(tally.chunks, 1):.4f}"
            if pid and phase.stream
            else "",
            "cpu_model": model,
            "cpu_flags": flags,
            "loadavg_start": load_start,
            "loadavg_end": _loadavg(),
        }
        if pid and phase.name in direct:
            base = direct[phase.name]
            d50, d99 = (statistics.quantiles(base.latencies, n=100)[i] * 1e3 for i in (49, 98))
            row["added_p50_ms"], row["added_p99_ms"] = f"{p50 - d50:.3f}", f"{p99 - d99:.3f}"
        elif not pid:
            direct[phase.name] = tally
        rows.append(row)
        shown = {key: row[key] or "-" for key in FIELDS}
        print(
            f"{variant:>8} {target:>8} x{shown['gateway_processes']} {phase.name:>12}: "
            f"{shown['requests_per_s']:>6} req/s {shown['chunks_per_s']:>6} chunks/s "
            f"p50 {p50:7.3f} ms p99 {p99:7.3f} ms added p50 {shown['added_p50_ms']:>6} ms "
            f"cpu/req {shown['gateway_cpu_ms_per_request']:>6} ms "
            f"cpu/chunk {shown['gateway_cpu_ms_per_chunk']:>6} ms "
            f"errors {tally.errors} incomplete {tally.incomplete}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variant",
        action="append",
        metavar="NAME=PYTHON",
        help="a gateway to measure: a label and the interpreter that has it installed "
        "(repeatable; default: this interpreter, as 'current')",
    )
    parser.add_argument("--workers", default="1,2", help="gateway process counts to measure (default 1,2)")
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase (default 8)")
    parser.add_argument("--chunks", type=int, default=16, help="content events per stream (default 16)")
    parser.add_argument("--chunk-gap-ms", type=float, default=1.0, help="between stream events (default 1)")
    parser.add_argument("--csv", type=Path, default=RESULTS)
    parser.add_argument("--serve-mock", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_mock:
        serve_mock(args.serve_mock, args.chunks, args.chunk_gap_ms / 1e3)
        return

    os.sched_setaffinity(0, LOAD_CORES)
    variants = [v.split("=", 1) for v in args.variant or [f"current={sys.executable}"]]
    worker_counts = [int(n) for n in args.workers.split(",")]
    mock_port = _free_port()
    mock_cmd = [
        sys.executable,
        __file__,
        "--serve-mock",
        str(mock_port),
        "--chunks",
        str(args.chunks),
        "--chunk-gap-ms",
        str(args.chunk_gap_ms),
    ]
    mock = subprocess.Popen(mock_cmd, preexec_fn=_pinned(LOAD_CORES))
    rows: list[dict] = []
    try:
        _wait_ready(mock_port, "/health", mock)
        direct: dict[str, Tally] = {}
        rows += measure(args, "-", "direct", 0, mock_port, None, direct)
        for name, python in variants:
            for workers in worker_counts:
                port = _free_port()
                command = [
                    python,
                    "-m",
                    "squeezeserve.service.cli",
                    "gateway",
                    "--upstream",
                    f"http://127.0.0.1:{mock_port}",
                    "--port",
                    str(port),
                ]
                if workers > 1:
                    command += ["--workers", str(workers)]
                gateway = subprocess.Popen(
                    command, preexec_fn=_pinned(GATEWAY_CORES[workers]), stderr=subprocess.DEVNULL
                )
                try:
                    _wait_ready(port, "/readyz", gateway)
                except RuntimeError as exc:  # e.g. a gateway from before --workers existed
                    print(f"# {name} with {workers} processes skipped: {exc}", flush=True)
                    gateway.kill()
                    continue
                try:
                    rows += measure(args, name, "gateway", workers, port, gateway.pid, direct)
                finally:
                    gateway.terminate()
                    gateway.wait(timeout=30)
    finally:
        mock.terminate()
        mock.wait(timeout=10)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    new = not args.csv.exists()
    with args.csv.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerows(rows)
    print(f"# {len(rows)} rows appended to {args.csv}")


if __name__ == "__main__":
    main()
