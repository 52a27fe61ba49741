"""The embedded services' process handling (:mod:`ipcount_lab.service`), on real
processes: a pid file names only the process it started, a stop asks before it forces, and
a start that fails says why with its log, a kill returns once the port is closed, a service
in the foreground stops on a signal and fails when its process dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ipcount_lab.service import Processes, exited, free_port, listening, started_at


class Refused(RuntimeError):
    pass


def test_a_pid_file_names_its_own_process_only(tmp_path):
    procs = Processes(tmp_path)
    proc = procs.launch("sleeper", ["sleep", "60"])
    try:
        assert procs.pid("sleeper") == proc.pid and procs.names() == ["sleeper"]
        # After a reboot the same pid may be some other process: this one (pytest) is not ours.
        (tmp_path / "stranger.pid").write_text(f"{os.getpid()} {int(started_at(os.getpid())) + 1}\n")
        assert procs.pid("stranger") is None and procs.pids() == [proc.pid]
        procs.stop(timeout=10)
        assert proc.wait(timeout=5) is not None and procs.pid("sleeper") is None
        assert procs.names() == []     # the pid files of processes gone are removed, the stale one too
    finally:
        proc.kill()


def test_a_stop_kills_what_does_not_stop_when_asked(tmp_path):
    procs = Processes(tmp_path)
    proc = procs.launch("stubborn", ["sh", "-c", "trap '' TERM; echo started; while true; do sleep 0.1; done"])
    procs.wait_ready(lambda: "started" in procs.log_file("stubborn").read_text(), 10, Refused, "stubborn",
                     "stubborn", proc)
    started = time.monotonic()
    procs.stop(timeout=1)
    assert proc.wait(timeout=5) == -9 and procs.pid("stubborn") is None and 1 <= time.monotonic() - started < 5


def test_a_start_that_fails_says_why_with_its_log(tmp_path):
    procs = Processes(tmp_path)
    proc = procs.launch("broken", ["sh", "-c", "echo 'port 9 is taken'; exit 3"])
    with pytest.raises(Refused, match=r"(?s)broken thing exited with code 3 at start; .*broken.log:\nport 9 is taken"):
        procs.wait_ready(lambda: False, 10, Refused, "broken thing", "broken", proc)
    slow = procs.launch("slow", ["sleep", "60"])
    with pytest.raises(Refused, match="slow thing was not ready within 1 s"):
        procs.wait_ready(lambda: False, 1, Refused, "slow thing", "slow", slow)
    assert slow.wait(timeout=30) is not None           # stopped, not left behind


def test_a_pid_file_without_the_start_time_is_stale(tmp_path):
    # The format of earlier versions (and of a process gone before its start time was read):
    # the pid alone may be anybody's by now.
    (tmp_path / "old.pid").write_text(f"{os.getpid()}\n")
    assert Processes(tmp_path).pid("old") is None


LISTENER = """
import java.net.*;
public class Listener {
    public static void main(String[] args) throws Exception {
        ServerSocket socket = new ServerSocket(Integer.parseInt(args[0]), 50, InetAddress.getByName("127.0.0.1"));
        while (true) socket.accept();
    }
}
"""


def test_a_killed_jvm_has_closed_its_port_when_kill_returns(tmp_path):
    # A SIGKILLed JVM's main thread is a zombie well before its other threads are gone and
    # its sockets closed; a restart on the same port right after the kill used to find the
    # port taken. A touched heap makes the teardown long enough to see, three times in a row.
    source = tmp_path / "Listener.java"
    source.write_text(LISTENER)
    procs = Processes(tmp_path)
    for attempt in range(3):
        port = free_port()
        proc = procs.launch("jvm", ["java", "-Xms3g", "-Xmx3g", "-XX:+AlwaysPreTouch", str(source), str(port)])
        procs.wait_ready(lambda: listening(port), 60, Refused, "the listener", "jvm", proc)
        procs.kill("jvm")
        assert not listening(port), f"attempt {attempt}: port {port} still open after the kill returned"
        proc.wait(timeout=5)


# A service in the foreground, as `bin/lab s3 serve` runs it: its
# process prints "up" when ready.
SERVE = """
import sys
from pathlib import Path
from ipcount_lab.service import Processes

procs = Processes(Path(sys.argv[1]))

def start():
    proc = procs.launch("sleeper", ["sh", "-c", "echo up; exec sleep 60"])
    procs.wait_ready(lambda: "up" in procs.log_file("sleeper").read_text(), 10, RuntimeError, "it", "sleeper", proc)

sys.exit(procs.serve("sleeper", start, lambda: procs.stop(timeout=5)))
"""


def test_a_service_in_the_foreground_stops_on_a_signal_and_fails_when_its_process_dies(tmp_path):
    procs = Processes(tmp_path)

    def serve() -> tuple[subprocess.Popen, int]:
        server = subprocess.Popen([sys.executable, "-c", SERVE, str(tmp_path)], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while (pid := procs.pid("sleeper")) is None:
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[1]
            time.sleep(0.05)
        return server, pid

    for signum in (signal.SIGTERM, signal.SIGINT):   # docker stop; Ctrl-C in a terminal
        server, sleeper = serve()
        server.send_signal(signum)
        assert server.wait(timeout=30) == 0, server.communicate()[1]
        assert exited(sleeper) and procs.names() == []                  # stopped, not left behind
    server, sleeper = serve()
    os.kill(sleeper, signal.SIGKILL)
    _, err = server.communicate(timeout=30)
    assert server.returncode == 1 and f"sleeper exited; {procs.log_file('sleeper')}:\nup" in err, err
