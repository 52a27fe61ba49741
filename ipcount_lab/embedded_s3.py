"""A real S3-compatible server on 127.0.0.1: s3proxy (Maven Central, through bin/setup) with
its filesystem backend, which keeps each bucket as a directory under ``<state_dir>/data``
and honours ``If-None-Match: *`` atomically - the conditional put every delta-rs commit
rests on. For the object-storage tests, and for trying tables on S3 without a cloud.

Clients find it through the standard AWS variables (:meth:`EmbeddedS3.environment`), which
delta-rs reads like every AWS tool.
"""
from __future__ import annotations

import logging
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ipcount.rules.config import STATE_DIR
from ipcount_lab.errors import ServiceStartError
from ipcount.rules.private_files import read_private_file, write_private_file
from ipcount_lab.service import Processes

log = logging.getLogger(__name__)
NAME = "s3proxy"  # its process (pid file and log under the state directory)
S3PROXY_JARS_DIR = STATE_DIR / "jars" / "s3proxy"


class ObjectStoreStartError(ServiceStartError):
    """The S3-compatible server did not start (the message says why, with its log's tail)."""


@dataclass(frozen=True)
class EmbeddedS3:
    state_dir: Path = STATE_DIR / "s3"
    port: int = 9000
    host: str = "127.0.0.1"  # the address it listens on (0.0.0.0 in a container)
    bucket: str = "ipcount"
    access_key_id: str = "ipcount"
    # False: requests are not signed-checked (a test's proxy that rewrites headers needs it).
    authorization: bool = True
    heap: str = "256m"

    @property
    def endpoint(self) -> str:
        """Where clients on this machine reach it."""
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"

    @property
    def processes(self) -> Processes:
        return Processes(self.state_dir)

    @property
    def log_file(self) -> Path:
        return self.processes.log_file(NAME)

    def uri(self, *parts: str) -> str:
        """``s3://<bucket>/<parts...>``."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def secret_access_key(self) -> str:
        """The server's secret, made once and kept in a private file of the state directory
        (unless written there before the first start, as docker-compose.yml does)."""
        path = self.state_dir / "secret"
        if not path.exists():
            write_private_file(path, secrets.token_urlsafe(24) + "\n")
        return read_private_file(path, "the embedded s3 secret")

    def environment(self) -> dict[str, str]:
        """The AWS variables that point delta-rs (and any AWS client) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret_access_key(), "AWS_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true"}

    def _jar(self) -> Path:
        jars = sorted(S3PROXY_JARS_DIR.glob("s3proxy-*-jar-with-dependencies.jar"))
        if not jars:
            raise ObjectStoreStartError(f"no s3proxy jar in {S3PROXY_JARS_DIR}; run bin/setup first")
        return jars[-1]

    def _write_config(self) -> Path:
        data = self.state_dir / "data"
        (data / self.bucket).mkdir(parents=True, exist_ok=True)  # a bucket is a directory here
        lines = [f"s3proxy.endpoint=http://{self.host}:{self.port}", "jclouds.provider=filesystem",
                 f"jclouds.filesystem.basedir={data}"]
        if self.authorization:
            lines += ["s3proxy.authorization=aws-v2-or-v4", f"s3proxy.identity={self.access_key_id}",
                      f"s3proxy.credential={self.secret_access_key()}"]
        else:
            lines += ["s3proxy.authorization=none"]
        return write_private_file(self.state_dir / "s3proxy.conf", "\n".join(lines) + "\n")

    def pid(self) -> int | None:
        return self.processes.pid(NAME)

    def is_serving(self) -> bool:
        """Whether it answers HTTP (an unsigned request is refused: that is an answer too)."""
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and wait until it answers."""
        if self.pid() is not None and self.is_serving():
            log.info("s3proxy already serving at %s", self.endpoint)
            return
        self.stop()  # this state directory's server on another port, if any: one at a time
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        log.info("starting s3proxy at %s (bucket %s, objects in %s)", self.endpoint, self.bucket,
                 self.state_dir / "data")
        proc = self.processes.launch(NAME, ["java", f"-Xmx{self.heap}", "-XX:TieredStopAtLevel=1", "-jar",
                                            str(self._jar()), "--properties", str(config)])
        self.processes.wait_ready(self.is_serving, timeout, ObjectStoreStartError, f"s3proxy at {self.endpoint}",
                                  NAME, proc)

    def serve(self) -> int:
        """Run in the foreground, a container's main process, until SIGTERM or SIGINT
        (:meth:`Processes.serve`); the exit code."""
        return self.processes.serve(NAME, self.start, self.stop)

    def stop(self, timeout: float = 15.0) -> None:
        self.processes.stop(timeout)
