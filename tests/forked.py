"""``python -m speedrun ARGS`` as a real process, started by fork from an interpreter that has
already imported torch: what :func:`small_data.speedrun` uses, so that the suite's few hundred
command-line runs each save the 2-3 CPU-seconds a fresh interpreter spends importing torch (on a
2-core CPU, about a sixth of the suite's time).

Each pytest process (each xdist worker) starts one such server the first time it runs speedrun.
The server imports torch, numpy, pydantic and speedrun's command line and recipe modules, then
waits on a Unix socket. For each run it forks; the child takes the caller's standard streams
(passed as file descriptors), environment, working folder, ``sys.path[0]`` and ``sys.argv`` as
``python -m speedrun`` would have them, calls speedrun's ``main()`` and leaves the interpreter
as that command does (threads joined, atexit handlers run, streams flushed, the exit status of
``sys.exit``; not the teardown of every module, 0.7 s with torch loaded). The caller
gets its exit status (negative for a signal, as from ``subprocess``) and its output.

What such a child does not share with a fresh interpreter is what the imports did before it
existed. So a run goes to a fresh interpreter instead when anything read at those imports could
differ: any environment variable of torch's, its libraries' or Python's own (``TORCH*``,
``PYTORCH*``, ``OMP_*``, ``PYTHON*``, locales, ...) that is not what the server started with,
except ``TORCHINDUCTOR_CACHE_DIR``, which inductor reads when it compiles (speedrun's compile
module, which reads it when imported, is not imported by the server: checked there). Set
``SPEEDRUN_TEST_FRESH=1`` to run every command in a fresh interpreter. Tests of the installed
entry points themselves (``speedrun`` on PATH, ``python -m speedrun`` without arguments) start
them with :mod:`subprocess` directly.
"""
from __future__ import annotations

import array
import gc
import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

PRELOAD = ("torch", "numpy", "pydantic", "speedrun.cli", "speedrun.recipe", "speedrun.errors")
NOT_PRELOADED = ("speedrun.engine.compiling",)
"""Modules that read the environment when imported (the user's TORCHINDUCTOR_CACHE_DIR, before a
run sets its own): each child imports them itself."""

IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "ATEN_", "ONEDNN_", "DNNL_", "OMP_", "KMP_", "GOMP_", "MKL_",
                        "OPENBLAS_", "CUDA_", "NVIDIA_", "LD_", "MALLOC_", "PYTHON", "LC_", "LANG")
MAY_DIFFER = ("TORCHINDUCTOR_CACHE_DIR",)
SPEEDRUN_MAIN = str(Path(__file__).resolve().parents[1] / "src" / "speedrun" / "__main__.py")


def _relevant(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in MAY_DIFFER}


# ------------------------------------------------------------------------------------------
# the server (its own process) and each child it forks
# ------------------------------------------------------------------------------------------

def _recv_request(conn: socket.socket):
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        chunk, anc, _flags, _addr = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
        if not chunk:
            return None, []
        data += chunk
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def serve(path: str):
    """Serve runs on the socket at ``path`` until the process that started this one is gone;
    returns (in a forked child only) the request that child is to run."""
    for name in PRELOAD:
        __import__(name)
    leaked = [m for m in NOT_PRELOADED if m in sys.modules]
    if leaked:
        raise SystemExit(f"the test fork server imported {leaked}, which read the environment when imported")
    # the imports' objects out of the collector's sight: a child's collections would otherwise
    # write to every one of them, copying the pages the fork shares
    gc.collect()
    gc.freeze()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")            # (named `path` only once it listens: the caller waits for that name)
    listener.listen(16)
    os.rename(path + ".new", path)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    while os.getppid() == parent:
        for key, _ in sel.select(timeout=0.02):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ)
                continue
            conn = key.fileobj
            request, fds = _recv_request(conn)
            if request is None:
                sel.unregister(conn)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                for c in running.values():
                    c.close()
                for i, fd in enumerate(fds):
                    os.dup2(fd, i)
                    os.close(fd)
                conn.close()
                return request
            for fd in fds:
                os.close(fd)
            running[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        for pid in list(running):
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                conn = running.pop(pid)
                reply = {"returncode": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
                try:
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass
    raise SystemExit(0)


def run_child(request: dict) -> None:
    """In the forked child: become ``python -m speedrun ARGS`` and leave as it does."""
    import importlib

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]          # what `python -m` puts first
    importlib.invalidate_caches()
    sys.argv = [SPEEDRUN_MAIN, *request["args"]]
    from speedrun.cli import main       # (the signals' handlers are the server's: a fresh interpreter's)
    interrupted = False
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # what the interpreter does on leaving, short of tearing down its modules (0.7 s with torch
    # loaded, and nothing a run writes depends on it): wait for the threads, run the atexit
    # handlers, flush the streams; an uncaught Ctrl-C ends the process by SIGINT, as Python's does
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _server_main(path: str) -> None:
    run_child(serve(path))


# ------------------------------------------------------------------------------------------
# the caller's side
# ------------------------------------------------------------------------------------------

class _Server:
    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="speedrun-fork-")
        self.path = os.path.join(self.folder, "socket")
        self.env = dict(os.environ)
        self.python = sys.executable
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import forked; forked._server_main({self.path!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.folder, "log"), "w"),
                                     env=self.env)
        atexit.register(self.close)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the test fork server did not start: "
                                   + Path(self.folder, "log").read_text()[-2000:])
            time.sleep(0.02)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def fits(self, env: dict) -> bool:
        return self.proc.poll() is None and sys.executable == self.python and _relevant(env) == _relevant(self.env)


_server: _Server | None = None
cpu_seconds = 0.0
"""CPU-seconds of the forked runs this process has waited for, with those of the processes they
waited for: what ``getrusage(RUSAGE_CHILDREN)`` would count had each been this process's child."""


def _get_server(env: dict) -> _Server | None:
    global _server
    if env.get("SPEEDRUN_TEST_FRESH") == "1" or not hasattr(os, "fork"):
        return None
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    return _server if _server.fits(env) else None


def run(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python -m speedrun ARGS`` with ``env``, its output captured as text, as
    ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)`` gives it."""
    global cpu_seconds
    argv = [sys.executable, "-m", "speedrun", *args]
    server = _get_server(env)
    if server is None:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        proc.forked = False
        return proc
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(server.path)
        message = json.dumps({"args": list(args), "env": env, "cwd": os.getcwd()}).encode() + b"\n"
        sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, out_w, err_w]))])
    finally:
        os.close(out_w)
        os.close(err_w)
    deadline = time.monotonic() + timeout
    chunks = {out_r: [], err_r: []}
    replies = b""
    sel = selectors.DefaultSelector()
    sel.register(out_r, selectors.EVENT_READ)
    sel.register(err_r, selectors.EVENT_READ)
    sel.register(sock, selectors.EVENT_READ)
    pid = returncode = None
    try:
        while returncode is None or sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                raise subprocess.TimeoutExpired(argv, timeout)
            for key, _ in sel.select(timeout=min(left, 1.0)):
                if key.fileobj is sock:
                    data = sock.recv(65536)
                    if not data:
                        sel.unregister(sock)
                        if returncode is None:
                            raise RuntimeError("the test fork server ended during a run")
                        continue
                    replies += data
                    while b"\n" in replies:
                        line, replies = replies.split(b"\n", 1)
                        reply = json.loads(line)
                        pid = reply.get("pid", pid)
                        if "returncode" in reply:
                            returncode = reply["returncode"]
                            cpu_seconds += reply["cpu"]
                            sel.unregister(sock)
                else:
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        sel.unregister(key.fd)
    finally:
        sel.close()
        sock.close()
        os.close(out_r)
        os.close(err_r)
    def decode(fd):         # as text=True reads it: universal newlines
        return b"".join(chunks[fd]).decode().replace("\r\n", "\n").replace("\r", "\n")
    proc = subprocess.CompletedProcess(argv, returncode, decode(out_r), decode(err_r))
    proc.forked = True
    return proc
