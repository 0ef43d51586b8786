"""A real S3 HTTP endpoint on loopback for tests: moto in server mode on a free port, with the
standard AWS environment variables pointing at it (so the code under test finds it through the
standard credential chain and ``AWS_ENDPOINT_URL``, as it would a real endpoint)."""
from __future__ import annotations

import os
import socket
import uuid
from contextlib import contextmanager
from typing import Iterator

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
       "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class S3:
    def __init__(self, endpoint: str, log: list | None = None) -> None:
        self.endpoint = endpoint
        self.log = log if log is not None else []   # (method, path, query, range) a request

    def lists(self, since: int = 0) -> list[tuple[str, ...]]:
        """The LIST requests (ListObjects/ListObjectsV2: a GET of a bucket) made since
        ``len(self.log)`` was ``since``."""
        return [r for r in self.log[since:] if r[0] == "GET" and r[1].strip("/").count("/") == 0
                and r[1].strip("/")]

    def bucket(self, name: str | None = None) -> str:
        """A new empty bucket; returns its ``s3://`` URI."""
        import pyarrow.fs as pafs
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        fs = pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http",
                               allow_bucket_creation=True, access_key=ENV["AWS_ACCESS_KEY_ID"],
                               secret_key=ENV["AWS_SECRET_ACCESS_KEY"], region="us-east-1")
        fs.create_dir(name)
        return f"s3://{name}"

    @property
    def env(self) -> dict:
        return {**ENV, "AWS_ENDPOINT_URL": self.endpoint}


def _counting_server(port: int, log: list):
    """moto's ThreadedMotoServer with every request appended to ``log`` (so that tests can count
    the LISTs and GETs the code under test makes over HTTP)."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                               create_backend_app)
    from werkzeug.serving import make_server

    class Counting(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)

            def counted(environ, start_response):
                log.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                            environ.get("QUERY_STRING", ""), environ.get("HTTP_RANGE", "")))
                return app(environ, start_response)
            self._server = make_server(self._ip_address, self._port, counted, True,
                                       request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()
    return Counting(ip_address="127.0.0.1", port=port, verbose=False)


@contextmanager
def s3_server() -> Iterator[S3]:
    """Start moto's server, set the AWS environment for this process (child processes inherit
    it), and restore everything after."""
    import logging
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port, log = free_port(), []
    server = _counting_server(port, log)
    server.start()
    s3 = S3(f"http://127.0.0.1:{port}", log)
    saved = {k: os.environ.get(k) for k in s3.env}
    os.environ.update(s3.env)
    try:
        yield s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
