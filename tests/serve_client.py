#!/usr/bin/env python3
"""Client side of tests/cli_serve.sh: talks to a running `moe serve` over HTTP with the standard
library only, and exits non-zero (with the failed check) when the server misbehaves.

Usage: serve_client.py MODE PORT [ARGS]
  basic PORT GREEDY_OUT    endpoints, determinism, streaming, concurrency, disconnects, errors,
                           memory over 1,000 requests; writes the greedy completion to GREEDY_OUT
  queue PORT               a server with --slots 1 --max-queued 1 refuses the overflow with 503;
                           its --temperature 0 applies to requests that set no temperature
  greedy PORT EXPECTED     the greedy completion equals the text in the file EXPECTED
  sigterm PORT PID         SIGTERM during a long stream: the stream still ends with [DONE]
"""
import http.client
import json
import os
import signal
import socket
import sys
import threading
import time

HOST = "127.0.0.1"
PORT = 0
PROMPT = "in the beginning 7 the word was"


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def request(method, path, body=None, raw=None, headers=None, timeout=120):
    """One request on its own connection: (status, headers dict, body bytes)."""
    conn = http.client.HTTPConnection(HOST, PORT, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    conn.request(method, path, body=data, headers=h)
    resp = conn.getresponse()
    out = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, out


def post(path, body):
    status, headers, out = request("POST", path, body)
    check(status == 200, f"POST {path} {body}: status {status}: {out[:300]!r}")
    check(headers.get("content-type", "").startswith("application/json"), f"content type {headers}")
    return json.loads(out)


def get(path):
    status, _, out = request("GET", path)
    check(status == 200, f"GET {path}: status {status}: {out[:300]!r}")
    return json.loads(out)


def open_stream(path, body):
    conn = http.client.HTTPConnection(HOST, PORT, timeout=120)
    conn.request("POST", path, body=json.dumps(dict(body, stream=True)).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:  # (the body only on failure: reading it consumes the stream)
        raise AssertionError(f"stream {path}: status {resp.status}: {resp.read()[:300]!r}")
    check(resp.getheader("Content-Type", "").startswith("text/event-stream"),
          f"stream content type {resp.getheader('Content-Type')}")
    return conn, resp


def events(resp):
    """Yields each SSE event's data (a parsed object, or the string "[DONE]")."""
    data = []
    while True:
        line = resp.readline()
        if not line:
            check(not data, "stream ended inside an event")
            return
        line = line.decode().rstrip("\r\n")
        if line == "":
            if data:
                text = "\n".join(data)
                data = []
                yield text if text == "[DONE]" else json.loads(text)
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        else:
            check(line.startswith(":") or ":" in line, f"not an SSE line: {line!r}")


def stream(path, body):
    """All events of a stream, checked to end with exactly one [DONE]."""
    conn, resp = open_stream(path, body)
    evs = list(events(resp))
    conn.close()
    check(evs and evs[-1] == "[DONE]", f"stream does not end with [DONE]: {evs[-3:]}")
    check(evs.count("[DONE]") == 1, "more than one [DONE]")
    return evs[:-1]


def error_of(status, out, want_status, what):
    check(status == want_status, f"{what}: status {status}, expected {want_status}: {out[:300]!r}")
    try:
        body = json.loads(out)
    except ValueError:
        raise AssertionError(f"{what}: error body is not JSON: {out[:300]!r}")
    err = body.get("error") if isinstance(body, dict) else None
    check(isinstance(err, dict), f"{what}: no error object: {body}")
    check(isinstance(err.get("message"), str) and err["message"], f"{what}: no message: {body}")
    check(isinstance(err.get("type"), str) and err["type"], f"{what}: no type: {body}")
    check("param" in err and "code" in err, f"{what}: OpenAI errors carry param and code: {body}")
    return err


def completion_text(body):
    return post("/v1/completions", body)["choices"][0]["text"]


def stream_completion_text(body):
    evs = stream("/v1/completions", body)
    for e in evs:
        check(e["object"] == "text_completion", f"chunk object {e}")
    return "".join(c["text"] for e in evs for c in e["choices"]), evs


def stream_chat_text(body):
    evs = stream("/v1/chat/completions", body)
    for e in evs:
        check(e["object"] == "chat.completion.chunk", f"chunk object {e}")
    return "".join(c["delta"].get("content") or "" for e in evs for c in e["choices"]), evs


def health():
    return get("/health")


def wait_idle(seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        h = health()
        if h["active"] == 0 and h["queued"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"server not idle after {seconds} s: {health()}")


def long_request(model, context, max_tokens=None):
    """A request that runs for seconds: greedy, so the model (which never picks end-of-text
    greedily after this prompt) fills max_tokens, by default most of the context."""
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens or context - 64,
            "temperature": 0}


def usage_ok(u, max_tokens=None):
    check(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], f"usage {u}")
    check(u["prompt_tokens"] >= 1 and u["completion_tokens"] >= 1, f"usage {u}")
    if max_tokens is not None:
        check(u["completion_tokens"] <= max_tokens, f"usage {u} over max_tokens {max_tokens}")


def basic(greedy_out):
    h = health()
    check(h["status"] == "ok" and h["active"] == 0 and h["queued"] == 0, f"health {h}")
    check(h["memory"]["rss_bytes"] > 0 and h["memory"]["tracked"]["weights"] > 0, f"memory {h}")
    check(h["memory"]["tracked"]["kv_cache"] > 0, f"the KV cache is preallocated: {h}")
    models = get("/v1/models")
    check(models["object"] == "list" and len(models["data"]) == 1, f"models {models}")
    model = models["data"][0]["id"]
    check(models["data"][0]["object"] == "model" and model, f"models {models}")
    print("health and models ok, model", model)

    # Non-streaming completion: shape, usage, finish_reason "length" at max_tokens (greedy, so
    # an end-of-text the barely trained model might sample cannot end it early).
    greedy = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = post("/v1/completions", greedy)
    check(r["object"] == "text_completion" and r["model"] == model, f"completion {r}")
    check(isinstance(r["id"], str) and isinstance(r["created"], int), f"completion {r}")
    check(len(r["choices"]) == 1 and r["choices"][0]["index"] == 0, f"choices {r}")
    check(r["choices"][0]["finish_reason"] == "length", f"finish_reason {r}")
    usage_ok(r["usage"], 12)
    check(r["usage"]["completion_tokens"] == 12, f"usage {r['usage']}")
    # The byte tokenizer: one token per byte (plus BOS where the tokenizer adds one).
    check(r["usage"]["prompt_tokens"] in (len(PROMPT.encode()), len(PROMPT.encode()) + 1),
          f"prompt tokens {r['usage']}")
    text = r["choices"][0]["text"]
    check(isinstance(text, str) and text, f"text {r}")
    check(completion_text(greedy) == text, "temperature 0 is not deterministic")
    check(completion_text(dict(greedy, seed=99)) == text, "temperature 0 depends on the seed")
    with open(greedy_out, "w") as f:
        f.write(text)

    chat = {"model": model, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Who was in the beginning?"}],
            "max_tokens": 10, "temperature": 0}
    c = post("/v1/chat/completions", chat)
    check(c["object"] == "chat.completion" and c["model"] == model, f"chat {c}")
    ch = c["choices"][0]
    check(ch["message"]["role"] == "assistant" and isinstance(ch["message"]["content"], str),
          f"chat message {c}")
    check(ch["finish_reason"] in ("length", "stop"), f"chat finish {c}")
    usage_ok(c["usage"], 10)
    if ch["finish_reason"] == "length":
        check(c["usage"]["completion_tokens"] == 10, f"chat usage {c['usage']}")
    print("completion and chat completion ok:", repr(text), repr(ch["message"]["content"]))

    # Seeds: the same seed gives the same text; without one, requests draw fresh seeds.
    sampled = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 7}
    a = post("/v1/completions", sampled)
    b = post("/v1/completions", sampled)
    check(a["choices"][0]["text"] == b["choices"][0]["text"], "same seed, different text")
    check(a["usage"] == b["usage"], "same seed, different usage")
    unseeded = dict(sampled)
    del unseeded["seed"]
    texts = {completion_text(unseeded) for _ in range(6)}
    check(len(texts) > 1, f"six unseeded samples are all the same: {texts}")
    print("seeds ok")

    # Streaming equals non-streaming for the same seed, for both endpoints.
    s_text, evs = stream_completion_text(dict(sampled, stream_options={"include_usage": True}))
    check(s_text == a["choices"][0]["text"], f"stream {s_text!r} != {a['choices'][0]['text']!r}")
    check(all(e["id"] == evs[0]["id"] for e in evs), "chunks of one stream share an id")
    with_choice = [e for e in evs if e["choices"]]
    check(with_choice[-1]["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"],
          f"last chunk's finish_reason {with_choice[-1]}")
    check(all(e["choices"][0]["finish_reason"] is None for e in with_choice[:-1]),
          "finish_reason before the last chunk")
    check(evs[-1]["choices"] == [] and evs[-1]["usage"] == a["usage"],
          f"include_usage: last chunk {evs[-1]} vs {a['usage']}")
    check(all(e.get("usage") is None for e in evs[:-1]), "usage before the last chunk")
    s_text, evs = stream_completion_text(sampled)
    check(s_text == a["choices"][0]["text"], "stream without usage differs")
    check(all(e.get("usage") is None for e in evs), "usage without include_usage")

    chat_sampled = dict(chat, temperature=1.0, seed=11, max_tokens=16)
    nc = post("/v1/chat/completions", chat_sampled)
    s_chat, evs = stream_chat_text(dict(chat_sampled, stream_options={"include_usage": True}))
    check(s_chat == nc["choices"][0]["message"]["content"],
          f"chat stream {s_chat!r} != {nc['choices'][0]['message']['content']!r}")
    check(evs[0]["choices"][0]["delta"].get("role") == "assistant", f"first chat chunk {evs[0]}")
    check(evs[-1]["usage"] == nc["usage"], f"chat stream usage {evs[-1]} vs {nc['usage']}")
    print("streaming ok")

    # Four concurrent streams: each equals its sequential non-streaming result (a sequence's
    # bits do not depend on what it is batched with).
    bodies = [dict(sampled, seed=100 + i, max_tokens=24 + 8 * i) for i in range(4)]
    bodies[3] = dict(chat_sampled, seed=103)
    expected = [completion_text(b) for b in bodies[:3]]
    expected.append(post("/v1/chat/completions", bodies[3])["choices"][0]["message"]["content"])
    got = [None] * 4
    errors = []

    def worker(i):
        try:
            if i == 3:
                got[i] = stream_chat_text(bodies[i])[0]
            else:
                got[i] = stream_completion_text(bodies[i])[0]
        except Exception as e:  # reported by the main thread
            errors.append(f"stream {i}: {e!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(not errors, f"concurrent streams failed: {errors}")
    check(got == expected, f"concurrent streams differ: {got} vs {expected}")
    wait_idle()
    print("4 concurrent streams ok")

    # A client that disconnects after the first event: its request is cancelled, the server
    # goes on serving.
    h = health()
    before = h["requests"]
    conn, resp = open_stream("/v1/completions", long_request(model, h["context"]))
    first = next(events(resp))
    check(first["choices"], f"first event {first}")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    h = wait_idle()
    check(h["requests"]["cancelled"] == before["cancelled"] + 1,
          f"the disconnected request was not cancelled: {before} -> {h['requests']}")
    check(completion_text(greedy) == text, "serving after a disconnect")
    print("disconnect ok: request cancelled, active", h["active"])

    # Malformed requests: the right 4xx and an OpenAI-style error body.
    ctx = h["context"]
    bad = [
        ("not JSON", "POST", "/v1/completions", b"{\"prompt\": ", 400),
        ("JSON array", "POST", "/v1/completions", b"[1, 2]", 400),
        ("unknown field", "POST", "/v1/completions", {"prompt": "x", "bogus": 1}, 400),
        ("wrong type", "POST", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400),
        ("wrong type (chat)", "POST", "/v1/chat/completions", {"messages": "hi"}, 400),
        ("n=2", "POST", "/v1/completions", {"prompt": "x", "n": 2}, 400),
        ("max_tokens 0", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
        ("prompt over the context", "POST", "/v1/completions",
         {"prompt": "a" * (ctx + 10), "max_tokens": 1}, 400),
        ("prompt + max_tokens over the context", "POST", "/v1/completions",
         {"prompt": "a" * (ctx // 2), "max_tokens": ctx}, 400),
        ("chat over the context", "POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "b" * (ctx + 10)}]}, 400),
        ("body too large", "POST", "/v1/completions",
         json.dumps({"prompt": "z" * (2 << 20)}).encode(), 413),
        ("bad path", "GET", "/v1/nothing", None, 404),
        ("bad path (POST)", "POST", "/v2/completions", {"prompt": "x"}, 404),
        ("GET on a POST route", "GET", "/v1/completions", None, 405),
        ("POST on a GET route", "POST", "/v1/models", {"prompt": "x"}, 405),
    ]
    for what, method, path, body, want in bad:
        if isinstance(body, bytes) or body is None:
            status, _, out = request(method, path, raw=body)
        else:
            status, _, out = request(method, path, body)
        err = error_of(status, out, want, what)
        print(f"  {what}: {status} {err['type']}: {err['message'][:90]}")
    check(completion_text(greedy) == text, "serving after errors")
    print("errors ok")

    # Memory: flat across 1,000 short requests (4 client threads).
    mem_start = time.time()
    counter = [0]
    lock = threading.Lock()
    snapshots = {}
    short = {"model": model, "prompt": "in the", "max_tokens": 2, "temperature": 1.0}

    def burst(total):
        def run():
            conn = http.client.HTTPConnection(HOST, PORT, timeout=60)
            while True:
                with lock:
                    if counter[0] >= total:
                        break
                    counter[0] += 1
                conn.request("POST", "/v1/completions", body=json.dumps(short).encode(),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                out = resp.read()
                if resp.status != 200:
                    errors.append(f"request {counter[0]}: {resp.status} {out[:200]!r}")
                    break
            conn.close()
        ts = [threading.Thread(target=run) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        check(not errors, f"short requests failed: {errors[:3]}")

    burst(50)
    snapshots[50] = wait_idle()["memory"]
    burst(1000)
    snapshots[1000] = wait_idle()["memory"]
    m50, m1000 = snapshots[50], snapshots[1000]
    check(m50["tracked"] == m1000["tracked"],
          f"tracked bytes changed between request 50 and 1000: {m50['tracked']} -> {m1000['tracked']}")
    growth = (m1000["rss_bytes"] - m50["rss_bytes"]) / m50["rss_bytes"]
    # Under AddressSanitizer (scripts/test_sanitizers.sh) freed memory stays in its quarantine
    # on purpose: only the tracked bytes are checked there.
    if "ASAN_OPTIONS" not in os.environ:
        check(abs(growth) <= 0.02, f"RSS grew {100 * growth:.2f}%: {m50['rss_bytes']} -> {m1000['rss_bytes']}")
    print(f"memory flat over 1,000 requests ({time.time() - mem_start:.1f} s): tracked "
          f"{m1000['tracked']}, RSS {m50['rss_bytes']} -> {m1000['rss_bytes']} ({100 * growth:+.2f}%)")


def queue():
    model = get("/v1/models")["data"][0]["id"]
    h = health()
    check(h["slots"] == 1, f"the queue test wants one slot: {h}")
    body = long_request(model, h["context"], min(2000, h["context"] - 64))
    # The server runs with --temperature 0: a request that sets none samples greedily too.
    del body["temperature"]
    results = [None] * 6

    def fire(i):
        try:
            results[i] = request("POST", "/v1/completions", body)
        except Exception as e:
            results[i] = (0, {}, repr(e).encode())

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r[0] for r in results)
    print("statuses with one slot and one queue place:", statuses)
    check(set(statuses) <= {200, 503}, f"statuses {statuses}")
    check(statuses.count(200) >= 2, f"the running and the queued request both complete: {statuses}")
    check(statuses.count(503) >= 1, f"no request was refused: {statuses}")
    texts = set()
    for status, _, out in results:
        if status == 503:
            err = error_of(status, out, 503, "queue full")
            check("queue" in err["message"].lower() or "busy" in err["message"].lower(),
                  f"503 message {err}")
        else:
            r = json.loads(out)
            check(r["usage"]["completion_tokens"] == body["max_tokens"], f"usage {r['usage']}")
            texts.add(r["choices"][0]["text"])
    check(len(texts) == 1, "the server's default temperature 0 was not applied")
    wait_idle()


def greedy(expected_file):
    model = get("/v1/models")["data"][0]["id"]
    with open(expected_file) as f:
        expected = f.read()
    text = completion_text({"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    check(text == expected, f"greedy text {text!r} != {expected!r}")
    s_text, _ = stream_completion_text({"model": model, "prompt": PROMPT, "max_tokens": 12,
                                        "temperature": 0})
    check(s_text == expected, f"greedy stream {s_text!r} != {expected!r}")
    print("greedy completion equals one process's:", repr(text))


def sigterm(pid):
    model = get("/v1/models")["data"][0]["id"]
    body = dict(long_request(model, health()["context"]), stream_options={"include_usage": True})
    conn, resp = open_stream("/v1/completions", body)
    it = events(resp)
    first = next(it)
    os.kill(pid, signal.SIGTERM)
    # Draining: new generation requests are refused while the stream goes on.
    deadline = time.time() + 10
    while True:
        status, _, out = request("POST", "/v1/completions",
                                 {"model": model, "prompt": "x", "max_tokens": 1})
        if status == 503:
            err = error_of(status, out, 503, "while shutting down")
            check("shutting down" in err["message"], f"503 message {err}")
            break
        check(time.time() < deadline, "new requests still accepted 10 s after SIGTERM")
        time.sleep(0.05)
    rest = list(it)
    conn.close()
    check(rest and rest[-1] == "[DONE]", f"the in-flight stream did not finish: {rest[-2:]}")
    usage = rest[-2]["usage"]
    text = first["choices"][0]["text"] + "".join(c["text"] for e in rest[:-1] for c in e["choices"])
    finish = [e for e in rest[:-1] if e["choices"]][-1]["choices"][0]["finish_reason"]
    check(finish == "length" and usage["completion_tokens"] == body["max_tokens"],
          f"the stream was cut short: {finish}, {usage}")
    print(f"SIGTERM during a stream: it completed ({usage['completion_tokens']} tokens, "
          f"{finish}, {len(text)} characters) and ended with [DONE]")


def main():
    global PORT
    mode, PORT = sys.argv[1], int(sys.argv[2])
    t0 = time.time()
    if mode == "basic":
        basic(sys.argv[3])
    elif mode == "queue":
        queue()
    elif mode == "greedy":
        greedy(sys.argv[3])
    elif mode == "sigterm":
        sigterm(int(sys.argv[3]))
    else:
        sys.exit(f"unknown mode {mode}")
    print(f"{mode}: PASS ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
